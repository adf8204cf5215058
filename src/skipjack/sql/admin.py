"""Statements for operators: inspection, cancellation, the dead letter and queue settings."""

from __future__ import annotations

STATS = """
SELECT queue, state, count(*) AS jobs FROM {schema}.jobs GROUP BY queue, state ORDER BY 1, 2
"""

# How many jobs wait and run per queue: served by the partial indexes, whatever the history.
QUEUE_DEPTH = """
SELECT queue, state, count(*) FROM {schema}.jobs
 WHERE state IN ('scheduled', 'available', 'running') GROUP BY queue, state ORDER BY 1, 2
"""

# The waiting, running and dead-letter jobs per queue for metrics: one count per state, each
# on the partial index of its state (jobs_scheduled_idx, jobs_claim_idx, jobs_running_idx,
# jobs_discarded_idx), so succeeded history is never read. The available row also gives the
# age of the queue's oldest runnable job (seconds, database clock; NULL for the other rows),
# read in the same pass.
QUEUE_GAUGES = """
SELECT queue, 'scheduled' AS state, count(*), NULL::float8 FROM {schema}.jobs
 WHERE state = 'scheduled' GROUP BY queue
UNION ALL
SELECT queue, 'available', count(*),
       extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now()))::float8
  FROM {schema}.jobs WHERE state = 'available' GROUP BY queue
UNION ALL
SELECT queue, 'running', count(*), NULL FROM {schema}.jobs WHERE state = 'running' GROUP BY queue
UNION ALL
SELECT queue, 'discarded', count(*), NULL FROM {schema}.jobs
 WHERE state = 'discarded' GROUP BY queue
"""

# The planner's estimate of the table's rows (history included), for free.
ESTIMATED_ROWS = """
SELECT greatest(c.reltuples, 0)::bigint FROM pg_class AS c
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE n.nspname = %(schema)s AND c.relname = 'jobs'
"""

OLDEST_RUNNABLE = """
SELECT queue, extract(epoch FROM now() - min(run_at))::float8 AS age_seconds
  FROM {schema}.jobs
 WHERE state = 'available' AND run_at <= now()
 GROUP BY queue ORDER BY queue
"""

LIST_JOBS = """
SELECT id, queue, task, state, attempt, max_attempts, priority, run_at, created_at,
       finished_at, errors -> -1 AS last_error
  FROM {schema}.jobs
 WHERE (%(state)s::text IS NULL OR state = %(state)s)
   AND (%(queue)s::text IS NULL OR queue = %(queue)s)
 ORDER BY id DESC
 LIMIT %(limit)s
"""

GET_JOB = """
SELECT id, queue, task, args, state, attempt, max_attempts, priority, run_at, created_at,
       attempted_at, finished_at, lease_expires_at, lease_version, worker, idempotency_key,
       cancel_requested, errors, result, metadata, progress
  FROM {schema}.jobs WHERE id = %(id)s
"""

# Send waiting jobs to the dead letter by hand (running ones are left alone).
DISCARD_WAITING = """
UPDATE {schema}.jobs SET state = 'discarded', finished_at = now()
 WHERE id = ANY(%(id)s::bigint[]) AND state IN ('scheduled', 'available')
RETURNING id
"""

# Which jobs: given ids, and/or a queue, and/or a task (NULL matches all). Both statements
# take rows in id order with SKIP LOCKED, so they never wait on (or deadlock with) workers or
# pruners; the caller repeats them until CANCEL_PENDING finds nothing left.
_CANCEL_FILTER = """(%(id)s::bigint[] IS NULL OR id = ANY(%(id)s::bigint[]))
       AND (%(queue)s::text IS NULL OR queue = %(queue)s)
       AND (%(task)s::text IS NULL OR task = %(task)s)"""

CANCEL_WAITING = """
WITH c AS (
    SELECT id FROM {schema}.jobs
     WHERE state IN ('scheduled', 'available') AND """ + _CANCEL_FILTER + """
     ORDER BY id LIMIT %(limit)s FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE {schema}.jobs AS j SET state = 'cancelled', finished_at = now()
  FROM c WHERE j.id = c.id
RETURNING j.id
"""

REQUEST_CANCEL = """
WITH c AS (
    SELECT id FROM {schema}.jobs
     WHERE state = 'running' AND NOT cancel_requested AND """ + _CANCEL_FILTER + """
     ORDER BY id LIMIT %(limit)s FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE {schema}.jobs AS j SET cancel_requested = true FROM c WHERE j.id = c.id
RETURNING j.id
"""

CANCEL_PENDING = """
SELECT count(*) FROM {schema}.jobs
 WHERE (state IN ('scheduled', 'available') OR (state = 'running' AND NOT cancel_requested))
   AND """ + _CANCEL_FILTER + """
"""
SET_PAUSED = """
INSERT INTO {schema}.queues (name, paused) VALUES (%(queue)s, %(paused)s)
ON CONFLICT (name) DO UPDATE SET paused = EXCLUDED.paused
"""

