"""Statements that claim jobs, and what a claim needs around it.

A claim takes jobs from ONE queue per statement (an ordered scan of the partial index;
``queue = ANY(...)`` would need a sort), marks them running, starts their lease (the job's own
``lease_seconds``, else the worker's, or for a claim-mode job its task's; never shorter than
``min_lease``, the shortest lease the worker's heartbeat keeps alive), counts the attempt and
raises the fencing token by a random step (see ``skipjack.sql``). Args larger than
``inline_bytes`` (serialised) are not returned; the worker loads them with LOAD_ARGS just
before the handler runs.

``claim_mode_tasks`` / ``claim_mode`` split the claims of tasks declared
``transaction="claim"`` (claimed and run in one open transaction, ``claim_mode`` true: only
those tasks) from lease claims (``claim_mode`` false: every other task).

Every variant is built by ``claim_jobs`` from the ids of the jobs that
``candidates`` selects (which jobs, in which order, how many); the claims of a queue with a
concurrency or rate limit by ``claim_limited_jobs``.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any

from .arrays import number_array, text_array

PRIORITY_ORDER = "priority DESC, run_at, id"

# Every fairness_every-th claim that takes jobs: oldest first (within the priority whose
# oldest job has waited longest, see _oldest_candidates), so no priority can starve.
OLDEST_ORDER = "run_at, id"


def claim_lock_key(schema: str) -> int:
    """The first key (a signed 32-bit integer) of the claim locks of the jobs in ``schema``
    (see ``CLAIM_IN_TRANSACTION``): derived from the schema's name, so that the queues of
    two schemas do not share locks."""
    digest = hashlib.sha1(b"skipjack.claim:" + schema.encode()).digest()
    return int.from_bytes(digest[:4], "big", signed=True)


def candidates(*, queue_filter: str, order: str, limit: str) -> str:
    """The jobs a claim takes: available now in one queue, of the right mode, not skipped,
    in ``order``, at most ``limit``, locked (SKIP LOCKED: never waiting on another claim).

    Args:
        queue_filter: a condition on the queue's settings (paused, limited) that must hold.
        order: the ORDER BY list: ``PRIORITY_ORDER`` or ``OLDEST_ORDER``.
        limit: the LIMIT expression.

    ``skip`` holds ids this worker leaves alone for a while because claiming them failed
    (see ``skipjack.runtime.producer``); usually none.

    The claim index is ordered by priority first, so ``OLDEST_ORDER`` is served one priority
    at a time (``_oldest_candidates``), never by sorting the whole queue.
    """
    if order == OLDEST_ORDER:
        return _oldest_candidates(queue_filter, limit)
    return _locked("", queue_filter, order, limit)


# A candidate's conditions besides its state and queue: due, of the claim's mode, not skipped.
_RUNNABLE = """run_at <= now()
           AND (task = ANY(%(claim_mode_tasks)s::text[])) = %(claim_mode)s
           AND id <> ALL(%(skip)s::bigint[])"""


def _available(condition: str, queue_filter: str) -> str:
    """The candidates' filter, with ``condition`` (SQL starting with AND, or empty)."""
    return ("state = 'available' AND queue = %(queue)s AND " + _RUNNABLE + condition
            + """
           AND """ + queue_filter)


def _locked(condition: str, queue_filter: str, order: str, limit: str) -> str:
    """The candidates' SELECT (id and run_at), locked, with ``condition`` added to the
    filter."""
    return """SELECT id, run_at FROM {schema}.jobs
         WHERE """ + _available(condition, queue_filter) + """
         ORDER BY """ + order + """
         LIMIT """ + limit + """
           FOR NO KEY UPDATE SKIP LOCKED"""


