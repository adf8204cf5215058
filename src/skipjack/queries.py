"""Every SQL statement skipjack runs, in one place.

Each statement is a template in which ``{schema}`` stands for the quoted schema name; values
are always bound parameters (``%(name)s``), never interpolated. :class:`Queries` renders the
templates once per schema with :mod:`psycopg.sql` and keeps the result as UTF-8 bytes, so
running a statement costs no re-rendering (psycopg then caches its parse of the text).

Fencing: every write about a claimed job (complete, retry, discard, release, heartbeat,
rescue) matches ``state = 'running' AND lease_version = <token read at claim>``. A write that
matches no row is stale: the job was rescued and re-claimed meanwhile, and nothing changes.
Each claim raises ``lease_version`` by a random step (1..2^31), not by one: claims commit
without waiting for their WAL flush (``synchronous_commit = off`` on the claiming
connection), so a server crash can undo one, and the next claim of that job must not hand
the undone claim's token out again.

Row locks: statements that take job rows before updating them lock them FOR NO KEY UPDATE
(what an UPDATE of non-key columns takes anyway), never FOR UPDATE, so a row of the
application's that references a job (a foreign key takes FOR KEY SHARE on the job's row for
its transaction) does not hide the job from claims, heartbeats, rescues or cancels. Only the
pruner's DELETE takes FOR UPDATE.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from psycopg import sql

# --- enqueue -------------------------------------------------------------------------------

# Many jobs in one statement. args is bound as one array literal (text_array); each other
# column either as an array literal too, or, when every job shares its value (one task's
# jobs usually do), as that one value in same_<column> with the array NULL: fewer and
# shorter arrays to build, bind and unnest (10,000 jobs of one task: 42 ms instead of 59 to
# build the values and run the statement). Rows are inserted in array order (WITH ORDINALITY
# + ORDER BY), so identity values grow in input order. Delays are seconds, added to the
# database clock; a job due later waits in 'scheduled'. Keys: see _ON_CONFLICT below (the
# caller then reads the existing id).
_ENQUEUE = """
INSERT INTO {schema}.jobs (queue, task, args, args_bytes, priority, max_attempts, run_at, state,
                           idempotency_key, unique_states, lease_seconds)
SELECT x.queue, x.task, x.args::jsonb, octet_length(x.args), x.priority, x.max_attempts,
       x.at, CASE WHEN x.at > now() THEN 'scheduled' ELSE 'available' END,
       x.idempotency_key, x.unique_states, x.lease_seconds
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
 ORDER BY x.ord
<<ON_CONFLICT>>
RETURNING id, idempotency_key
"""

# The same for one job: a single row is cheaper to plan and run than unnest of ten arrays.
_ENQUEUE_ONE = """
INSERT INTO {schema}.jobs (queue, task, args, args_bytes, priority, max_attempts, run_at, state,
                           idempotency_key, unique_states, lease_seconds)
SELECT %(queue)s, %(task)s, x.args::jsonb, octet_length(x.args),
       %(priority)s::smallint, %(max_attempts)s::int,
       x.at, CASE WHEN x.at > now() THEN 'scheduled' ELSE 'available' END,
       %(idempotency_key)s::text, %(unique_states)s::smallint, %(lease_seconds)s::float8
  FROM (SELECT %(args)s::text AS args,
               coalesce(%(run_at)s::timestamptz,
                        now() + make_interval(secs => coalesce(%(delay)s::float8, 0))) AS at) AS x
<<ON_CONFLICT>>
RETURNING id, idempotency_key
"""

# A key already held by a job in one of its unique_states makes the row a no-op. Without
# keys in the batch the *_NO_KEYS forms skip the conflict check (and its per-row
# speculative insertion).
_ON_CONFLICT = """ON CONFLICT (idempotency_key)
   WHERE idempotency_key IS NOT NULL AND (unique_states & {schema}.state_bit(state)) <> 0
   DO NOTHING"""
ENQUEUE = _ENQUEUE.replace("<<ON_CONFLICT>>", _ON_CONFLICT)
ENQUEUE_NO_KEYS = _ENQUEUE.replace("<<ON_CONFLICT>>", "")
ENQUEUE_ONE = _ENQUEUE_ONE.replace("<<ON_CONFLICT>>", _ON_CONFLICT)
ENQUEUE_ONE_NO_KEYS = _ENQUEUE_ONE.replace("<<ON_CONFLICT>>", "")

EXISTING_KEYS = """
SELECT id, idempotency_key FROM {schema}.jobs
 WHERE idempotency_key = ANY(%(keys)s::text[])
   AND (unique_states & {schema}.state_bit(state)) <> 0
