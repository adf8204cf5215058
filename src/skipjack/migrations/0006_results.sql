-- skipjack schema, version 6: waiting for a job's outcome, and a running job's progress.

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
