"""Statements of the maintenance duties: the stager, the rescuer, the pruner, the wake-ups
they send, the watch on PostgreSQL's notification queue and the analysis after growth.

Every wake-up is sent only while ``{schema}.may_notify()`` (migration 3) finds the
notification queue less than ``{schema}.notify_queue_limit()`` full, so that a full queue
skips the wake-up instead of failing the transaction; workers poll anyway."""

from __future__ import annotations

# Scheduled jobs that are due become available, oldest first, and their queues are woken
# while the notification queue has room (checked once per statement).
STAGE = """
WITH due AS (
    SELECT id FROM {schema}.jobs
     WHERE state = 'scheduled' AND run_at <= now() AND id <> ALL(%(skip)s::bigint[])
     ORDER BY run_at
     LIMIT %(limit)s
       FOR NO KEY UPDATE SKIP LOCKED
), staged AS (
    UPDATE {schema}.jobs AS j SET state = 'available' FROM due WHERE j.id = due.id
    RETURNING j.queue
), room AS MATERIALIZED (
    SELECT {schema}.may_notify() AS ok
)
SELECT s.queue, s.jobs,
       CASE WHEN room.ok THEN pg_notify(%(channel)s, s.queue) IS NOT NULL ELSE false END
           AS notified
  FROM (SELECT queue, count(*) AS jobs FROM staged GROUP BY queue) AS s CROSS JOIN room
"""

# Seconds (database clock) until the earliest scheduled job is due, or NULL when none is
# scheduled (one read of the end of jobs_scheduled_idx): the stager runs again then, if that
# is sooner than its interval.
NEXT_DUE = """
SELECT extract(epoch FROM min(run_at) - now())::float8 FROM {schema}.jobs
 WHERE state = 'scheduled'
"""

# After STAGE was refused because of some job (a trigger of the application's): the jobs it
# would stage (in a transaction rolled back afterwards), each then staged alone in a
# savepoint to find those it fails on. skip (ids) is usually empty.
STAGE_CANDIDATES = """
SELECT id FROM {schema}.jobs
 WHERE state = 'scheduled' AND run_at <= now() AND id <> ALL(%(skip)s::bigint[])
 ORDER BY run_at
 LIMIT %(limit)s
   FOR NO KEY UPDATE SKIP LOCKED
"""

STAGE_ONE = """
UPDATE {schema}.jobs SET state = 'available' WHERE id = %(id)s AND state = 'scheduled'
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
                  'started_at', j.attempted_at,
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
# Wake the workers of some queues (jobs made available by the rescuer or by hand), while the
# notification queue has room (checked once); one row per notification sent.
NOTIFY_QUEUES = """
SELECT pg_notify(%(channel)s, q) FROM unnest(%(queues)s::text[]) AS q
 WHERE (SELECT {schema}.may_notify())
"""

# How full PostgreSQL's notification queue is (0..1; the call also reclaims what every
# listener has read), whether wake-ups are being skipped and, while they are, the oldest
# session idle in a transaction: the likely one holding the queue back, since a session that
# LISTENs reads no notification while it is in a transaction. The session's columns are NULL
# when there is none, or when this role may not see it (pg_read_all_stats sees every one).
NOTIFY_QUEUE_STATUS = """
SELECT u.usage, u.usage >= {schema}.notify_queue_limit() AS skipping,
       {schema}.notify_queue_limit() AS notify_limit,
       h.pid, h.application_name, h.datname, h.state, h.xact_start
  FROM (SELECT pg_notification_queue_usage() AS usage) AS u
  LEFT JOIN LATERAL (
       SELECT pid, application_name, datname, state, xact_start FROM pg_stat_activity
        WHERE u.usage >= {schema}.notify_queue_limit()
          AND state IN ('idle in transaction', 'idle in transaction (aborted)')
          AND pid <> pg_backend_pid()
        ORDER BY xact_start
        LIMIT 1) AS h ON true