"""

# --- claim ---------------------------------------------------------------------------------

# One queue per statement (an ordered index scan; `queue = ANY(...)` would need a sort).
# Marks the jobs running, starts the lease (the job's own lease_seconds, else the worker's;
# never shorter than min_lease, the shortest lease this worker's heartbeat keeps alive),
# counts the attempt and raises the fencing token by a random step (see the top).
# Large args (serialised size over %(inline_bytes)s) are not returned here; see LOAD_ARGS.
# held_tasks / held split lease-mode claims (held = false: every task but those) from claims
# in an open transaction (held = true: only those), see Task.transaction = "claim".
# A paused queue, or one with a concurrency or rate limit, is not claimed by CLAIM: limited
# queues go through LOCK_QUEUE + CLAIM_LIMITED, paused ones not at all.
_CLAIM = """
UPDATE {schema}.jobs AS j
   SET state = 'running',
       attempt = j.attempt + 1,
       attempted_at = now(),
       lease_expires_at = now() + make_interval(secs => greatest(
                              coalesce(j.lease_seconds, %(lease)s), %(min_lease)s)),
       lease_version = j.lease_version + 1 + floor(random() * 2147483647)::bigint,
       worker = %(worker)s
  FROM (SELECT id FROM {schema}.jobs
         WHERE state = 'available' AND queue = %(queue)s AND run_at <= now()
           AND (task = ANY(%(held_tasks)s::text[])) = %(held)s
           AND <<QUEUE_FILTER>>
         ORDER BY <<ORDER>>
         LIMIT <<LIMIT>>
           FOR NO KEY UPDATE SKIP LOCKED) AS c
 WHERE j.id = c.id
RETURNING j.id, j.queue, j.task,
          CASE WHEN j.args_bytes <= %(inline_bytes)s THEN j.args END AS args,
          j.priority, j.attempt, j.max_attempts, j.lease_version, j.created_at, j.run_at,
          j.attempted_at, j.idempotency_key,
          greatest(coalesce(j.lease_seconds, %(lease)s), %(min_lease)s) AS lease
