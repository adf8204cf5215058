-- skipjack schema, version 6: waiting for a job's outcome, a running job's progress, and
-- delayed jobs started on time.

-- The latest progress a handler reported (skipjack.JobContext.progress): any JSON value,
-- written at most once a second per job and fenced like every write of its worker.
ALTER TABLE {schema}.jobs ADD COLUMN progress jsonb;

-- Set by a caller waiting for this job's outcome (skipjack.JobHandle.result): only then
-- does the job's end send a notification. Adding a column with a constant default rewrites
-- nothing.
ALTER TABLE {schema}.jobs ADD COLUMN awaited boolean NOT NULL DEFAULT false;

-- Every path that ends a job (an outcome, a rescue on the last attempt, a cancel or discard by
-- hand) sets its state, so one trigger tells every waiter, on the schema's channel for ends
-- (skipjack.db.done_channel_name) with the job id as payload, delivered at commit. Its condition is checked on
-- each row whose state is set; it is false for nearly all of them, and then nothing is
-- queued. Skipped while the notification queue is too full (see may_notify): waiters also
-- poll.
CREATE FUNCTION {schema}.notify_finished() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF {schema}.may_notify() THEN
        PERFORM pg_notify(TG_ARGV[0], NEW.id::text);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_finished AFTER UPDATE OF state ON {schema}.jobs
    FOR EACH ROW
    WHEN (NEW.awaited AND NEW.state IN ('succeeded', 'discarded', 'cancelled'))
    EXECUTE FUNCTION {schema}.notify_finished({done_channel});

-- An enqueue of jobs that run later also says, on the schema's channel for due times
-- (skipjack.db.due_channel_name), in how many seconds the soonest of them is due: workers run
-- their stager then, whatever its interval, so a delayed job starts on time. The payload is a
-- number of seconds, never job data.
CREATE OR REPLACE FUNCTION {schema}.notify_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    queues text[];
    soonest double precision;
BEGIN
    SELECT array_agg(DISTINCT queue) FILTER (WHERE state = 'available'),
           extract(epoch FROM min(run_at) FILTER (WHERE state = 'scheduled')
                              - clock_timestamp())
      INTO queues, soonest FROM new_jobs;
    IF (queues IS NOT NULL OR soonest IS NOT NULL) AND {schema}.may_notify() THEN
        PERFORM pg_notify(TG_ARGV[0], q) FROM unnest(queues) AS q;
        IF soonest IS NOT NULL THEN
            PERFORM pg_notify({due_channel}, greatest(soonest, 0)::text);
        END IF;
    END IF;
    RETURN NULL;
END
$$;