"""

# The analysis after growth (skipjack.runtime.maintenance.GrowthAnalysis), one transaction:
# the jobs table's size now and at its last statistics (pg_class.relpages, set by VACUUM and
# ANALYZE), in pages, whether this role may analyse it, and whether to analyse it now.
# May: the table's owner or a member of the owner's role (superusers included), the
# database's owner, or from PostgreSQL 17 on a role with the MAINTAIN privilege on it. Now:
# it has grown to min_pages or more and to `growth` times its pages at the last statistics
# or more; no other session holds a lock on it that ANALYZE would wait for (a VACUUM or
# ANALYZE running, autovacuum's too, a CREATE INDEX, DDL): skipping the turn leaves nothing
# in the server's log, where a skipped ANALYZE writes a warning; and no other worker is
# analysing it (a transaction-scoped advisory lock on a key made from the schema's name).
# The conditions after the size are read only when the size calls for an analysis.
ANALYZE_CHECK = """
SELECT s.pages, s.relpages, s.may_analyze,
       CASE WHEN s.may_analyze AND s.pages >= %(min_pages)s
                 AND s.pages >= %(growth)s * greatest(s.relpages, 1)
            THEN NOT EXISTS (
                     SELECT 1 FROM pg_locks AS l
                      WHERE l.locktype = 'relation' AND l.database = s.datid
                        AND l.relation = s.oid AND l.granted AND l.pid <> pg_backend_pid()
                        AND l.mode IN ('ShareUpdateExclusiveLock', 'ShareLock',
                                       'ShareRowExclusiveLock', 'ExclusiveLock',
                                       'AccessExclusiveLock'))
                 AND pg_try_advisory_xact_lock(
                         hashtextextended('skipjack.analyze:' || %(schema)s, 0))
            ELSE false
       END AS analyze
  FROM (SELECT c.oid, d.oid AS datid, c.relpages::bigint AS relpages,
               pg_relation_size(c.oid) / current_setting('block_size')::bigint AS pages,
               pg_has_role(c.relowner, 'USAGE') OR pg_has_role(d.datdba, 'USAGE')
               OR (current_setting('server_version_num')::int >= 170000
                   AND has_table_privilege(c.oid, 'MAINTAIN')) AS may_analyze
          FROM pg_class AS c
          JOIN pg_namespace AS n ON n.oid = c.relnamespace
          JOIN pg_database AS d ON d.datname = current_database()
         WHERE n.nspname = %(schema)s AND c.relname = 'jobs') AS s
"""

# New statistics for the planner; every session's cached plans that read the table are
# planned again at their next use. SKIP_LOCKED: a lock taken on the table since the check
# skips this turn.
ANALYZE_JOBS = "ANALYZE (SKIP_LOCKED) {schema}.jobs"

# Count the jobs that finished since the last rollup into the per-minute throughput table
# (read on jobs_finished_idx), up to 30 seconds ago (a job's finished_at is the time of its
# outcome statement, whose transaction commits right after it: a later-committing one would
# be missed) and at most one hour per run; then move the watermark. One rollup runs at a time
# (the watermark row is taken with SKIP LOCKED: another worker's run skips this turn). Returns
# no row when another rollup holds the watermark, else the new watermark and whether more
# is left to count.
ROLLUP_THROUGHPUT = """
WITH w AS (
    SELECT through,
           least(statement_timestamp() - interval '30 seconds',
                 through + interval '1 hour') AS upto
      FROM {schema}.throughput_watermark FOR UPDATE SKIP LOCKED
), counted AS (
    INSERT INTO {schema}.throughput AS t
           (minute, queue, state, jobs, started, latency_sum, latency_max)
    SELECT date_bin(interval '1 minute', j.finished_at, timestamptz '2000-01-01 00:00Z'),
           j.queue, j.state, count(*),
           count(*) FILTER (WHERE j.attempted_at >= j.run_at),
           coalesce(sum(extract(epoch FROM j.attempted_at - j.run_at))
                    FILTER (WHERE j.attempted_at >= j.run_at), 0),
           max(extract(epoch FROM j.attempted_at - j.run_at))
               FILTER (WHERE j.attempted_at >= j.run_at)
      FROM {schema}.jobs AS j, w
     WHERE j.finished_at >= w.through AND j.finished_at < w.upto
     GROUP BY 1, 2, 3
    ON CONFLICT (minute, queue, state) DO UPDATE
       SET jobs = t.jobs + EXCLUDED.jobs, started = t.started + EXCLUDED.started,
           latency_sum = t.latency_sum + EXCLUDED.latency_sum,
           latency_max = greatest(t.latency_max, EXCLUDED.latency_max)
    RETURNING 1
)
UPDATE {schema}.throughput_watermark AS m
   SET through = greatest(w.through, w.upto)
  FROM w
RETURNING m.through, w.upto < statement_timestamp() - interval '30 seconds' AS behind,
          (SELECT count(*) FROM counted) AS rows
"""

# Throughput rows past the eight days the dashboard charts.
PRUNE_THROUGHPUT = """
DELETE FROM {schema}.throughput WHERE minute < statement_timestamp() - interval '8 days'
"""
