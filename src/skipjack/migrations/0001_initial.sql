-- skipjack schema, version 1.
-- Placeholders: {schema} (quoted identifier) and {channel} (literal) are filled by migrate.py
-- with psycopg.sql; literal braces are written doubled.

CREATE TABLE {schema}.jobs (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue            text        NOT NULL,
    task             text        NOT NULL,
    args             jsonb       NOT NULL DEFAULT '{{}}',
    args_bytes       integer     NOT NULL DEFAULT 0,  -- serialised size at enqueue
    priority         smallint    NOT NULL DEFAULT 0,
    state            text        NOT NULL DEFAULT 'available'
                     CHECK (state IN ('available', 'running', 'succeeded', 'discarded', 'cancelled')),
    attempt          integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL DEFAULT 25 CHECK (max_attempts >= 1),
    run_at           timestamptz NOT NULL DEFAULT now(),
    created_at       timestamptz NOT NULL DEFAULT now(),
    attempted_at     timestamptz,
    finished_at      timestamptz,
    lease_expires_at timestamptz,
    lease_version    bigint      NOT NULL DEFAULT 0,
    lease_seconds    double precision CHECK (lease_seconds > 0),  -- NULL: the worker's lease
    worker           text,
    idempotency_key  text,
    errors           jsonb       NOT NULL DEFAULT '[]',
    result           jsonb
);

-- The claim reads runnable rows of one queue in (priority DESC, run_at, id) order; finished
-- history never enters this index.
CREATE INDEX jobs_claim_idx ON {schema}.jobs (queue, priority DESC, run_at, id)
    WHERE state = 'available';

-- The rescuer looks for running jobs whose lease expired.
CREATE INDEX jobs_lease_idx ON {schema}.jobs (lease_expires_at) WHERE state = 'running';

-- Idempotency keys are unique for the life of the row.
CREATE UNIQUE INDEX jobs_idempotency_key_idx ON {schema}.jobs (idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Queue tables churn: vacuum and analyze far sooner than the defaults (0.2 / 0.1).
ALTER TABLE {schema}.jobs SET (
    autovacuum_vacuum_scale_factor = 0.05,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_limit = 2000,
    fillfactor = 90
);

-- One wakeup per queue per inserting statement, delivered at commit. The payload is the queue
-- name (at most 63 bytes), never job data. PostgreSQL also folds identical notifications
-- raised in one transaction into one.
CREATE FUNCTION {schema}.notify_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], d.queue)
       FROM (SELECT DISTINCT queue FROM new_jobs WHERE run_at <= now()) AS d;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_notify AFTER INSERT ON {schema}.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_jobs({channel});