def _oldest_candidates(queue_filter: str, limit: str) -> str:
    """The oldest jobs of the priority whose oldest job has waited longest: the priorities
    of the queue's available jobs, each found with one probe of the claim index below the
    previous one (a skip scan); the oldest job of each, read without a lock; then, in the
    priority whose oldest job is the oldest of all, the oldest ``limit`` jobs, locked. A
    starving priority is thus reached as soon as its oldest job is the queue's oldest, and
    the claim locks only the jobs it takes. Sorting the whole queue instead took 23 ms for a
    claim of 100 from 100,000 available jobs and 267 ms from 1,000,000 (2 ms in priority
    order), every ``fairness_every``-th claim; taking the oldest ``limit`` of every priority
    and keeping the oldest of those locked up to ``limit`` rows per priority."""
    return """SELECT o.id FROM (
        WITH RECURSIVE levels(priority) AS (
            (SELECT priority FROM {schema}.jobs
              WHERE state = 'available' AND queue = %(queue)s
              ORDER BY priority DESC LIMIT 1)
            UNION ALL
            SELECT (SELECT p.priority FROM {schema}.jobs AS p
                     WHERE p.state = 'available' AND p.queue = %(queue)s
                       AND p.priority < l.priority
                     ORDER BY p.priority DESC LIMIT 1)
              FROM levels AS l WHERE l.priority IS NOT NULL
        ), oldest AS (
            SELECT l.priority FROM levels AS l CROSS JOIN LATERAL (
                SELECT run_at, id FROM {schema}.jobs
                 WHERE """ + _available(" AND priority = l.priority", queue_filter) + """
                 ORDER BY run_at, id LIMIT 1) AS f
             ORDER BY f.run_at, f.id LIMIT 1
        )
        """ + _locked(" AND priority = (SELECT priority FROM oldest)", queue_filter,
                      OLDEST_ORDER, limit) + """
    ) AS o"""


# A job's lease when it has none of its own (lease_seconds NULL): the worker's.
WORKER_LEASE = "%(lease)s"
# The same for a claim-mode job: its task's lease (claim_mode_leases, one per name of
# claim_mode_tasks, NULL for a task without one), else the worker's. Such a job has no lease
# of its own when it was enqueued without its task's options (by another application that
# names the task, or before the task had a lease); a lease-mode job then has the worker's.
TASK_LEASE = """coalesce((SELECT t.lease FROM unnest(%(claim_mode_tasks)s::text[],
                                                 %(claim_mode_leases)s::float8[])
                                     AS t(task, lease) WHERE t.task = j.task), %(lease)s)"""


def claim_jobs(jobs: str, default_lease: str = WORKER_LEASE) -> str:
    """The claim of the jobs whose ids the subquery ``jobs`` selects (see ``candidates``):
    each row holds the job's columns in the order of ``skipjack.context.Job``'s fields.
    ``default_lease`` is the lease (seconds, an SQL expression) of a job with none of its
    own: ``WORKER_LEASE`` or ``TASK_LEASE``.

    The ids go through an array (``id = ANY(ARRAY(...))``). Joined to the jobs table
    directly, the subquery's LIMIT (a bind value) is unknown to the planner, which takes a
    tenth of the table's rows for it: once the table was analysed it joined a claim of 500
    from 10,000 jobs by reading the whole table into a hash (5.6 ms a claim against 4.5 ms
    through an array; at 200,000 jobs waiting, 75 ms against 0.9 ms for the limited claim
    below). An array's elements it takes for few, and looks each up by primary key, whatever
    the table's statistics say. The array is scanned by the primary key (``= ANY``) rather
    than unnested WITH ORDINALITY and joined, which returned each job's place in the claim
    but cost a join (see "The claim without its join" in docs/performance.md); the worker
    puts the rows in order itself (``in_claim_order``)."""
    return """
UPDATE {schema}.jobs AS j
   SET state = 'running',
       attempt = j.attempt + 1,
       attempted_at = now(),
       lease_expires_at = now() + make_interval(secs => greatest(
                              coalesce(j.lease_seconds, """ + default_lease + """),
                              %(min_lease)s)),
       lease_version = j.lease_version + 1 + floor(random() * 2147483647)::bigint,
       worker = %(worker)s
 WHERE j.id = ANY(ARRAY(SELECT c.id FROM (""" + jobs + """) AS c))
RETURNING j.id, j.queue, j.task,
          CASE WHEN j.args_bytes <= %(inline_bytes)s THEN j.args END AS args,
          j.priority, j.attempt, j.max_attempts, j.lease_version, j.created_at, j.run_at,
          j.attempted_at, j.idempotency_key,
          greatest(coalesce(j.lease_seconds, """ + default_lease + """), %(min_lease)s)
          AS lease,
          CASE WHEN jsonb_typeof(j.metadata) = 'object' THEN j.metadata END AS metadata
"""


