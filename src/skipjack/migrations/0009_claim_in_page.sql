-- skipjack schema, version 9: fewer writes per job between its claim and its outcome.
--
-- A claim and an outcome each write a new version of the job's row, and every index whose
-- condition the new version meets gets an entry for it (a job's state is in the indexes'
-- conditions, so these are never HOT updates).
--
-- 1. The running jobs had two partial indexes, jobs_lease_idx (lease_expires_at) for the
--    rescuer and jobs_running_idx (queue) for the running count of a queue with a
--    concurrency limit, so a claim wrote an entry in each. One index on (queue,
--    lease_expires_at) serves both: a queue's running jobs whose lease is still live are one
--    range of it, and the rescuer reads the entries of the running jobs, which there are as
--    many of as the workers run at once.
-- 2. A claim takes up to 100 jobs enqueued together, the rows of a few full pages, and
--    writes the new versions of all of them in one transaction: at a fill factor of 90 most
--    did not fit in their page, so each moved to another page, which costs a row lock record
--    in the WAL besides the update's, and a whole copy of the row where a version in the
--    same page logs only the bytes that changed. At 50 a page keeps room for the next
--    version of each row it was filled with. In a drain of 10,000 no-op jobs (`skipjack
--    bench`, W2) this took the WAL written from 963 to 693 bytes a job (full-page images
--    aside); docs/performance.md, "Fewer writes per job (schema version 9)".
DROP INDEX {schema}.jobs_lease_idx;
DROP INDEX {schema}.jobs_running_idx;
CREATE INDEX jobs_running_idx ON {schema}.jobs (queue, lease_expires_at) WHERE state = 'running';
ALTER TABLE {schema}.jobs SET (fillfactor = 50);
