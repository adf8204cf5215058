"""Statements that insert jobs (many in one statement, or one alone) and the look-up of the
ids of idempotency keys already held.

Each insert comes with and without the idempotency-key conflict clause, and each wakes the
workers itself (see ``_WAKE_MANY``), built by ``insert_jobs``.
"""

from __future__ import annotations

# Many jobs in one statement. args is bound as one array literal (sql.arrays.text_array);
# each other column either as an array literal too, or, when every job shares its value (one
# task's jobs usually do), as that one value in same_<column> with the array NULL: fewer and
# shorter arrays to build, bind and unnest (10,000 jobs of one task: 42 ms instead of 59 to
# build the values and run the statement). Rows are inserted in array order (WITH ORDINALITY
# + ORDER BY), so identity values grow in input order. Delays are seconds, added to the
# database clock; a job due later waits in 'scheduled'. metadata (JSON text, or NULL) is one
# value for every job of the call: what hooks attach to them (skipjack.hooks.EnqueueCall).
_INSERT_MANY = """
INSERT INTO {schema}.jobs (queue, task, args, args_bytes, priority, max_attempts, run_at, state,
                           idempotency_key, unique_states, lease_seconds, metadata)
SELECT x.queue, x.task, x.args::jsonb, octet_length(x.args), x.priority, x.max_attempts,
       x.at, CASE WHEN x.at > now() THEN 'scheduled' ELSE 'available' END,
       x.idempotency_key, x.unique_states, x.lease_seconds, %(metadata)s::jsonb
  FROM (SELECT u.ord, u.args,
               coalesce(u.queue, %(same_queue)s::text) AS queue,
               coalesce(u.task, %(same_task)s::text) AS task,
               coalesce(u.priority, %(same_priority)s::smallint) AS priority,
               coalesce(u.max_attempts, %(same_max_attempts)s::int) AS max_attempts,
               coalesce(u.run_at, %(same_run_at)s::timestamptz,
                        now() + make_interval(secs => coalesce(
                            u.delay, %(same_delay)s::float8, 0))) AS at,
               coalesce(u.idempotency_key, %(same_idempotency_key)s::text) AS idempotency_key,
               coalesce(u.unique_states, %(same_unique_states)s::smallint) AS unique_states,
               coalesce(u.lease_seconds, %(same_lease_seconds)s::float8) AS lease_seconds
          FROM unnest(%(args)s::text[], %(queue)s::text[], %(task)s::text[],
                      %(priority)s::smallint[], %(max_attempts)s::int[],
                      %(run_at)s::timestamptz[], %(delay)s::float8[],
                      %(idempotency_key)s::text[], %(unique_states)s::smallint[],
                      %(lease_seconds)s::float8[])
               WITH ORDINALITY AS u(args, queue, task, priority, max_attempts, run_at, delay,
                                    idempotency_key, unique_states, lease_seconds, ord)) AS x
 ORDER BY x.ord"""

# The same for one job: a single row is cheaper to plan and run than unnest of ten arrays.
_INSERT_ONE = """
INSERT INTO {schema}.jobs (queue, task, args, args_bytes, priority, max_attempts, run_at, state,
                           idempotency_key, unique_states, lease_seconds, metadata)
SELECT %(queue)s, %(task)s, x.args::jsonb, octet_length(x.args),
       %(priority)s::smallint, %(max_attempts)s::int,
       x.at, CASE WHEN x.at > now() THEN 'scheduled' ELSE 'available' END,
       %(idempotency_key)s::text, %(unique_states)s::smallint, %(lease_seconds)s::float8,
       %(metadata)s::jsonb
  FROM (SELECT %(args)s::text AS args,
               coalesce(%(run_at)s::timestamptz,
                        now() + make_interval(secs => coalesce(%(delay)s::float8, 0))) AS at
       ) AS x"""

# A key already held by a job in one of its unique_states makes the row a no-op (the caller
# then reads the existing id with EXISTING_KEYS). A batch without keys goes without it,
# skipping the conflict check and its per-row speculative insertion.
_ON_CONFLICT = """
ON CONFLICT (idempotency_key)
   WHERE idempotency_key IS NOT NULL AND (unique_states & {schema}.state_bit(state)) <> 0
   DO NOTHING"""

# The wake-up, sent by the inserting statement itself: one notification per queue that got
# jobs to run now (payload: the queue name, never job data) on the schema's channel, and one
# on its due channel with the run_at of the soonest job that runs later, as seconds since
# 1970-01-01 UTC on the database's clock (numeric's text: float8's would depend on the
# session's extra_float_digits). Delivered at commit, so a rolled-back enqueue wakes no one;
# sent only while PostgreSQL's notification queue has room (may_notify, migration 3), which
# is checked before the sends. Rows that an idempotency key made a no-op are not in
# `inserted`, so they wake no one. Until migration 8 a statement trigger (REFERENCING NEW
# TABLE) did this; in the statement, one job's enqueue statement runs about 18% faster
# (docs/performance.md, "The enqueue's wake-up").
_WAKE_MANY = """
, woken AS (
SELECT count(pg_notify(w.channel, w.payload)) AS sent
  FROM (SELECT {channel} AS channel, queue AS payload
          FROM inserted WHERE state = 'available' GROUP BY queue
        UNION ALL
        SELECT {due_channel}, extract(epoch FROM min(run_at))::text
          FROM inserted WHERE state = 'scheduled' HAVING count(*) > 0) AS w
 WHERE {schema}.may_notify())
SELECT id, idempotency_key FROM inserted CROSS JOIN woken
"""

# The same for one job: no grouping, and a LEFT JOIN, since `woken` is empty when nothing
# was sent (a key's no-op, or a full notification queue).
_WAKE_ONE = """
, woken AS (
SELECT CASE state WHEN 'available' THEN pg_notify({channel}, queue)
                  WHEN 'scheduled'
                  THEN pg_notify({due_channel}, extract(epoch FROM run_at)::text) END AS sent
  FROM inserted WHERE {schema}.may_notify())
SELECT id, idempotency_key FROM inserted LEFT JOIN woken ON true
"""


def insert_jobs(insert: str, wake: str, *, keys: bool) -> str:
    """``insert`` (an INSERT ... SELECT of jobs), with the conflict clause on idempotency keys
    when ``keys`` is true, then ``wake``: a statement that returns (id, idempotency_key)
    per inserted row."""
    return ("WITH inserted AS (" + insert + (_ON_CONFLICT if keys else "")
            + "\nRETURNING id, idempotency_key, queue, state, run_at)" + wake)


ENQUEUE = insert_jobs(_INSERT_MANY, _WAKE_MANY, keys=True)
ENQUEUE_NO_KEYS = insert_jobs(_INSERT_MANY, _WAKE_MANY, keys=False)
ENQUEUE_ONE = insert_jobs(_INSERT_ONE, _WAKE_ONE, keys=True)
ENQUEUE_ONE_NO_KEYS = insert_jobs(_INSERT_ONE, _WAKE_ONE, keys=False)

EXISTING_KEYS = """
SELECT id, idempotency_key FROM {schema}.jobs
 WHERE idempotency_key = ANY(%(keys)s::text[])
   AND (unique_states & {schema}.state_bit(state)) <> 0
"""