def in_claim_order(rows: list[Any]) -> list[Any]:
    """The rows of a claim statement sorted in place in the candidates' order, the order
    in which the worker starts them: highest priority first, then oldest run_at, then
    lowest id (an oldest-first claim takes one priority only, so this is its order too).
    Two stable sorts on keys built in C (run_at and id, then priority descending) cost
    half of one on a key function's tuples (0.10 against 0.21 ms for 1,000 rows). The
    statement returns the rows in the order of its scan of the primary key, often this
    order already, which costs each sort one pass."""
    rows.sort(key=_RUN_AT_ID)
    rows.sort(key=_PRIORITY, reverse=True)
    return rows


# Columns of a claim's row (the order of skipjack.context.Job's fields).
_RUN_AT_ID = operator.itemgetter(9, 0)
_PRIORITY = operator.itemgetter(4)


# A paused queue, or one with a concurrency or rate limit, is not claimed by CLAIM: limited
# queues go through LOCK_QUEUE + CLAIM_LIMITED, paused ones not at all.
_UNCONTROLLED = """NOT EXISTS (SELECT 1 FROM {schema}.queues AS q WHERE q.name = %(queue)s
                  AND (q.paused OR q.concurrency_limit IS NOT NULL OR q.rate_limit IS NOT NULL))"""
# Claim-mode claims: only a pause applies (their running jobs are invisible to other
# sessions, so limits could not count them).
_NOT_PAUSED = """NOT EXISTS (SELECT 1 FROM {schema}.queues AS q
                                                 WHERE q.name = %(queue)s AND q.paused)"""

CLAIM = claim_jobs(candidates(queue_filter=_UNCONTROLLED, order=PRIORITY_ORDER,
                              limit="%(limit)s"))
CLAIM_OLDEST = claim_jobs(candidates(queue_filter=_UNCONTROLLED, order=OLDEST_ORDER,
                                     limit="%(limit)s"))
# A claim-mode claim also takes the job's claim lock (a transaction-scoped advisory lock on
# the key pair (claim_lock_key(schema), the job's id modulo 2^31); ids 2^31 apart share a
# lock, which at worst makes a claim pass over a job for a while), and passes over a job
# whose lock another session holds or waits for. The lock is tried in a CASE, after the
# rest of the filter (the planner orders a filter's conditions by their cost), and before
# the row lock: a job whose row another transaction holds, or whose row changed after the
# claim's snapshot (its count, committed meanwhile), is then passed over with its claim
# lock taken, and other claim-mode claims pass over it too until this claim's transaction
# ends (within this job's lease; such a job is seldom runnable again by then). Trying the
# lock after the row lock instead would hold the row of a job being ended, which its count
# waits for, for the whole run of this claim's handler.
_CLAIM_LOCKED = """
           AND CASE WHEN """ + _RUNNABLE + """
                    THEN pg_try_advisory_xact_lock(%(claim_lock)s, (id %% 2147483648)::int)
               END"""