"""
_UNCONTROLLED = """NOT EXISTS (SELECT 1 FROM {schema}.queues AS q WHERE q.name = %(queue)s
                  AND (q.paused OR q.concurrency_limit IS NOT NULL OR q.rate_limit IS NOT NULL))"""
_PRIORITY_ORDER = "priority DESC, run_at, id"
_OLDEST_ORDER = "run_at, id"  # every fairness_every-th claim: no priority can starve

CLAIM = (_CLAIM.replace("<<QUEUE_FILTER>>", _UNCONTROLLED)
         .replace("<<ORDER>>", _PRIORITY_ORDER).replace("<<LIMIT>>", "%(limit)s"))
# Claims held in a transaction: only a pause applies (their running jobs are invisible to
# other sessions, so limits could not count them).
CLAIM_HELD = (_CLAIM.replace("<<QUEUE_FILTER>>", """NOT EXISTS (SELECT 1 FROM {schema}.queues AS q
                                                 WHERE q.name = %(queue)s AND q.paused)""")
              .replace("<<ORDER>>", _PRIORITY_ORDER).replace("<<LIMIT>>", "%(limit)s"))
CLAIM_OLDEST = (_CLAIM.replace("<<QUEUE_FILTER>>", _UNCONTROLLED)
                .replace("<<ORDER>>", _OLDEST_ORDER).replace("<<LIMIT>>", "%(limit)s"))

# Controlled queues: LOCK_QUEUE (first statement of a transaction) serialises the claims of
# one queue, so CLAIM_LIMITED (second statement, fresh snapshot) counts every claim that
# committed before it. Only running jobs with a live lease count against the concurrency
# limit; the rate window is opened or advanced here too.
LOCK_QUEUE = """
SELECT paused FROM {schema}.queues WHERE name = %(queue)s FOR UPDATE
"""

_CLAIM_LIMITED = """
WITH q AS (
    SELECT q.*, q.window_start IS NULL
                OR q.window_start + make_interval(secs => q.rate_period) <= now() AS new_window
      FROM {schema}.queues AS q WHERE q.name = %(queue)s AND NOT q.paused
), allowed AS (
    SELECT greatest(0, least(
             %(limit)s,
             coalesce(q.concurrency_limit - (SELECT count(*) FROM {schema}.jobs AS r
                                              WHERE r.queue = %(queue)s AND r.state = 'running'
                                                AND r.lease_expires_at > now()), %(limit)s),
             coalesce(q.rate_limit - CASE WHEN q.new_window THEN 0 ELSE q.window_count END,
                      %(limit)s))) AS n
      FROM q
), claimed AS (
""" + _CLAIM.replace("<<QUEUE_FILTER>>", "true").replace(
    "<<LIMIT>>", "coalesce((SELECT n FROM allowed), 0)").strip() + """
), counted AS (
    UPDATE {schema}.queues AS q
       SET window_start = CASE WHEN q2.new_window THEN now() ELSE q.window_start END,
           window_count = CASE WHEN q2.new_window THEN 0 ELSE q.window_count END
                          + (SELECT count(*) FROM claimed)
      FROM q AS q2
     WHERE q.name = q2.name AND q.rate_limit IS NOT NULL
)
SELECT * FROM claimed
"""
CLAIM_LIMITED = _CLAIM_LIMITED.replace("<<ORDER>>", _PRIORITY_ORDER)
CLAIM_LIMITED_OLDEST = _CLAIM_LIMITED.replace("<<ORDER>>", _OLDEST_ORDER)

# The producer's connection: claims need not wait for their WAL flush. A claim lost in a
# crash only makes its job claimable again, and its token is not handed out again (see the
# top of this module).
ASYNC_CLAIMS = "SET synchronous_commit = off"

CONTROLLED_QUEUES = """
SELECT name FROM {schema}.queues WHERE concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL
"""

def claim_params(queue: str, limit: int, *, lease: float, worker: str,
                 min_lease: float = 0.0, inline_bytes: int = 256 * 1024,
                 held_tasks: list[str] | None = None, held: bool = False) -> dict[str, object]:
    """Bind values of CLAIM, CLAIM_OLDEST and CLAIM_LIMITED[_OLDEST].

    Args:
        queue: the one queue to claim from.
        limit: the most jobs to claim.
        lease: seconds, the worker's lease (a job may carry its own).
        worker: the name stored on the claimed rows.
        min_lease: seconds, the shortest lease the worker's heartbeat keeps alive.
        inline_bytes: args up to this size come with the claim; larger ones are loaded later.
        held_tasks, held: see the comment above CLAIM.
    """
    return {"queue": queue, "limit": limit, "lease": lease, "worker": worker,
            "min_lease": min_lease, "inline_bytes": inline_bytes,
            "held_tasks": text_array(held_tasks or []), "held": held}


def text_array(items: Iterable[str | None]) -> str:
    """A PostgreSQL array literal of ``items``, bound as one text value and cast in the
    statement (``%(x)s::text[]``, or to ``timestamptz[]`` for ISO 8601 strings). Exact for any
    text (each element is quoted; None is NULL), and far cheaper to bind than a Python list,
    which psycopg adapts element by element."""
    quoted = ("NULL" if i is None else '"' + i.replace("\\", "\\\\").replace('"', '\\"') + '"'
              for i in items)
    return "{" + ",".join(quoted) + "}"


def number_array(items: Iterable[int | float | None]) -> str:
    """A PostgreSQL array literal of finite numbers (None is NULL); see :func:`text_array`."""
    return "{" + ",".join("NULL" if i is None else repr(float(i)) if isinstance(i, float)
                          else str(int(i)) for i in items) + "}"


# For claims held in an open transaction: the server ends the session, rolling the claim
# back, if the worker leaves the transaction idle longer than the job's lease.
SET_IDLE_TIMEOUT = """
SELECT set_config('idle_in_transaction_session_timeout', %(ms)s::text, true)
"""

LOAD_ARGS = """
SELECT args FROM {schema}.jobs WHERE id = %(id)s AND lease_version = %(lease_version)s
"""

# --- outcomes (fenced) ---------------------------------------------------------------------

# One statement records a batch of outcomes, given as one JSON array of objects (see
# completer.outcome_params): one text value binds and parses far faster than six arrays.
# kind is one of
#   'complete' -> succeeded;
#   'retry'    -> runnable again after `delay` seconds, or discarded if attempts are used up;
#   'discard'  -> discarded (dead letter) now;
#   'cancel'   -> cancelled now (a cancellation was requested while it ran);
#   'release'  -> runnable after `delay` seconds, the attempt not counted (shutdown, snooze,
#                 or the job's own transaction lost its connection to the database).
# A job runnable later is 'scheduled', one runnable now 'available'. A job whose
# cancellation was requested ends 'cancelled' instead of being retried or released.
# Times are statement_timestamp(): in a handler's own transaction now() is its start.
# Rows are matched on (id, lease_version, state = 'running'): stale outcomes change nothing
# and are missing from RETURNING.
RECORD_OUTCOMES = """
UPDATE {schema}.jobs AS j
   SET state = CASE
                 WHEN o.kind = 'complete' THEN 'succeeded'
                 WHEN o.kind = 'discard' THEN 'discarded'
                 WHEN o.kind = 'cancel' OR j.cancel_requested THEN 'cancelled'
                 WHEN o.kind = 'retry' AND j.attempt >= j.max_attempts THEN 'discarded'
                 WHEN o.delay > 0 THEN 'scheduled'
                 ELSE 'available'
               END,
       attempt = CASE WHEN o.kind = 'release' THEN j.attempt - 1 ELSE j.attempt END,
       run_at = CASE
                  WHEN o.kind = 'retry' AND j.attempt < j.max_attempts
                    THEN statement_timestamp() + make_interval(secs => o.delay)
                  WHEN o.kind = 'release'
                    THEN statement_timestamp() + make_interval(secs => o.delay)
                  ELSE j.run_at
                END,
       finished_at = CASE
                       WHEN o.kind IN ('complete', 'discard', 'cancel') OR j.cancel_requested
                         THEN statement_timestamp()
                       WHEN o.kind = 'retry' AND j.attempt >= j.max_attempts
                         THEN statement_timestamp()
                     END,
       lease_expires_at = NULL,
       worker = NULL,
       result = o.result::jsonb,
       errors = CASE WHEN o.error IS NULL THEN j.errors
                     ELSE j.errors || jsonb_build_array(o.error::jsonb
                          || jsonb_build_object('at', statement_timestamp(), 'worker', j.worker))
                END
  FROM json_to_recordset(%(outcomes)s::json)
       AS o(id bigint, lease_version bigint, kind text, delay float8, result text, error text)
 WHERE j.id = o.id AND j.lease_version = o.lease_version AND j.state = 'running'
