-- skipjack schema, version 2: scheduled jobs, unique states, cancellation, queue controls, cron.

-- Jobs whose run_at is in the future wait in 'scheduled', out of the claim index; a stager
-- makes them 'available' when due.
ALTER TABLE {schema}.jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE {schema}.jobs ADD CONSTRAINT jobs_state_check CHECK (
    state IN ('scheduled', 'available', 'running', 'succeeded', 'discarded', 'cancelled'));
UPDATE {schema}.jobs SET state = 'scheduled' WHERE state = 'available' AND run_at > now();
CREATE INDEX jobs_scheduled_idx ON {schema}.jobs (run_at) WHERE state = 'scheduled';

-- An idempotency key is unique among the jobs whose state is in unique_states (a bit mask
-- over state_bit; 63 = every state, "forever").
CREATE FUNCTION {schema}.state_bit(state text) RETURNS smallint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE state WHEN 'scheduled' THEN 1 WHEN 'available' THEN 2 WHEN 'running' THEN 4
                      WHEN 'succeeded' THEN 8 WHEN 'discarded' THEN 16 WHEN 'cancelled' THEN 32
                      ELSE 0 END::smallint
$$;
ALTER TABLE {schema}.jobs ADD COLUMN unique_states smallint NOT NULL DEFAULT 63;
DROP INDEX {schema}.jobs_idempotency_key_idx;
CREATE UNIQUE INDEX jobs_unique_key_idx ON {schema}.jobs (idempotency_key)
    WHERE idempotency_key IS NOT NULL AND (unique_states & {schema}.state_bit(state)) <> 0;

-- Cancellation of a running job is requested on its row; the worker learns it at the next
-- heartbeat.
ALTER TABLE {schema}.jobs ADD COLUMN cancel_requested boolean NOT NULL DEFAULT false;

-- Running jobs per queue (global concurrency limits) and finished jobs by age (retention).
CREATE INDEX jobs_running_idx ON {schema}.jobs (queue) WHERE state = 'running';
CREATE INDEX jobs_finished_idx ON {schema}.jobs (finished_at) WHERE finished_at IS NOT NULL;

-- Wake workers only for jobs that are available now.
CREATE OR REPLACE FUNCTION {schema}.notify_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], d.queue)
       FROM (SELECT DISTINCT queue FROM new_jobs WHERE state = 'available') AS d;
    RETURN NULL;
END
$$;

-- Per-queue controls shared by every worker. A rate limit allows rate_limit starts per
-- window of rate_period seconds; a window opens at the first claim after the last one closed.
CREATE TABLE {schema}.queues (
    name              text PRIMARY KEY,
    paused            boolean NOT NULL DEFAULT false,
    concurrency_limit integer CHECK (concurrency_limit > 0),
    rate_limit        integer CHECK (rate_limit > 0),
    rate_period       double precision CHECK (rate_period > 0),
    window_start      timestamptz,
    window_count      integer NOT NULL DEFAULT 0,
    CHECK ((rate_limit IS NULL) = (rate_period IS NULL))
);

-- One row per cron slot ever enqueued or skipped: the primary key makes a slot happen at
-- most once, whatever number of schedulers run.
CREATE TABLE {schema}.cron_slots (
    name        text        NOT NULL,
    slot        timestamptz NOT NULL,
    status      text        NOT NULL CHECK (status IN ('enqueued', 'missed')),
    job_id      bigint,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, slot)
);