# The claim-mode claim also returns the session's process id on the server
# (pg_backend_pid(): the one the client's connection reports is a pooler's own behind
# PgBouncer) and sets its transaction's timeouts from the job's lease plus
# %(timeout_margin)s seconds: the server ends the session, rolling the claim back, if the
# worker leaves the transaction idle that long (a worker that is not stalled ends it itself
# at the lease, with END_OVERDUE_CLAIM), and cancels a statement that runs that long: a
# statement of a worker that was killed runs on until it ends, and only then does the
# server notice that the worker is gone. From PostgreSQL 17 on (%(transaction_timeout)s
# true) the whole transaction is bounded too; a new transaction_timeout applies from now
# only once the timeout is off, hence the '0' first. The statement timeout is never raised
# above the one the role, the database or the connection sets (%(server_statement_ms)s,
# read with SERVER_TIMEOUTS; 0: none); the idle and transaction timeouts are set whatever
# theirs (either ends a claim with no attempt counted). The settings last until the
# transaction ends, and apply from the next statement on. The job's columns come first, in
# the order of ``skipjack.context.Job``'s fields, then the process id.
CLAIM_IN_TRANSACTION = """
WITH claimed AS (""" + claim_jobs(_locked(_CLAIM_LOCKED, _NOT_PAUSED, PRIORITY_ORDER,
                                          "%(limit)s"), TASK_LEASE) + """)
SELECT c.*, pg_backend_pid(),
       set_config('idle_in_transaction_session_timeout', t.ms::text, true),
       set_config('statement_timeout',
                  CASE WHEN %(server_statement_ms)s::bigint > 0
                       THEN least(t.ms, %(server_statement_ms)s::bigint)
                       ELSE t.ms END::text, true),
       CASE WHEN %(transaction_timeout)s::boolean
            THEN set_config('transaction_timeout', '0', true)
                 || set_config('transaction_timeout', t.ms::text, true) END
  FROM claimed AS c
 CROSS JOIN LATERAL (SELECT floor(1000 * (c.lease + %(timeout_margin)s::float8))::bigint
                            AS ms) AS t
"""

# After a claim statement failed on some row (a trigger of the application's raising, a value
# that overflows): the ids that claim would take (in a transaction rolled back afterwards)...
CLAIM_CANDIDATES = candidates(queue_filter="true", order=PRIORITY_ORDER, limit="%(limit)s")
CLAIM_CANDIDATES_OLDEST = candidates(queue_filter="true", order=OLDEST_ORDER,
                                     limit="%(limit)s")
# ... and the claim of one of them, tried alone in a savepoint to find which fail.
CLAIM_BY_ID = claim_jobs("SELECT %(id)s::bigint AS id")

# Limited queues: LOCK_QUEUE (first statement of a transaction) serialises the claims of
# one queue, so CLAIM_LIMITED (second statement, fresh snapshot) counts every claim that
# committed before it. Only running jobs with a live lease count against the concurrency
# limit; the rate window is opened or advanced here too, by a claim that takes jobs (one
# that finds none, at a limit or an empty queue, leaves the queue's row as it was).
LOCK_QUEUE = """
SELECT paused FROM {schema}.queues WHERE name = %(queue)s FOR UPDATE
"""


def claim_limited_jobs(order: str) -> str:
    """The claim from a limited queue (after LOCK_QUEUE), in ``order`` (see
    ``candidates``): as many as its limits allow, counted into its rate window (the
    candidates' ids through an array, see ``claim_jobs``)."""
    return ("""
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
""" + claim_jobs(candidates(
        queue_filter="true", order=order, limit="coalesce((SELECT n FROM allowed), 0)")
                 ).strip() + """
), counted AS (
    UPDATE {schema}.queues AS q
       SET window_start = CASE WHEN q2.new_window THEN now() ELSE q.window_start END,
           window_count = CASE WHEN q2.new_window THEN 0 ELSE q.window_count END
                          + (SELECT count(*) FROM claimed)
      FROM q AS q2
     WHERE q.name = q2.name AND q.rate_limit IS NOT NULL AND EXISTS (SELECT FROM claimed)
)
SELECT * FROM claimed
""")