RETURNING j.id, j.state
"""

# Renew the leases of a batch of running jobs (fenced). It never waits on a row lock (SKIP
# LOCKED): the worker's own completer, a cancel request or a rescuer may hold some of the rows,
# and waiting on them in another order than theirs could deadlock. One row per job still held
# as of the statement's snapshot: cancel_requested is NULL for a job locked by someone else
# (not renewed this time; the next beat tries again). Ids missing from the result lost their
# lease; cancel_requested true tells the worker to stop the handler.
HEARTBEAT = """
WITH h AS (
    SELECT j.id, j.lease_version FROM {schema}.jobs AS j
      JOIN unnest(%(id)s::bigint[], %(lease_version)s::bigint[]) AS h(id, lease_version)
        ON j.id = h.id AND j.lease_version = h.lease_version
     WHERE j.state = 'running'
), locked AS (
    SELECT j.id FROM {schema}.jobs AS j
      JOIN h ON j.id = h.id AND j.lease_version = h.lease_version
     WHERE j.state = 'running'
       FOR NO KEY UPDATE OF j SKIP LOCKED
), renewed AS (
    UPDATE {schema}.jobs AS j
       SET lease_expires_at = now() + make_interval(secs => greatest(
                                  coalesce(j.lease_seconds, %(lease)s), %(min_lease)s))
      FROM locked WHERE j.id = locked.id
    RETURNING j.id, j.cancel_requested
)
SELECT h.id, renewed.cancel_requested FROM h LEFT JOIN renewed ON renewed.id = h.id
"""

# --- stager --------------------------------------------------------------------------------

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

# --- rescue --------------------------------------------------------------------------------

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

# --- inspection and control ----------------------------------------------------------------

STATS = """
SELECT queue, state, count(*) AS jobs FROM {schema}.jobs GROUP BY queue, state ORDER BY 1, 2
"""

# How many jobs wait and run per queue: served by the partial indexes, whatever the history.
QUEUE_DEPTH = """
SELECT queue, state, count(*) FROM {schema}.jobs
 WHERE state IN ('scheduled', 'available', 'running') GROUP BY queue, state ORDER BY 1, 2
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
       cancel_requested, errors, result
  FROM {schema}.jobs WHERE id = %(id)s
