"""Statements behind ``skipjack.JobHandle`` (waiting for a job's outcome) and a
handler's progress reports."""

from __future__ import annotations

# A caller is about to wait for this job: its end will be announced (the jobs_finished
# trigger of migration 6). A finished job is left as it is; so is one already awaited (no
# write at all). It never waits on a row lock (SKIP LOCKED): a transaction="claim" job's row
# stays locked while its handler runs, and a claim's for an instant. One row when the mark
# is done (made now, made before, or not needed: the job ended); none when the row was
# locked, and the waiter tries again. The mark's own row lock may have made a claim skip an
# available job: the job's queue is then woken again.
MARK_AWAITED = """
WITH marked AS (
    UPDATE {schema}.jobs SET awaited = true
     WHERE id = (SELECT id FROM {schema}.jobs
                  WHERE id = %(id)s AND NOT awaited
                    AND state IN ('scheduled', 'available', 'running')
                    FOR NO KEY UPDATE SKIP LOCKED)
    RETURNING queue, state
)
SELECT pg_notify(%(channel)s, queue)::text FROM marked
 WHERE state = 'available' AND {schema}.may_notify()
UNION ALL
SELECT NULL FROM marked WHERE NOT (state = 'available' AND {schema}.may_notify())
UNION ALL
SELECT NULL FROM {schema}.jobs
 WHERE id = %(id)s AND (awaited OR state NOT IN ('scheduled', 'available', 'running'))
"""

# What a waiter reads: the state, the result or the errors, and the progress.
JOB_OUTCOME = """
SELECT state, result, errors, progress, attempt, max_attempts
  FROM {schema}.jobs WHERE id = %(id)s
"""

# The latest progress of running jobs, fenced like the outcome: a job whose lease this worker
# lost keeps what its new owner wrote. One JSON array of {id, lease_version, progress}. It
# never waits on a row lock (SKIP LOCKED, as the heartbeat); it returns the ids written, and
# the worker tries the others again at its next write. Rows are found by primary key, as in
# RECORD_OUTCOMES.
RECORD_PROGRESS = """
WITH p AS (
    SELECT * FROM json_to_recordset(%(progress)s::json)
                  AS p(id bigint, lease_version bigint, progress jsonb)
), locked AS (
    SELECT j.id, p.progress FROM {schema}.jobs AS j
      JOIN p ON j.id = p.id AND j.lease_version = p.lease_version
     WHERE j.id = ANY(ARRAY(SELECT (e ->> 'id')::bigint
                              FROM json_array_elements(%(progress)s::json) AS e))
       AND j.state = 'running'
       FOR NO KEY UPDATE OF j SKIP LOCKED
)
UPDATE {schema}.jobs AS j SET progress = locked.progress FROM locked WHERE j.id = locked.id
RETURNING j.id
"""