SET_LIMITS = """
INSERT INTO {schema}.queues (name, concurrency_limit, rate_limit, rate_period)
VALUES (%(queue)s, %(concurrency)s, %(rate)s, %(period)s)
ON CONFLICT (name) DO UPDATE
   SET concurrency_limit = EXCLUDED.concurrency_limit, rate_limit = EXCLUDED.rate_limit,
       rate_period = EXCLUDED.rate_period, window_start = NULL, window_count = 0
"""

# A queue's settings changed: tell the workers (see settings_channel_name), while the
# notification queue has room (they re-read settings at every poll anyway).
NOTIFY_SETTINGS = """
SELECT pg_notify(%(channel)s, %(queue)s) WHERE {schema}.may_notify()
"""

LIST_QUEUES = """
SELECT name, paused, concurrency_limit, rate_limit, rate_period FROM {schema}.queues ORDER BY 1
"""
# Re-enqueue discarded (dead-letter) jobs: a fresh set of attempts, runnable now. A job whose
# idempotency key another job now holds is left alone (that one keeps the key). One row per
# distinct id asked for, saying what became of it: its queue when retried, else its state as
# read (NULL: no such job) and the job holding its key, if any. Of discarded jobs asked for
# that share a key (possible when their unique_while leaves out 'discarded'), the newest is
# retried and the others are left alone, held by it. A holder inserted by a transaction that
# commits while this runs makes the statement fail with a unique violation; the caller runs
# it again, and then sees the holder.
RETRY_DISCARDED = """
WITH asked AS (
    SELECT DISTINCT a.id FROM unnest(%(id)s::bigint[]) AS a(id)
), candidates AS (
    SELECT j.id, j.idempotency_key FROM {schema}.jobs AS j JOIN asked ON asked.id = j.id
     WHERE j.state = 'discarded'
), chosen AS (
    -- of discarded jobs asked for that share a key, only the newest can be retried (one
    -- sort, not a correlated scan: the planner may think candidates holds a single row)
    SELECT DISTINCT ON (c.idempotency_key, CASE WHEN c.idempotency_key IS NULL THEN c.id END)
           c.id
      FROM candidates AS c
     ORDER BY c.idempotency_key, CASE WHEN c.idempotency_key IS NULL THEN c.id END, c.id DESC
), retried AS (
    UPDATE {schema}.jobs AS j
       SET state = 'available', attempt = 0, run_at = now(), finished_at = NULL,
           cancel_requested = false
      FROM chosen
     WHERE j.id = chosen.id AND j.state = 'discarded'
       AND (j.idempotency_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {schema}.jobs AS o
             WHERE o.idempotency_key = j.idempotency_key AND o.id <> j.id
               AND (o.unique_states & {schema}.state_bit(o.state)) <> 0))
    RETURNING j.id, j.queue, j.idempotency_key
)
SELECT asked.id, r.queue, j.state, j.idempotency_key, h.id AS holder, h.state AS holder_state
  FROM asked
  LEFT JOIN retried AS r ON r.id = asked.id
  LEFT JOIN {schema}.jobs AS j ON j.id = asked.id
  LEFT JOIN LATERAL (
       SELECT k.id, k.state FROM (
           SELECT o.id, o.state FROM {schema}.jobs AS o
            WHERE o.idempotency_key = j.idempotency_key AND o.id <> j.id
              AND (o.unique_states & {schema}.state_bit(o.state)) <> 0
           UNION ALL  -- a job retried by this statement (the snapshot shows it discarded)
           SELECT n.id, 'available' FROM retried AS n
            WHERE n.idempotency_key = j.idempotency_key AND n.id <> j.id) AS k
        WHERE r.id IS NULL
        ORDER BY k.id LIMIT 1) AS h ON true
"""

# A search's time limit, for its transaction only (milliseconds, as text).
SET_STATEMENT_TIMEOUT = "SELECT set_config('statement_timeout', %(ms)s, true)"

# Finished jobs per `bucket` (an interval) and state over the last `span`, from the throughput
# rollup (never the jobs table), for one queue or all (NULL): jobs, how many of them have a
# start latency, its sum and its maximum (seconds). Buckets are aligned to UTC.
THROUGHPUT = """
SELECT date_bin(%(bucket)s::interval, minute, timestamptz '2000-01-01 00:00Z') AS at, state,
       sum(jobs)::bigint AS jobs, sum(started)::bigint AS started,
       sum(latency_sum) AS latency_sum, max(latency_max) AS latency_max
  FROM {schema}.throughput
 WHERE minute >= statement_timestamp() - %(span)s::interval
   AND (%(queue)s::text IS NULL OR queue = %(queue)s)
 GROUP BY 1, 2 ORDER BY 1, 2
"""

