"""Operating the queue: inspect jobs, cancel them, re-enqueue the dead letter, pause and limit
queues, prune history. ``skipjack.App`` has these methods (``Admin``).

``prune``, ``rollup`` and ``notify`` are also the worker's maintenance duties'
own steps."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import psycopg
import psycopg.rows

from .channels import channel_name, settings_channel_name
from .cron import GRACE_MAX
from .db import Database
from .errors import ValidationError
from .jobs import QUEUE_MAX_BYTES, check_name, job_ids
from .search import JobFilter
from .sql import Queries

log = logging.getLogger("skipjack.admin")

# The largest concurrency or rate limit, and the longest rate period (seconds).
LIMIT_MAX = 1_000_000
PERIOD_MAX = 31_557_600.0

# Rows per statement of every batched operation (cancel, prune, stage, rescue), so none holds
# many row locks at once.
BATCH = 1000

# Runs of the retry statement when a job taking a retried job's key commits meanwhile.
RETRY_ROUNDS = 5

RetryOutcome = Literal["retried", "not_found", "not_discarded", "key_held"]


@dataclass(frozen=True)
class RetryResult:
    """What ``Admin.retry_discarded_each`` did with one job id.

    Attributes:
        id: the job id asked for.
        outcome: ``"retried"`` (available again with a fresh set of attempts),
            ``"not_found"`` (no such job: never enqueued, or pruned), ``"not_discarded"``
            (not in the dead letter: ``state`` says where it is, None when another session
            changed or pruned it while this ran) or ``"key_held"`` (its idempotency key is
            held by another job, ``holder``, which keeps it: the job stays discarded).
        state: the job's state after the call (``"available"`` when retried, else as read).
        idempotency_key: the job's idempotency key, or None.
        holder: the id of the job holding the key (``"key_held"`` only), and
            ``holder_state`` its state.
    """

    id: int
    outcome: RetryOutcome
    state: str | None = None
    idempotency_key: str | None = None
    holder: int | None = None
    holder_state: str | None = None

    def describe(self) -> str:
        """One line for people, e.g. ``job 7 left alone: its idempotency key 'k' is held by
        job 9 (available)``."""
        if self.outcome == "retried":
            return f"job {self.id} retried"
        if self.outcome == "not_found":
            why = "no such job"
        elif self.outcome == "key_held":
            why = (f"its idempotency key {self.idempotency_key!r} is held by job "
                   f"{self.holder} ({self.holder_state})")
        elif self.state is None:
            why = "changed or pruned by another session meanwhile"
        else:
            why = f"not discarded (state {self.state})"
        return f"job {self.id} left alone: {why}"


def _retry_result(job_id: int, queue: str | None, state: str | None, key: str | None,
                  holder: int | None, holder_state: str | None) -> RetryResult:
    """A row of RETRY_DISCARDED as a ``RetryResult``."""
    if queue is not None:
        return RetryResult(job_id, "retried", "available", key)
    if state is None:
        return RetryResult(job_id, "not_found")
    if state != "discarded":
        return RetryResult(job_id, "not_discarded", state, key)
    if holder is not None:
        return RetryResult(job_id, "key_held", state, key, holder, holder_state)
    return RetryResult(job_id, "not_discarded", None, key)  # changed by another session


def notify(conn: psycopg.Connection[Any], queries: Queries, queues: set[str]) -> bool:
    """Wake the workers of ``queues``, unless PostgreSQL's notification queue is too full.

    A wake-up is only an optimisation (workers poll anyway), so it is skipped while the
    notification queue is at least ``notify_queue_limit()`` full (see migration 3), and also
    when PostgreSQL refuses it at commit because the queue filled up after that check.

    Args:
        conn: an autocommit connection (the notification is sent when its statement commits).
        queries: the statements of the app's schema.
        queues: the queue names to wake; none sends nothing.

    Returns:
        True if the notifications were sent, False if there was nothing to send or they were
        skipped.

    Raises:
        psycopg.Error: the database could not be reached or refused the statement otherwise.
    """
    if not queues:
        return False
    try:
        rows = conn.execute(queries.NOTIFY_QUEUES, {"channel": channel_name(queries.schema),
                                                    "queues": sorted(queues)}).fetchall()
    except psycopg.errors.ProgramLimitExceeded:  # "too many notifications in the NOTIFY queue"
        return False
    return bool(rows)


def prune(conn: psycopg.Connection[Any], queries: Queries, *, retention: float,
          discarded_retention: float | None = None, limit: int = BATCH) -> int:
    """Delete finished jobs past their retention, one batch per state group, and cron
    history recorded more than ``max(retention, 7 days)`` ago except each schedule's latest
    slot (the scheduler resumes after it, so no slot runs again once its job is pruned).

    Args:
        retention: seconds to keep succeeded and cancelled jobs.
        discarded_retention: seconds to keep discarded jobs (the dead letter); None keeps
            them for ten times ``retention``.
        limit: the most rows deleted per group in this call.

    Returns:
        The number of jobs deleted.

    Raises:
        psycopg.IntegrityError: a row of the application's references a job of the batch
            with ``ON DELETE RESTRICT`` (``RestrictViolation``) or ``NO ACTION``, the
            default (``ForeignKeyViolation``): nothing of that batch is deleted, and the
            same batch fails again at the next call while the row is there. Declare such
            keys ``ON DELETE CASCADE`` or ``SET NULL``.
        psycopg.Error: the database refused a statement or could not be reached.
    """
    deleted = 0
    for states, age in ((["succeeded", "cancelled"], retention),
                        (["discarded"], 10 * retention if discarded_retention is None
                         else discarded_retention)):
        rows = conn.execute(queries.PRUNE, {"age": age, "states": states,
                                            "limit": limit}).fetchall()
        deleted += len(rows)
    # cron history: never a slot still inside the longest grace window a schedule may have
    conn.execute(queries.PRUNE_CRON, {"age": max(retention, GRACE_MAX)})
    return deleted


def rollup(conn: psycopg.Connection[Any], queries: Queries, *, runs: int = 24) -> int:
    """Count the jobs finished since the last rollup into the per-minute ``throughput`` table
    (up to 30 seconds ago, an hour of history per statement, at most ``runs`` statements),
    then delete its rows older than eight days. Safe beside other rollups: one at a time
    counts, the others return at once.

    Returns:
        The (minute, queue, state) rows written or updated.

    Raises:
        psycopg.Error: the database could not be reached or refused the statement.
    """
    written = 0
    for _ in range(runs):
        with conn.transaction():
            row = conn.execute(queries.ROLLUP_THROUGHPUT).fetchone()
        if row is None:  # another rollup holds the watermark
            return written
        written += row[2]
        if not row[1]:  # caught up
            break
    conn.execute(queries.PRUNE_THROUGHPUT)
    return written


class Admin:
    """Methods of ``skipjack.App`` for people and operators (mixed into App, which sets
    ``db``)."""

    db: Database

    @property
    def queries(self) -> Queries:
        """The statements of this app's schema."""
        return self.db.queries

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """A new sync connection to the app's database (autocommit unless told otherwise).

        Raises:
            psycopg.OperationalError: the database cannot be reached.
        """
        return self.db.connect(**kwargs)

    def reading(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A connection for a few reads, returned (or closed) when the block ends: the app's
        pool's (``skipjack.App``), else a new one.

        Raises:
            psycopg.OperationalError: the database cannot be reached.
        """
        return self.connect()

    # --- inspection ----------------------------------------------------------------------

    def stats(self, discarded_limit: int = 10) -> dict[str, Any]:
        """Queue depth for people and monitors; fast however much history the table holds.

        Returns:
            ``{"queues": {queue: {state: count}}`` for scheduled, available and running jobs,
            ``"oldest_runnable_seconds": {queue: age}`` (database clock),
            ``"settings": {queue: {paused, concurrency_limit, rate_limit, rate_period}}`` for
            the queues with a setting, and ``"discarded": [the newest discarded jobs]}``.
        """
        q = self.queries
        with self.connect() as conn:
            counts: dict[str, dict[str, int]] = {}
            for queue, state, n in conn.execute(q.QUEUE_DEPTH).fetchall():
                counts.setdefault(queue, {})[state] = n
            oldest = dict(conn.execute(q.OLDEST_RUNNABLE).fetchall())
            cur = conn.cursor(row_factory=psycopg.rows.dict_row)
            discarded = cur.execute(q.LIST_JOBS, {"state": "discarded", "queue": None,
                                                  "limit": discarded_limit}).fetchall()
            settings = {r.pop("name"): r for r in cur.execute(q.LIST_QUEUES).fetchall()}
        return {"queues": counts, "oldest_runnable_seconds": oldest, "settings": settings,
                "discarded": discarded}

    def queue_summary(self) -> dict[str, Any]:
        """What a monitor graphs, read without scanning the history: each count comes from
        the partial index of its state (see ``QUEUE_GAUGES`` in ``skipjack.sql.admin``),
        so its cost grows with the waiting, running and discarded jobs, not the succeeded
        ones.

        Returns:
            ``{"depth": {queue: {state: count}}`` for scheduled, available, running and
            discarded jobs, ``"oldest_runnable_seconds": {queue: age}`` (database clock),
            ``"queues": [settings rows as from queues()]``, ``"workers": live worker count``,
            ``"estimated_rows": the planner's estimate of the whole table}``.
        """
        q = self.queries
        with self.reading() as conn:
            depth: dict[str, dict[str, int]] = {}
            oldest: dict[str, float] = {}
            for queue, state, n, age in conn.execute(q.QUEUE_GAUGES).fetchall():
                depth.setdefault(queue, {})[state] = n
                if age is not None:
                    oldest[queue] = age
            cur = conn.cursor(row_factory=psycopg.rows.dict_row)
            settings = cur.execute(q.LIST_QUEUES).fetchall()
            workers = len(conn.execute(q.LIST_WORKERS).fetchall())
            row = conn.execute(q.ESTIMATED_ROWS, {"schema": q.schema}).fetchone()
        return {"depth": depth, "oldest_runnable_seconds": oldest, "queues": settings,
                "workers": workers, "estimated_rows": row[0] if row else 0}

    def workers(self) -> list[dict[str, Any]]:
        """The live workers (those whose registry row has not expired), oldest first: name,
        host, pid, version, queues, concurrency, running (jobs at the last refresh),
        started_at, last_seen (database clock) and stats (the worker's counters)."""
        with self.reading() as conn:
            cur = conn.cursor(row_factory=psycopg.rows.dict_row)
            return cur.execute(self.queries.LIST_WORKERS).fetchall()

    def state_counts(self) -> dict[str, dict[str, int]]:
        """Exact counts per queue and state, finished ones included (scans the history)."""
        counts: dict[str, dict[str, int]] = {}
        with self.connect() as conn:
            for queue, state, n in conn.execute(self.queries.STATS).fetchall():
                counts.setdefault(queue, {})[state] = n
        return counts

    def list_jobs(self, *, state: str | None = None, queue: str | None = None,
                  limit: int = 50) -> list[dict[str, Any]]:
        """The newest ``limit`` jobs, optionally of one state and queue, as dicts."""
        with self.connect() as conn:
            cur = conn.cursor(row_factory=psycopg.rows.dict_row)
            return cur.execute(self.queries.LIST_JOBS,
                               {"state": state, "queue": queue, "limit": limit}).fetchall()

    def get_job(self, job_id: int) -> dict[str, Any] | None:
        """Every column of one job, or None if there is no such job."""
        with self.reading() as conn:
            cur = conn.cursor(row_factory=psycopg.rows.dict_row)
            return cur.execute(self.queries.GET_JOB, {"id": job_id}).fetchone()

    def search_jobs(self, where: JobFilter, *, before: int | None = None,
                    after: int | None = None, limit: int = 50,
                    statement_timeout: float | None = None) -> list[dict[str, Any]]:
        """One page of the jobs matching ``where``, newest first, by keyset pagination on the
        id (no OFFSET: each page costs the same however deep it is).

        Args:
            where: the filter (checked here).
            before: only jobs with a smaller id (the next, older page: the last id shown).
            after: only jobs with a larger id (the previous, newer page: the first id shown).
            limit: rows, 1..1,000.
            statement_timeout: seconds the search may take (None: the server's setting).

        Returns:
            Dicts with id, queue, task, state, attempt, max_attempts, priority, run_at,
            created_at, finished_at, idempotency_key and last_error (the last error message).

        Raises:
            ValidationError: a filter field, ``before``/``after`` or ``limit`` out of range.
            psycopg.errors.QueryCanceled: the search took longer than ``statement_timeout``.
        """
        params = where.check().params()
        for name, value in (("before", before), ("after", after)):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValidationError(name, f"{value!r} must be a job id >= 0")
                params[name] = value
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise ValidationError("limit", f"{limit!r} must be an int in 1..1,000")
        params["limit"] = limit
        conditions = tuple(k for k in params if k != "limit")
        query = self.queries.job_search(conditions, where.time,
                                        ascending=after is not None and before is None)
        with self.reading() as conn:
            with conn.transaction():
                if statement_timeout is not None:  # for this transaction only
                    conn.execute(self.queries.SET_STATEMENT_TIMEOUT,
                                 {"ms": f"{max(1, int(statement_timeout * 1000))}"})
                cur = conn.cursor(row_factory=psycopg.rows.dict_row)
                rows = cur.execute(query, params).fetchall()
        if after is not None and before is None:
            rows.reverse()
        return rows

    def matching_ids(self, where: JobFilter, *, batch: int = BATCH) -> Iterator[list[int]]:
        """The ids of the jobs matching ``where``, newest first, ``batch`` at a time, each batch
        read when the previous one has been handled (a job that stops matching meanwhile
        is not returned again; one that starts matching with a larger id than those already
        returned is not seen).

        Raises:
            ValidationError: a filter field out of range.
        """
        params = where.check().params()
        conditions = (*params, "before")
        query = self.queries.job_search(conditions, where.time, ids_only=True)
        before = 2**63 - 1
        with self.connect() as conn:
            while True:
                rows = conn.execute(query, {**params, "before": before,
                                            "limit": batch}).fetchall()
                if not rows:
                    return
                ids = [r[0] for r in rows]
                yield ids
                before = ids[-1]

    def throughput(self, span: timedelta, bucket: timedelta,
                   queue: str | None = None) -> list[dict[str, Any]]:
        """Finished jobs per ``bucket`` and final state over the last ``span``, from the
        rollup that workers' maintenance keeps (``rollup``; counted up to about 30 s
        behind, so the newest bucket fills in late).

        Args:
            span: how far back, e.g. the last hour.
            bucket: the width of each bucket, e.g. a minute; buckets are aligned to UTC.
            queue: one queue, or None for all.

        Returns:
            Dicts with ``at`` (the bucket's start, UTC), ``state``, ``jobs``, ``started``
            (jobs with a start latency), ``latency_sum`` and ``latency_max`` (seconds from
            run_at to the last attempt's start).
        """
        with self.reading() as conn:
            cur = conn.cursor(row_factory=psycopg.rows.dict_row)
            return cur.execute(self.queries.THROUGHPUT, {"span": span, "bucket": bucket,
                                                         "queue": queue}).fetchall()

    def finished_by_queue(self, span: timedelta) -> dict[str, dict[str, int]]:
        """``{queue: {state: jobs}}`` finished over the last ``span``, from the same rollup as
        ``throughput``."""
        counts: dict[str, dict[str, int]] = {}
        with self.reading() as conn:
            for queue, state, n in conn.execute(self.queries.THROUGHPUT_BY_QUEUE,
                                                {"span": span}).fetchall():
                counts.setdefault(queue, {})[state] = n
        return counts

    def rollup(self) -> int:
        """Run the throughput rollup now (workers' maintenance runs it every 15 s): see
        ``rollup``."""
        with self.connect() as conn:
            return rollup(conn, self.queries)

    def job_states(self, ids: Sequence[int]) -> dict[int, tuple[str, bool]]:
        """``{id: (state, cancel_requested)}`` for those of ``ids`` that exist."""
        with self.reading() as conn:
            rows = conn.execute(self.queries.JOB_STATES, {"id": job_ids(ids)}).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    def cron_history(self) -> list[dict[str, Any]]:
        """Per cron schedule name with recorded slots: ``last_enqueued`` (the latest slot that
        became a job, UTC) and ``missed`` (slots skipped because no scheduler ran within
        their grace, among those still recorded)."""
        with self.reading() as conn:
            cur = conn.cursor(row_factory=psycopg.rows.dict_row)
            return cur.execute(self.queries.CRON_LIST).fetchall()

    def running_jobs(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The running jobs (at most ``limit``), by worker: id, queue, task, attempt,
        max_attempts, attempted_at, lease_expires_at, worker, cancel_requested."""
        with self.reading() as conn:
            cur = conn.cursor(row_factory=psycopg.rows.dict_row)
            return cur.execute(self.queries.RUNNING_JOBS, {"limit": limit}).fetchall()

    # --- dead letter and cancellation ----------------------------------------------------

    def retry_discarded(self, ids: Sequence[int]) -> list[int]:
        """Put discarded jobs back in their queue with a fresh set of attempts.

        Args:
            ids: job ids (ints); repeated ids count once.

        Returns:
            The ids that were discarded and are now available, in the order asked. The
            others are left alone and logged (INFO, logger ``skipjack.admin``) with why: no
            such job, not discarded, or its idempotency key now held by another job (which
            keeps it). ``retry_discarded_each`` returns that answer per id.

        Raises:
            psycopg.Error: the database refused the statement or could not be reached.
        """
        results = self.retry_discarded_each(ids)
        for result in results:
            if result.outcome != "retried":
                log.info("retry_discarded: %s", result.describe())
        return [r.id for r in results if r.outcome == "retried"]

    def retry_discarded_each(self, ids: Sequence[int], *,
                             dry_run: bool = False) -> list[RetryResult]:
        """``retry_discarded``, answering for each id what became of it.

        Every job that can be retried is, in one transaction, whatever the others are: a job
        whose key another job holds never makes the call fail (a holder that commits while
        this runs makes it run its statement again, up to 5 times). Of several discarded
        jobs asked for that share a key, the newest is retried; the others are left alone,
        their key held by it.

        Args:
            ids: job ids (ints); repeated ids count once.
            dry_run: run the retry in a transaction that is rolled back: the answers are
                what a real run would give now, and nothing changes.

        Returns:
            One ``RetryResult`` per distinct id, in the order asked.

        Raises:
            psycopg.Error: the database refused the statement or could not be reached.
        """
        asked = list(dict.fromkeys(job_ids(ids)))
        with self.connect() as conn:
            for attempt in range(1, RETRY_ROUNDS + 1):
                try:
                    with conn.transaction() as tx:
                        rows = conn.execute(self.queries.RETRY_DISCARDED,
                                            {"id": asked}).fetchall()
                        if dry_run:
                            raise psycopg.Rollback(tx)
                        notify(conn, self.queries, {r[1] for r in rows if r[1] is not None})
                    break
                except psycopg.errors.UniqueViolation:
                    if attempt == RETRY_ROUNDS:  # a new holder each time: give up
                        raise
        by_id = {row[0]: _retry_result(*row) for row in rows}
        return [by_id[i] for i in asked]

    def discard(self, ids: Sequence[int]) -> list[int]:
        """Send waiting (scheduled or available) jobs to the dead letter; returns those moved.
        Running jobs are left alone: cancel them instead."""
        with self.connect() as conn:
            rows = conn.execute(self.queries.DISCARD_WAITING, {"id": job_ids(ids)}).fetchall()
        return [r[0] for r in rows]

    def cancel(self, ids: Sequence[int] | None = None, *, queue: str | None = None,
               task: str | None = None, timeout: float = 10.0) -> dict[str, int]:
        """Cancel jobs: waiting ones (scheduled, available) at once; running ones by request
        (the worker is told at its next heartbeat: async handlers are cancelled, sync ones see
        ``current_job().cancelled``; the job ends ``cancelled``, or ``succeeded`` if it
        finished first). Finished jobs are left alone.

        Args:
            ids: job ids; and/or ``queue`` and/or ``task`` to cancel in bulk. At least one.
            timeout: seconds to keep going while workers hold some of the rows (a job of
                a ``transaction="claim"`` task runs in an uncommitted claim: it cannot be
                cancelled while it runs, and is left as it is once this expires).

        Returns:
            ``{"cancelled": n, "requested": m}``.

        Raises:
            ValidationError: no selector given.
        """
        if ids is None and queue is None and task is None:
            raise ValidationError("cancel", "give ids, queue or task")
        q = self.queries
        params = {"id": job_ids(ids) if ids is not None else None, "queue": queue, "task": task,
                  "limit": BATCH}
        done = {"cancelled": 0, "requested": 0}
        deadline = time.monotonic() + timeout
        with self.connect() as conn:
            while True:
                cancelled = len(conn.execute(q.CANCEL_WAITING, params).fetchall())
                requested = len(conn.execute(q.REQUEST_CANCEL, params).fetchall())
                done["cancelled"] += cancelled
                done["requested"] += requested
                if cancelled or requested:
                    continue
                row = conn.execute(q.CANCEL_PENDING, params).fetchone()
                if not row or not row[0] or time.monotonic() > deadline:
                    return done
                time.sleep(0.01)  # rows locked by a claim in flight: they are running soon

    # --- queues --------------------------------------------------------------------------

    def pause_queue(self, queue: str) -> None:
        """Stop every worker from claiming from ``queue`` (running jobs go on)."""
        self._set_paused(queue, True)

    def resume_queue(self, queue: str) -> None:
        """Let workers claim from ``queue`` again; they are woken at once."""
        self._set_paused(queue, False)

    def _set_paused(self, queue: str, paused: bool) -> None:
        check_name("queue", queue, QUEUE_MAX_BYTES)
        with self.connect() as conn, conn.transaction():
            conn.execute(self.queries.SET_PAUSED, {"queue": queue, "paused": paused})
            self._announce(conn, queue)

    def _announce(self, conn: psycopg.Connection[Any], queue: str) -> None:
        """Wake the workers about ``queue``'s new settings when this transaction commits."""
        conn.execute(self.queries.NOTIFY_SETTINGS,
                     {"channel": settings_channel_name(self.queries.schema), "queue": queue})

    def set_queue_limits(self, queue: str, *, concurrency: int | None = None,
                         rate: int | None = None, period: float | None = None) -> None:
        """Limit ``queue`` across every worker and host (None removes a limit).

        Args:
            concurrency: the most jobs running at once with a live lease (1..1,000,000).
            rate: the most jobs claimed per ``period`` seconds (1..1,000,000, with
                ``period`` in (0, one year]); a job claimed ahead of a free slot (a
                worker's prefetch) may start later. A window opens at the first claim that
                takes a job after the previous one closed.

        Workers are told at once (and re-read limits every poll interval). Limits are enforced for
        lease-mode tasks; a ``transaction="claim"`` task's running jobs are invisible to
        other sessions and do not count.

        Raises:
            ValidationError: a limit out of its range, or a rate without a period.
        """
        check_name("queue", queue, QUEUE_MAX_BYTES)
        for name, value in (("concurrency", concurrency), ("rate", rate)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= LIMIT_MAX):
                raise ValidationError(name, f"{value!r} must be an int in 1..{LIMIT_MAX:,}")
        if (rate is None) != (period is None):
            raise ValidationError("rate", "give rate >= 1 and period > 0 seconds together")
        if period is not None and (isinstance(period, bool)
                                   or not isinstance(period, int | float)
                                   or not 0 < period <= PERIOD_MAX):
            raise ValidationError("period", f"{period!r} must be seconds in (0, "
                                  f"{PERIOD_MAX:,.0f}] (a year)")
        with self.connect() as conn, conn.transaction():
            conn.execute(self.queries.SET_LIMITS, {"queue": queue, "concurrency": concurrency,
                                                   "rate": rate, "period": period})
            self._announce(conn, queue)

    def queues(self) -> list[dict[str, Any]]:
        """Every queue with a setting (paused or limited)."""
        with self.connect() as conn:
            cur = conn.cursor(row_factory=psycopg.rows.dict_row)
            return cur.execute(self.queries.LIST_QUEUES).fetchall()

    # --- retention -----------------------------------------------------------------------

    def prune(self, retention: float, discarded_retention: float | None = None,
              batch: int = BATCH) -> int:
        """Delete finished jobs older than ``retention`` seconds (discarded ones older than
        ``discarded_retention``, default ten times as long), batch by batch until none is
        left. Safe beside workers, bulk cancels and other pruners. Returns the rows deleted.
        Cron history goes too, as in ``prune``.

        Raises:
            ValidationError: a retention that is not a number of seconds > 0.
            psycopg.IntegrityError: a row of the application's references a job due for
                pruning with ``ON DELETE RESTRICT`` or ``NO ACTION``: see ``prune``.
        """
        for name, value in (("retention", retention), ("discarded_retention",
                                                        discarded_retention)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValidationError(name, f"{value!r} must be a number of seconds > 0")
        total = 0
        with self.connect() as conn:
            while True:
                deleted = prune(conn, self.queries, retention=retention,
                                discarded_retention=discarded_retention, limit=batch)
                total += deleted
                if not deleted:
                    return total