CLAIM_LIMITED = claim_limited_jobs(PRIORITY_ORDER)
CLAIM_LIMITED_OLDEST = claim_limited_jobs(OLDEST_ORDER)

# After a limited queue's claim came back short (third statement, same transaction):
# whether its limits held jobs back: jobs the claim could take still wait in the queue, and
# it is not paused (a resumed queue is woken by its notification). Only then is the queue
# claimed again before a wake-up or the next poll.
HELD_BACK = """
SELECT EXISTS (SELECT 1 FROM {schema}.jobs WHERE """ + _available("", _NOT_PAUSED) + """)
"""

# The producer's connection: claims need not wait for their WAL flush. A claim lost in a
# crash only makes its job claimable again, and its token is not handed out again (see
# ``skipjack.sql``).
NO_WAIT_FOR_FLUSH = "SET synchronous_commit = off"

LIMITED_QUEUES = """
SELECT name, rate_period FROM {schema}.queues
 WHERE concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL
"""

# A handler's transaction is idle while the handler computes or calls other services: the
# handlers' connections lift any idle_in_transaction_session_timeout of the role or database,
# which would otherwise end every attempt that runs longer (a claim-mode transaction then
# sets its own, from its lease, with CLAIM_IN_TRANSACTION). Schema-free: run on each new
# connection.
LIFT_IDLE_TIMEOUT = "SET idle_in_transaction_session_timeout = 0"

# The same for one transaction of a connection the application gave (a framework's, for a
# transaction="complete" handler); it also begins that transaction on a connection that is
# not in autocommit, so that the job's own block in it is a savepoint.
LIFT_IDLE_TIMEOUT_LOCAL = "SET LOCAL idle_in_transaction_session_timeout = 0"

# The server's own statement and transaction timeouts (ms, 0: none; no row for
# transaction_timeout before PostgreSQL 17), read once by a worker (see CLAIM_IN_TRANSACTION).
SERVER_TIMEOUTS = """
SELECT name, setting::bigint FROM pg_settings
 WHERE name IN ('statement_timeout', 'transaction_timeout')
"""

# A claim-mode job whose claim was undone (its handler rolled back the claim's transaction
# itself, its session was lost, or the worker ended it at the lease): the failed attempt is
# counted here, with its error and retry delay (or the dead letter if it was the last),
# unless another worker has claimed the job since (its state or attempt count then differ).
COUNT_UNDONE_ATTEMPT = """
UPDATE {schema}.jobs AS j
   SET attempt = j.attempt + 1,
       state = CASE WHEN j.attempt + 1 >= j.max_attempts THEN 'discarded' ELSE 'scheduled' END,
       run_at = now() + make_interval(secs => %(delay)s),
       finished_at = CASE WHEN j.attempt + 1 >= j.max_attempts THEN now() END,
       errors = j.errors || jsonb_build_array(%(error)s::jsonb
                                              || jsonb_build_object('at', now()))
 WHERE j.id = %(id)s AND j.state = 'available' AND j.attempt = %(attempt)s - 1
RETURNING j.id, j.state, j.run_at
"""

# The lock wait of COUNT_UNDONE_ATTEMPT after a claim's session was lost: the server may not
# have rolled the claim back yet (it notices a dead client late); the attempt is then not
# counted. Schema-free.
LOST_CLAIM_LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s'"

