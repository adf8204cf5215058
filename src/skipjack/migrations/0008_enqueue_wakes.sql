-- skipjack schema, version 8: the enqueue statements send their wake-ups themselves.
--
-- The statement trigger jobs_notify (versions 1-7) collected each inserting statement's rows
-- in a transition table and ran a query over them to find the queues to wake. The enqueue
-- statements (skipjack.sql.enqueue) now send the same notifications from their own RETURNING
-- rows, in the same transaction (delivered at commit), which costs the server less per
-- enqueue. Rows inserted by other SQL than skipjack's no longer wake workers: they are
-- claimed at the workers' next poll (poll_interval).
DROP TRIGGER jobs_notify ON {schema}.jobs;
DROP FUNCTION {schema}.notify_jobs();