# Finished jobs per queue and state over the last `span` (from the rollup).
THROUGHPUT_BY_QUEUE = """
SELECT queue, state, sum(jobs)::bigint FROM {schema}.throughput
 WHERE minute >= statement_timestamp() - %(span)s::interval
 GROUP BY 1, 2 ORDER BY 1, 2
"""

# The running jobs (jobs_running_idx: never the history), for the workers page.
RUNNING_JOBS = """
SELECT id, queue, task, attempt, max_attempts, attempted_at, lease_expires_at, worker,
       cancel_requested
  FROM {schema}.jobs WHERE state = 'running' ORDER BY worker, id LIMIT %(limit)s
"""

# The conditions a job search may combine (see skipjack.search.JobFilter); each is constant
# text with bound values, ANDed in a fixed order by job_search(). The time range applies to
# created_at or finished_at, chosen by name from TIME_COLUMNS, never from request text.
SEARCH_CONDITIONS = {
    "state": "state = %(state)s",
    "queue": "queue = %(queue)s",
    "task": "task = %(task)s",
    "idempotency_key": "idempotency_key = %(idempotency_key)s",
    "id": "id = %(id)s",
    "since": "{time} >= %(since)s",
    "until": "{time} < %(until)s",
    "error": """EXISTS (
                 SELECT 1 FROM jsonb_array_elements(CASE WHEN jsonb_typeof(errors) = 'array'
                                                         THEN errors END) AS e
                  WHERE strpos(lower(e ->> 'error'), lower(%(error)s)) > 0)""",
    "before": "id < %(before)s",
    "after": "id > %(after)s",
}
TIME_COLUMNS = {"created": "created_at", "finished": "finished_at"}

# The page of a search: newest first (keyset pagination on the primary key: `before` for older
# pages), or oldest first from `after` (for newer pages; the caller reverses them).
_SEARCH_COLUMNS = """id, queue, task, state, attempt, max_attempts, priority, run_at, created_at,
       finished_at, idempotency_key,
       CASE WHEN jsonb_typeof(errors -> -1) = 'object' THEN errors -> -1 ->> 'error' END
           AS last_error"""


def job_search(conditions: tuple[str, ...], time: str, *, ids_only: bool = False,
               ascending: bool = False) -> str:
    """The template of a job search with the named ``SEARCH_CONDITIONS`` (in their fixed
    order; unknown names raise KeyError) and ``%(limit)s`` rows, ordered by id. Only
    constant text goes in: every value is a bound parameter.

    Args:
        conditions: names from ``SEARCH_CONDITIONS``.
        time: a key of ``TIME_COLUMNS`` (the column the time range applies to).
        ids_only: select only ``id`` (for bulk actions).
        ascending: oldest first (with ``after``) instead of newest first.
    """
    column = TIME_COLUMNS[time]
    where = [SEARCH_CONDITIONS[name].replace("{time}", column)
             for name in SEARCH_CONDITIONS if name in conditions]
    unknown = set(conditions) - SEARCH_CONDITIONS.keys()
    if unknown:
        raise KeyError(sorted(unknown))
    return (f"SELECT {'id' if ids_only else _SEARCH_COLUMNS} FROM {{schema}}.jobs"
            + (" WHERE " + " AND ".join(where) if where else "")
            + f" ORDER BY id {'ASC' if ascending else 'DESC'} LIMIT %(limit)s")

# The states of some jobs (missing: no such job), to say why an action left them alone.
JOB_STATES = """
SELECT id, state, cancel_requested FROM {schema}.jobs WHERE id = ANY(%(id)s::bigint[])
"""

# Jobs that a worker would run now or within `within` seconds, in some queues (the test
# helpers' drain waits for none): waiting, running, or scheduled that soon.
RUNNABLE_NOW = """
SELECT count(*) FROM {schema}.jobs
 WHERE queue = ANY(%(queues)s::text[])
   AND (state IN ('available', 'running')
        OR (state = 'scheduled' AND run_at <= now() + make_interval(secs => %(within)s)))
"""

# The sessions holding a lock on a relation of a schema, ended (the test helpers' drop of a
# test's own schema, behind a transaction the test left open); the caller's own is spared.
END_SCHEMA_SESSIONS = """
SELECT pg_terminate_backend(l.pid) FROM pg_locks AS l
  JOIN pg_class AS c ON c.oid = l.relation
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE n.nspname = %(schema)s AND l.pid <> pg_backend_pid()
 GROUP BY l.pid
"""

# Jobs by state in some queues (what a drain reports).
STATES_IN_QUEUES = """
SELECT state, count(*) FROM {schema}.jobs WHERE queue = ANY(%(queues)s::text[]) GROUP BY state
"""

# The jobs of a task (or of every task), oldest first, for the test helpers' assertions.
ENQUEUED = """
SELECT id, queue, task, args, state, priority, run_at, idempotency_key, max_attempts
  FROM {schema}.jobs
 WHERE (%(task)s::text IS NULL OR task = %(task)s::text)
 ORDER BY id
 LIMIT %(limit)s
"""
