-- skipjack schema, version 7: the due-time notification says when, not in how long.

-- An enqueue of jobs that run later says, on the schema's channel for due times
-- (skipjack.db.due_channel_name), when the soonest of them is due: its run_at as seconds
-- since 1970-01-01 UTC on the database's clock. Version 6 sent the seconds left at the
-- insert, so a job enqueued in a transaction that stayed open for a while was staged that
-- much later than due. The payload is a number, never job data.
CREATE OR REPLACE FUNCTION {schema}.notify_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    queues text[];
    soonest numeric;  -- extract's own type: exact to the microsecond
BEGIN
    SELECT array_agg(DISTINCT queue) FILTER (WHERE state = 'available'),
           extract(epoch FROM min(run_at) FILTER (WHERE state = 'scheduled'))
      INTO queues, soonest FROM new_jobs;
    IF (queues IS NOT NULL OR soonest IS NOT NULL) AND {schema}.may_notify() THEN
        PERFORM pg_notify(TG_ARGV[0], q) FROM unnest(queues) AS q;
        IF soonest IS NOT NULL THEN
            -- numeric's text (float8's would depend on the session's extra_float_digits)
            PERFORM pg_notify({due_channel}, soonest::text);
        END IF;
    END IF;
    RETURN NULL;
END
$$;