# A claim-mode job whose handler ran past its lease: CLAIM_OPEN tells whether the claim's
# session is still in the claim's transaction (which began at the claim's attempted_at; the
# connection may be back in the pool, or the handler may have ended the transaction itself).
# If so, one session waits for the job's claim lock (TAKE_CLAIM_LOCK, under
# OVERDUE_LOCK_TIMEOUT, which returns its process id) and, once CLAIM_LOCK_AWAITED says that
# it waits, another one ends the claim's session (END_OVERDUE_CLAIM, again only while it is
# in that transaction; the number of sessions ended, 0 or 1). The server rolls the claim
# back and hands the lock to the waiting session, which counts the attempt
# (COUNT_UNDONE_ATTEMPT) and commits: until then every claim-mode claim passes over the job
# (see CLAIM_IN_TRANSACTION).
CLAIM_OPEN = """
SELECT count(*) FROM pg_stat_activity WHERE pid = %(pid)s AND xact_start = %(claimed_at)s
"""
TAKE_CLAIM_LOCK = """
SELECT pg_advisory_xact_lock(%(claim_lock)s, (%(id)s::bigint %% 2147483648)::int)
"""
CLAIM_LOCK_AWAITED = """
SELECT count(*) FROM pg_locks
 WHERE pid = %(waiter)s AND locktype = 'advisory' AND NOT granted
"""
END_OVERDUE_CLAIM = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
 WHERE pid = %(pid)s AND xact_start = %(claimed_at)s
"""
OVERDUE_LOCK_TIMEOUT = "SELECT pg_backend_pid(), set_config('lock_timeout', '5s', true)"

# The same job claimed again before that count: its error is added for people to see.
NOTE_ERROR = """
UPDATE {schema}.jobs
   SET errors = errors || jsonb_build_array(%(error)s::jsonb || jsonb_build_object('at', now()))
 WHERE id = %(id)s
"""

# A transaction a claim-mode handler began itself after it ended the claim's (COMMIT then
# BEGIN): rolled back, its writes with it.
END_HANDLER_TRANSACTION = "ROLLBACK"

# Args too large to come with the claim, read while the claim is still current.
LOAD_ARGS = """
SELECT args FROM {schema}.jobs WHERE id = %(id)s AND lease_version = %(lease_version)s
"""


def claim_params(queue: str, limit: int, *, lease: float, worker: str,
                 min_lease: float = 0.0, inline_bytes: int = 256 * 1024,
                 claim_mode_tasks: list[str] | None = None,
                 claim_mode_leases: list[float | None] | None = None,
                 claim_mode: bool = False, skip: list[int] | None = None,
                 claim_lock: int = 0, timeout_margin: float = 0.0,
                 server_statement_ms: int = 0,
                 transaction_timeout: bool = False) -> dict[str, Any]:
    """Bind values of every claim statement of this module.

    Args:
        queue: the one queue to claim from.
        limit: the most jobs to claim.
        lease: seconds, the worker's lease (a job may carry its own).
        worker: the name stored on the claimed rows.
        min_lease: seconds, the shortest lease the worker's heartbeat keeps alive.
        inline_bytes: args up to this size (bytes) come with the claim; larger ones are
            loaded later.
        claim_mode_tasks, claim_mode: see the module's docstring.
        claim_mode_leases: seconds, the lease of each task of ``claim_mode_tasks`` (None:
            the worker's), for its jobs with none of their own (read by
            ``CLAIM_IN_TRANSACTION`` only, see ``TASK_LEASE``).
        skip: ids not to claim (see ``candidates``).
        claim_lock: the first key of the jobs' claim locks (``claim_lock_key``; read by
            ``CLAIM_IN_TRANSACTION`` only).
        timeout_margin, server_statement_ms, transaction_timeout: seconds added to the
            job's lease for its transaction's timeouts, the server's own statement timeout
            (ms, 0: none), whether the server has ``transaction_timeout`` (read by
            ``CLAIM_IN_TRANSACTION`` only).
    """
    return {"queue": queue, "limit": limit, "lease": lease, "worker": worker,
            "min_lease": min_lease, "inline_bytes": inline_bytes,
            "claim_mode_tasks": text_array(claim_mode_tasks or []),
            "claim_mode_leases": number_array(claim_mode_leases or []), "claim_mode": claim_mode,
            "skip": number_array(skip or []), "claim_lock": claim_lock,
            "timeout_margin": timeout_margin, "server_statement_ms": server_statement_ms,
            "transaction_timeout": transaction_timeout}