"""

# Send waiting jobs to the dead letter by hand (running ones are left alone).
DISCARD_WAITING = """
UPDATE {schema}.jobs SET state = 'discarded', finished_at = now()
 WHERE id = ANY(%(id)s::bigint[]) AND state IN ('scheduled', 'available')
RETURNING id
"""

# --- cancellation --------------------------------------------------------------------------
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

# --- retention -----------------------------------------------------------------------------

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

# Cron history older than `age` seconds, keeping each schedule's latest slot (where the
# scheduler resumes from).
PRUNE_CRON = """
DELETE FROM {schema}.cron_slots AS c
 WHERE c.recorded_at < now() - make_interval(secs => %(age)s)
   AND c.slot < (SELECT max(slot) FROM {schema}.cron_slots AS l WHERE l.name = c.name)
"""

# --- queue controls ------------------------------------------------------------------------

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

LIST_QUEUES = """
SELECT name, paused, concurrency_limit, rate_limit, rate_period FROM {schema}.queues ORDER BY 1
"""

# --- cron ----------------------------------------------------------------------------------

CRON_LAST_SLOT = "SELECT max(slot) FROM {schema}.cron_slots WHERE name = %(name)s"

# Claim a slot; RETURNING is empty when another scheduler already has it.
CRON_CLAIM_SLOT = """
INSERT INTO {schema}.cron_slots (name, slot, status) VALUES (%(name)s, %(slot)s, 'enqueued')
ON CONFLICT DO NOTHING
RETURNING slot
"""

CRON_SET_JOB = """
UPDATE {schema}.cron_slots SET job_id = %(job_id)s WHERE name = %(name)s AND slot = %(slot)s
"""

CRON_MISSED = """
INSERT INTO {schema}.cron_slots (name, slot, status)
SELECT %(name)s, s, 'missed' FROM unnest(%(slots)s::timestamptz[]) AS s
ON CONFLICT DO NOTHING
"""

CRON_LIST = """
SELECT name, max(slot) FILTER (WHERE status = 'enqueued') AS last_enqueued,
       count(*) FILTER (WHERE status = 'missed') AS missed
  FROM {schema}.cron_slots GROUP BY name ORDER BY name
"""

# Re-enqueue a discarded (dead-letter) job: a fresh set of attempts, runnable now.
# (Not when another job now holds its idempotency key: that one wins.)
RETRY_DISCARDED = """
UPDATE {schema}.jobs AS j
   SET state = 'available', attempt = 0, run_at = now(), finished_at = NULL,
       cancel_requested = false
 WHERE j.id = ANY(%(id)s::bigint[]) AND j.state = 'discarded'
   AND (j.idempotency_key IS NULL OR NOT EXISTS (
        SELECT 1 FROM {schema}.jobs AS o
         WHERE o.idempotency_key = j.idempotency_key AND o.id <> j.id
           AND (o.unique_states & {schema}.state_bit(o.state)) <> 0))
RETURNING j.id, j.queue
"""

# Wake the workers of some queues (jobs made available by the rescuer or by hand).
NOTIFY_QUEUES = """
SELECT pg_notify(%(channel)s, q) FROM unnest(%(queues)s::text[]) AS q
"""

# Totals over a whole run (the demo and the benchmarks): jobs that needed more than one
# attempt, and seconds from the first enqueue to the last finish.
RUN_SUMMARY = """
SELECT count(*) FILTER (WHERE attempt > 1) AS retried,
       extract(epoch FROM max(finished_at) - min(created_at))::float8 AS span_seconds
  FROM {schema}.jobs
"""

DB_NOW = "SELECT now()"

DROP_SCHEMA = "DROP SCHEMA IF EXISTS {schema} CASCADE"

SCHEMA_VERSION = """
SELECT max(version) FROM {schema}.migrations
"""

SCHEMA_EXISTS = """
SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = %(schema)s AND tablename = 'migrations')
"""

# --- chaos (fault-injection audit) ---------------------------------------------------------

# starts: one row per handler start; effects: one row per committed effect, deliberately
# without a unique constraint so that a duplicate would be counted, not refused.
CHAOS_TABLES = """
CREATE TABLE {schema}.chaos_starts (job_id bigint NOT NULL, attempt int NOT NULL,
    lease_version bigint NOT NULL, pid int NOT NULL, at timestamptz NOT NULL DEFAULT now());
