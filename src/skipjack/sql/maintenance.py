"""Statements of the maintenance duties: the stager, the rescuer, the pruner and the wake-ups
they send."""

from __future__ import annotations

# Scheduled jobs that are due become available, oldest first, and their queues are woken.
STAGE = """
WITH due AS (
    SELECT id FROM {schema}.jobs
     WHERE state = 'scheduled' AND run_at <= now()
     ORDER BY run_at
     LIMIT %(limit)s
       FOR NO KEY UPDATE SKIP LOCKED
), staged AS (
    UPDATE {schema}.jobs AS j SET state = 'available' FROM due WHERE j.id = due.id
    RETURNING j.queue
)
SELECT queue, count(*) AS jobs, pg_notify(%(channel)s, queue) IS NULL AS notified
  FROM staged GROUP BY queue
"""

# Step 1: candidates whose lease expired, with the fencing token seen now.
RESCUE_CANDIDATES = """
SELECT id, lease_version FROM {schema}.jobs
 WHERE state = 'running' AND lease_expires_at < now()
 ORDER BY lease_expires_at
 LIMIT %(limit)s
"""

# Step 2: return them to the queue (or to the dead letter on the last attempt). Guarded by
# the token read in step 1 and by the lease still being expired, so a completion or a new
# claim that landed between the two steps is never overwritten. SKIP LOCKED lets many
# rescuers and the workers' own outcome writes run at once without waiting on each other.
RESCUE = """
UPDATE {schema}.jobs AS j
   SET state = CASE WHEN j.cancel_requested THEN 'cancelled'
                    WHEN j.attempt >= j.max_attempts THEN 'discarded'
                    ELSE 'available' END,
       run_at = now(),
       finished_at = CASE WHEN j.cancel_requested OR j.attempt >= j.max_attempts
                          THEN now() END,
       lease_expires_at = NULL,
       worker = NULL,
       errors = j.errors || jsonb_build_array(jsonb_build_object(
                  'attempt', j.attempt, 'at', now(), 'worker', j.worker,
                  'error', 'lease expired: the worker stopped renewing it (crashed or stalled)'))
  FROM (SELECT s.id FROM {schema}.jobs AS s
          JOIN unnest(%(id)s::bigint[], %(lease_version)s::bigint[]) AS c(id, lease_version)
            ON s.id = c.id AND s.lease_version = c.lease_version
         WHERE s.state = 'running' AND s.lease_expires_at < now()
         ORDER BY s.id
           FOR NO KEY UPDATE OF s SKIP LOCKED) AS r
 WHERE j.id = r.id
RETURNING j.id, j.state, j.queue
"""
# Delete finished jobs of the given states older than `age` seconds, oldest first, in a
# batch locked with SKIP LOCKED (no waiting on workers, bulk cancels or other pruners).
PRUNE = """
WITH old AS (
    SELECT id FROM {schema}.jobs
     WHERE finished_at < now() - make_interval(secs => %(age)s)
       AND state = ANY(%(states)s::text[])
     ORDER BY finished_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.jobs AS j USING old WHERE j.id = old.id
RETURNING j.id
"""

# Cron history recorded more than `age` seconds ago (the caller passes at least the longest
# grace a schedule may have, so no slot still inside its grace window goes), keeping each
# schedule's latest slot, where the scheduler resumes from: slots before it are never
# planned again, whether their record and their job are kept or not.
PRUNE_CRON = """
DELETE FROM {schema}.cron_slots AS c
 WHERE c.recorded_at < now() - make_interval(secs => %(age)s)
   AND c.slot < (SELECT max(slot) FROM {schema}.cron_slots AS l WHERE l.name = c.name)
"""
# Wake the workers of some queues (jobs made available by the rescuer or by hand).
NOTIFY_QUEUES = """
SELECT pg_notify(%(channel)s, q) FROM unnest(%(queues)s::text[]) AS q
"""