CREATE TABLE {schema}.chaos_effects (job_id bigint NOT NULL, pid int NOT NULL,
    at timestamptz NOT NULL DEFAULT now())
"""

CHAOS_START = """
INSERT INTO {schema}.chaos_starts (job_id, attempt, lease_version, pid)
VALUES (%(job_id)s, %(attempt)s, %(lease_version)s, %(pid)s)
"""

CHAOS_EFFECT = "INSERT INTO {schema}.chaos_effects (job_id, pid) VALUES (%(job_id)s, %(pid)s)"

CHAOS_AUDIT = """
SELECT (SELECT count(*) FROM {schema}.jobs) AS rows,
       (SELECT count(*) FROM {schema}.jobs WHERE state = 'succeeded') AS completed,
       (SELECT count(*) FROM {schema}.jobs WHERE state = 'discarded') AS discarded,
       (SELECT count(*) FROM {schema}.jobs
         WHERE state IN ('scheduled', 'available', 'running')) AS unfinished,
       (SELECT count(*) FROM {schema}.jobs
         WHERE state = 'running' AND lease_expires_at < now()) AS stuck,
       (SELECT coalesce(sum(n - 1), 0)::bigint
          FROM (SELECT count(*) AS n FROM {schema}.chaos_effects GROUP BY job_id) AS e
       ) AS duplicate_effects,
       (SELECT count(*) FROM {schema}.jobs j WHERE state = 'succeeded' AND NOT EXISTS
          (SELECT 1 FROM {schema}.chaos_effects e WHERE e.job_id = j.id)) AS missing_effects,
       (SELECT count(*) - count(DISTINCT job_id) FROM {schema}.chaos_starts) AS duplicate_starts,
       (SELECT coalesce(max(attempt), 0) FROM {schema}.jobs) AS max_attempt
"""

CHAOS_FINISHED = """
SELECT count(*) FROM {schema}.jobs WHERE state IN ('succeeded', 'discarded')
"""

# Cut every session of one application (the workers of one chaos run), not our own.
TERMINATE_BACKENDS = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
 WHERE application_name = %(application_name)s AND pid <> pg_backend_pid()
"""

# --- migrations ----------------------------------------------------------------------------

# Transaction-scoped: released at commit or rollback, safe through a transaction pooler.
MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(%(key)s)"

CREATE_MIGRATIONS_TABLE = """
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""

APPLIED_MIGRATIONS = "SELECT version FROM {schema}.migrations ORDER BY version"

RECORD_MIGRATION = """
INSERT INTO {schema}.migrations (version, name) VALUES (%(version)s, %(name)s)
"""


# A round trip through LISTEN/NOTIFY, to check notifications reach the worker's sessions.
PROBE_NOTIFY = "SELECT pg_notify(%(channel)s, 'probe')"


def listen(channel: str) -> sql.Composed:
    """``LISTEN channel`` with the channel quoted as an identifier."""
    return sql.SQL("LISTEN {}").format(sql.Identifier(channel))


@dataclass(frozen=True)
class Queries:
    """The statements above, rendered for one schema, each as UTF-8 encoded SQL text
    (``bytes``, which psycopg sends as is). The text is ASCII unless the schema name is not;
    such a name then needs connections with the UTF8 client encoding (PostgreSQL's default
    for UTF8 databases).

    Args:
        schema: the PostgreSQL schema that holds skipjack's tables (an identifier; it is
            quoted, never interpolated).
    """

    schema: str

    def __getattr__(self, name: str) -> bytes:
        template = globals().get(name)
        if not name.isupper() or not isinstance(template, str):
            raise AttributeError(name)
        text = render(template, self.schema).as_string().encode()
        object.__setattr__(self, name, text)  # cache on the instance
        return text


def render(template: str, schema: str, **literals: object) -> sql.Composed:
    """Fill ``{schema}`` with the quoted schema name and any other placeholder with a literal.

    Args:
        template: SQL text with ``{schema}`` (and optional ``{name}``) placeholders; literal
            braces written doubled.
        schema: the schema name, quoted with :class:`psycopg.sql.Identifier`.
        literals: further placeholders, each rendered with :class:`psycopg.sql.Literal`.
    """
    values: dict[str, sql.Composable] = {k: sql.Literal(v) for k, v in literals.items()}
    return sql.SQL(template).format(schema=sql.Identifier(schema), **values)
