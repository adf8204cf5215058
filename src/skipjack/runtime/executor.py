"""The executor: runs each claimed job of the ``"none"`` and ``"complete"`` transaction modes
as an asyncio task, and hands its outcome to the completer.

``async def`` handlers run on the worker's event loop, sync ones in a thread pool of
``concurrency`` threads. A task's ``timeout`` bounds each attempt. A job taken from its handler
(lease lost, cancellation requested, timeout, shutdown) has its context's ``cancelled`` set,
and an async handler is cancelled outright; ``skipjack.outcome.decide`` then says what is
recorded.

``transaction="complete"``: the executor opens a transaction, exposes its connection as
``current_job().conn``, runs the handler, then writes the fenced completion in the same
transaction and commits (``run_complete``, ``run_complete_async``). If the completion
matches no row (the job was rescued or re-claimed meanwhile), everything rolls back: the
handler's rows never become visible. So an effect table keyed by job id never sees a
duplicate, whatever workers crash or stall. If the handler raises, its writes roll back and
the attempt is recorded as failed. The handler must not commit or roll back that connection.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import inspect
import logging
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from ..app import AsyncTransactionSource, Task, TransactionSource
from ..context import CancelCause, Job, JobContext, set_current
from ..db import Database, use_json_text_loader
from ..errors import ArgumentsError, HandlerTransactionError, Snooze
from ..hooks import Hooks
from ..jobs import dump_result
from ..outcome import UNKNOWN_TASK_GRACE, Outcome, decide, outcome_params
from ..sql.claim import LIFT_IDLE_TIMEOUT, LIFT_IDLE_TIMEOUT_LOCAL
from .completer import Completer
from .heartbeat import Leases
from .report import Reporter, WorkerStats
from .slots import Running, Slots

log = logging.getLogger("skipjack.worker")

UNKNOWN_WARN_EVERY = 60.0  # seconds between warnings about one unknown task
# Seconds an async handler has to end once it was cancelled (a timeout, a cancellation
# request, a lost lease). One that catches its CancelledError and goes on is then left
# running, holding its slot until it returns, and its attempt is recorded as the
# cancellation decides (a timeout: a failed attempt), as for a sync handler's thread.
CANCEL_GRACE = 5.0
# The most jobs Executor.fill starts in one turn of the event loop. Handlers that never wait
# end as they start (eager tasks), so a fill could run a whole buffer of 1,000 no-op jobs
# before the loop turned: the next claim and the outcome writes then waited for it, and the
# worker, its claims' backend and its outcomes' backend took turns instead of running side
# by side. W2 at concurrency 10, 30,000 jobs, four interleaved pairs: 30,000-32,014 jobs/s
# without the limit, 35,408-37,257 with it (at 1 a turn, as without eager tasks: 24,432-
# 27,404 at concurrency 1; 16, 32 and 64 all gave 34,000-38,000 at concurrency 1, 10, 100).
FILL_TURN = 32


if sys.version_info >= (3, 12):
    def _start_task(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A task for ``coro`` that runs at once, up to its first wait, instead of at the
        event loop's next turn (an eager task): a handler that never waits (a no-op, a
        quick computation) ends within this call, with no turn of the loop of its own. In
        a drain of no-op jobs (W2 of ``skipjack bench``) the worker's CPU went from 28-29
        to 21-22 us a job."""
        return asyncio.Task(coro, loop=asyncio.get_running_loop(), eager_start=True)
else:
    def _start_task(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A task for ``coro`` (Python 3.11 has no eager tasks: it starts at the loop's
        next turn)."""
        return asyncio.get_running_loop().create_task(coro)


def _boxed(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``fn()`` as (True, its value) or (False, the exception it raised), so that the
    exception reaches the event loop as it was: asyncio.wrap_future replaces a
    ``TimeoutError`` with a new one, without the handler's traceback or cause."""
    try:
        return True, fn()
    except BaseException as exc:
        return False, exc


class Executor:
    """Starts buffered jobs in free slots and runs them.

    Args:
        db: the app's database.
        tasks: the app's task registry (read when a job starts).
        slots: the shared capacity state.
        leases: the running set the heartbeat renews.
        completer: where outcomes go.
        stats: counters to update.
        report: told about attempts whose outcome is recorded here (``transaction``
            "complete") or never (a lost lease).
        hooks: the app's hooks, entered around each handler call.
        stopping: set when the worker shuts down (no more jobs start).
        concurrency: threads for sync handlers, and connections per pool.
        large_args_concurrency: the most jobs at once whose args were too large to come
            with the claim (they are loaded just before the handler runs).
        on_slot_freed: called when a slot frees, with the queue of the job that ended (None
            for a stuck handler thread that returned).
        unknown_task_grace: seconds after its enqueue during which a job of a task this
            worker does not know is released for another worker (see
            ``skipjack.outcome.decide``).
        transactions: the app's ``complete_transaction`` (see ``skipjack.App``): where
            sync ``transaction="complete"`` handlers get their transaction; None: the
            executor's own pool.
        async_transactions: the app's ``complete_transaction_async``: the same for async
            handlers.
    """

    def __init__(self, db: Database, tasks: Mapping[str, Task], slots: Slots, leases: Leases,
                 completer: Completer, stats: WorkerStats, report: Reporter, hooks: Hooks,
                 stopping: asyncio.Event, *,
                 concurrency: int, large_args_concurrency: int,
                 on_slot_freed: Callable[[str | None], None],
                 unknown_task_grace: float = UNKNOWN_TASK_GRACE,
                 transactions: TransactionSource | None = None,
                 async_transactions: AsyncTransactionSource | None = None) -> None:
        self._db = db
        self._tasks = tasks
        self._slots = slots
        self._leases = leases
        self._completer = completer
        self._stats = stats
        self._report = report
        self._hooks = hooks
        self._stopping = stopping
        self._concurrency = concurrency
        self._on_slot_freed = on_slot_freed
        self._unknown_task_grace = unknown_task_grace
        self._transactions = transactions
        self._async_transactions = async_transactions
        self._filling = False
        self._fill_soon = False  # a fill is scheduled for the loop's next turn
        self._unknown_warned: dict[str, float] = {}  # task name -> when it was last logged
        self._threads = ThreadPoolExecutor(concurrency, thread_name_prefix="skipjack-job")
        self._large_args = asyncio.Semaphore(large_args_concurrency)
        self.pool: ConnectionPool[psycopg.Connection[Any]] | None = None
        self._apool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None

    async def open(self) -> None:
        """Open connection pools for the handlers that run in a transaction of their own
        (``transaction`` "complete" or "claim"), if the app has any: sync and async ones."""
        own = [t for t in self._tasks.values() if t.transaction != "none"]
        if any(not inspect.iscoroutinefunction(t.fn) for t in own):
            self.pool = ConnectionPool(self._db.dsn, min_size=0, max_size=self._concurrency,
                                       kwargs=self._db.connect_kwargs, open=False,
                                       configure=_no_idle_timeout)
            await asyncio.to_thread(self.pool.open)
        if any(inspect.iscoroutinefunction(t.fn) for t in own):
            self._apool = AsyncConnectionPool(self._db.dsn, min_size=0,
                                              max_size=self._concurrency,
                                              kwargs=self._db.connect_kwargs, open=False,
                                              configure=_no_idle_timeout_async)
            await self._apool.open()

    def pool_gauges(self) -> dict[tuple[str, str], int]:
        """(``sync``/``async``, ``open``/``idle``) -> connections of the handlers' pools."""
        out: dict[tuple[str, str], int] = {}
        for kind, pool in (("sync", self.pool), ("async", self._apool)):
            if pool is not None:
                stats = pool.get_stats()
                out[kind, "open"] = stats.get("pool_size", 0)
                out[kind, "idle"] = stats.get("pool_available", 0)
        return out

    async def close(self) -> None:
        """Stop the thread pool (without waiting for handlers that still run) and close the
        connection pools."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._slots.stuck_threads:
            log.warning("%d sync handler threads are still running (their jobs were "
                        "released); Python waits for them before this process exits "
                        "(os._exit stops at once, as the skipjack CLI does)",
                        self._slots.stuck_threads)
        if self._apool is not None:
            await self._apool.close()
        if self.pool is not None:
            await asyncio.to_thread(self.pool.close)

    # --- buffering and starting ---------------------------------------------------------

    def buffer(self, jobs: list[Job]) -> None:
        """Claimed jobs wait in the slots' ready buffer for a slot; their leases are renewed
        meanwhile."""
        running, ready = self._slots.running, self._slots.ready
        for job in jobs:
            stale = running.get(job.id)
            if stale is not None:
                # claimed again while it still runs here: its lease expired and it was
                # rescued, or a server crash undid its claim. The old run is cancelled and
                # writes nothing (its token is stale); until it ends it holds its slot as a
                # stuck thread.
                self.lease_lost(job.id, stale.job.lease_version,
                                "lease lost; the job was claimed again")
                stale.superseded = True
                del running[job.id]
                self._slots.stuck_threads += 1
            ready[job.id] = job
        self._stats.claimed += len(jobs)
        self._leases.add_jobs(jobs)

    def fill(self) -> None:
        """Start buffered jobs while slots are free (first claimed, first started).

        A job whose handler never waits ends within ``_start`` (see ``_start_task``) and
        calls ``fill`` again as it frees its slot: that inner call returns at once and this
        loop starts the next job, so a buffer of no-op jobs runs in a loop, not a recursion
        as deep as the buffer. After FILL_TURN starts the loop lets the event loop turn and
        goes on at its next turn, so that the next claim and the outcome writes go out while
        the buffer runs rather than after it."""
        if self._filling:
            return
        slots = self._slots
        self._filling = True
        try:
            for _ in range(FILL_TURN):
                if not slots.ready or not slots.has_free_slot() or self._stopping.is_set():
                    return
                job_id = next(iter(slots.ready))
                self._start(slots.ready.pop(job_id))
            if slots.ready and slots.has_free_slot() and not self._fill_soon:
                self._fill_soon = True
                asyncio.get_running_loop().call_soon(self._fill_later)
        finally:
            self._filling = False

    def _fill_later(self) -> None:
        self._fill_soon = False
        self.fill()

    def _start(self, job: Job) -> None:
        task = self._tasks.get(job.task)
        ctx = JobContext(job)
        ctx.on_progress = self._leases.report
        running = Running(job, ctx, is_async=task is not None and task.is_async)
        self._slots.running[job.id] = running
        running.task = _start_task(self._execute(running))

    # --- taking jobs from their handlers -------------------------------------------------

    def lease_lost(self, job_id: int, lease_version: int, reason: str) -> None:
        """The lease of a job this worker holds was lost (``reason`` for the log): a waiting
        job is dropped, a running one is taken from its handler and will write nothing."""
        waiting = self._slots.ready.get(job_id)
        if waiting is not None and waiting.lease_version == lease_version:
            del self._slots.ready[job_id]
            self._stats.leases_lost += 1
            log.warning("job %s: %s before it started; dropping it", job_id, reason)
            return
        if self._take(job_id, lease_version, reason, "lease lost"):
            self._stats.leases_lost += 1
            log.warning("job %s: %s; cancelling its handler", job_id, reason)

    def cancel_requested(self, job_id: int, lease_version: int) -> None:
        """Someone asked to cancel a job this worker holds: a waiting job ends cancelled at
        once, a running one is taken from its handler."""
        waiting = self._slots.ready.get(job_id)
        if waiting is not None and waiting.lease_version == lease_version:
            del self._slots.ready[job_id]
            self._completer.submit(Outcome(job_id, lease_version, waiting.queue, "cancel",
                                           job=waiting))
            return
        if self._take(job_id, lease_version, "cancel requested", "cancel requested"):
            log.info("job %s: cancellation requested; cancelling its handler", job_id)

    def _take(self, job_id: int, lease_version: int, reason: str, cause: CancelCause) -> bool:
        """Cancel the run of ``job_id`` under ``lease_version``, if it runs here."""
        running = self._slots.running.get(job_id)
        if running is None or running.job.lease_version != lease_version:
            return False
        running.ctx.cancel(reason, cause)
        if running.is_async:
            self._cancel_async(running)
        return True

    def _cancel_async(self, running: Running) -> None:
        """Cancel an async handler's task; ``_abandon_if_deaf`` CANCEL_GRACE seconds later."""
        if running.task is None or running.task.done():
            return
        running.task.cancel()
        asyncio.get_running_loop().call_later(CANCEL_GRACE, self._abandon_if_deaf, running)

    def _abandon_if_deaf(self, running: Running) -> None:
        """An async handler cancelled CANCEL_GRACE seconds ago that still runs caught its
        CancelledError and went on: record its attempt now, as its cancellation decides (a
        timeout: a failed attempt; a cancellation request: cancelled; a lost lease:
        nothing), and leave the handler running. Until it returns it holds its slot, as a
        sync handler's stuck thread does, and what it returns is not recorded."""
        job = running.job
        if running.task is None or running.task.done() or running.superseded \
                or self._slots.running.get(job.id) is not running:
            return
        cause = running.ctx.cancellation
        log.warning("job %s: its async handler (%s) went on for %.0fs after its cancellation "
                    "(%s): it caught the CancelledError; the attempt is recorded now and the "
                    "handler left running, holding its slot until it returns", job.id,
                    job.task, CANCEL_GRACE, cause[1] if cause else "cancelled")
        running.superseded = running.abandoned = True
        del self._slots.running[job.id]
        self._slots.stuck_threads += 1
        outcome = decide(job, self._tasks.get(job.task), cancelled=cause,
                         unknown_task_grace=self._unknown_task_grace)
        if outcome is None:
            self._leases.remove(job.id, job.lease_version)
            return
        if running.ctx.reported is not None:
            outcome = dataclasses.replace(outcome, progress=running.ctx.reported)
        self._completer.submit(outcome)

    def shut_down(self) -> None:
        """Take every running job from its handler: the worker is shutting down."""
        for r in list(self._slots.running.values()):
            r.ctx.cancel("worker shutting down", "shutdown")
            if r.task is not None:
                r.task.cancel()

    # --- running -------------------------------------------------------------------------

    async def _execute(self, running: Running) -> None:
        job, ctx = running.job, running.ctx
        set_current(ctx)
        task = self._tasks.get(job.task)
        outcome: Outcome | None
        error: BaseException | None = None
        recorded = False  # transaction="complete": recorded inside the handler's transaction
        started = time.monotonic()
        try:
            if task is None:
                self._warn_unknown(job)
                raise LookupError(job.task)  # decide() says what becomes of the job
            if job.args is not None:
                result = await self._call(running, task, job.args)
            else:
                async with self._large_args:  # bounds the memory that big payloads take
                    result = await self._call(running, task, await self._load_args(job))
            ran = time.monotonic() - started
            if task.transaction == "complete":
                outcome, recorded = None, True
                self._report.recorded(Outcome(job.id, job.lease_version, job.queue, "complete",
                                              job=job, ran=ran),
                                      "succeeded" if result else None)
            else:
                outcome = decide(job, task, result=result, cancelled=ctx.cancellation, ran=ran)
        except Snooze as exc:
            outcome = decide(job, task, error=exc, ran=time.monotonic() - started)
        except BaseException as exc:
            # ours (lease lost, cancel requested, timeout, shutdown) or the handler's own,
            # whatever its class (SystemExit, KeyboardInterrupt, GeneratorExit, a library's
            # own BaseException): a handler never ends the worker, nor leaves its job running
            error = exc
            called = task is not None and not isinstance(exc, ArgumentsError)
            outcome = decide(job, task, error=exc, cancelled=ctx.cancellation,
                             unknown_task_grace=self._unknown_task_grace,
                             ran=time.monotonic() - started if called else None)
        finally:
            if task is not None:
                self._slots.ran(time.monotonic() - started)  # the adaptive prefetch's input
            if running.superseded:  # see buffer()
                self._slots.stuck_threads -= 1
            elif self._slots.running.get(job.id) is running:
                del self._slots.running[job.id]
            self.fill()  # the next buffered job takes the slot at once
            self._on_slot_freed(job.queue)
        if running.abandoned:  # its attempt was recorded then (see _abandon_if_deaf)
            return
        if outcome is not None:
            if ctx.reported is not None:
                outcome = dataclasses.replace(outcome, progress=ctx.reported)
            self._completer.submit(outcome)
            return
        self._leases.remove(job.id, job.lease_version)
        if not recorded:  # the lease was lost: nothing may be written
            self._report.lost(job, time.monotonic() - started, error)

    def _warn_unknown(self, job: Job) -> None:
        """Log a job of a task this worker does not know: at most once a minute per task."""
        now = time.monotonic()
        if now - self._unknown_warned.get(job.task, -UNKNOWN_WARN_EVERY) >= UNKNOWN_WARN_EVERY:
            self._unknown_warned[job.task] = now
            log.warning("job %s: unknown task %r (not registered in this worker's app); "
                        "released for a worker that knows it (said at most once a minute "
                        "per task)", job.id, job.task)

    async def _call(self, running: Running, task: Task, args: dict[str, Any]) -> Any:
        """Run the handler within the task's timeout (see ``_call_now``).

        Raises:
            ArgumentsError: the args do not fit the handler's signature (it is not called).
        """
        problem = task.arguments.mismatch(args) if task.arguments is not None else None
        if problem is not None:
            raise ArgumentsError(problem)
        if task.timeout is None:
            return await self._call_now(running, task, args)

        def expire() -> None:
            # the cause is set before the handler is cancelled, so that what runs as it
            # unwinds (a hook's context) already knows it timed out
            running.ctx.cancel(f"timed out after {task.timeout}s", "timed out")
            if running.is_async:
                self._cancel_async(running)
            elif running.task is not None:
                running.task.cancel()  # the wait for its thread (see in_thread)

        timer = asyncio.get_running_loop().call_later(task.timeout, expire)
        try:
            return await self._call_now(running, task, args)
        finally:
            timer.cancel()

    async def _call_now(self, running: Running, task: Task, args: dict[str, Any]) -> Any:
        """Run the handler; for transaction="complete" tasks, return whether the completion
        committed, else the handler's result."""
        ctx = running.ctx
        fn = self._hooks.wrap(ctx.job, task.fn, running.is_async) if self._hooks.on_run \
            else task.fn
        if task.transaction == "complete":
            q = self._db.queries
            finishing = functools.partial(self._leases.finishing, ctx.job.id,
                                          ctx.job.lease_version)
            if running.is_async:
                if self._async_transactions is not None:
                    async with self._async_transactions() as aconn:
                        await aconn.execute(LIFT_IDLE_TIMEOUT_LOCAL)  # begins it too
                        return await run_complete_async(aconn, q.RECORD_OUTCOMES, ctx, fn,
                                                        args, finishing, q.DB_NOW)
                assert self._apool is not None
                async with self._apool.connection() as aconn:
                    return await run_complete_async(aconn, q.RECORD_OUTCOMES, ctx, fn, args,
                                                    finishing, q.DB_NOW)
            pool, source = self.pool, self._transactions
            assert pool is not None

            def complete() -> bool:
                if source is not None:
                    with source() as conn:
                        conn.execute(LIFT_IDLE_TIMEOUT_LOCAL)  # and begins the transaction
                        # the job's block is then a savepoint of the application's
                        # transaction, committed when the source's block ends
                        return run_complete(conn, q.RECORD_OUTCOMES, ctx, fn, args,
                                            finishing, q.DB_NOW)
                with pool.connection() as conn:
                    return run_complete(conn, q.RECORD_OUTCOMES, ctx, fn, args, finishing,
                                        q.DB_NOW)

            return await self.in_thread(complete)
        if running.is_async:
            return await fn(**args)
        return await self.in_thread(functools.partial(fn, **args))

    async def in_thread(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the handler pool. If the wait is cancelled (timeout, lost lease,
        shutdown) while the thread still runs, that thread holds its slot as a stuck thread
        until it returns, so the worker never claims jobs that would only wait for a
        thread."""
        future = self._threads.submit(contextvars.copy_context().run, _boxed, fn)
        try:
            ok, value = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.done():
                self._slots.stuck_threads += 1
                loop = asyncio.get_running_loop()

                def freed(_: object) -> None:
                    try:
                        loop.call_soon_threadsafe(self._thread_freed)
                    except RuntimeError:  # the loop is closed: the worker has stopped
                        pass

                future.add_done_callback(freed)
            raise
        if not ok:
            raise value  # the handler's own exception, with its traceback
        return value

    def _thread_freed(self) -> None:
        self._slots.stuck_threads -= 1
        self.fill()
        self._on_slot_freed(None)

    async def _load_args(self, job: Job) -> dict[str, Any]:
        async with await self._db.connect_async() as conn:
            cur = await conn.execute(self._db.queries.LOAD_ARGS,
                                     {"id": job.id, "lease_version": job.lease_version})
            row = await cur.fetchone()
        if row is None:
            raise asyncio.CancelledError("lease lost before the args were loaded")
        args: dict[str, Any] = row[0]
        return args


def _no_idle_timeout(conn: psycopg.Connection[Any]) -> None:
    """A new connection of the handlers' pool lifts the role's idle transaction timeout
    (see ``LIFT_IDLE_TIMEOUT`` in ``skipjack.sql.claim``) and reads JSON as the
    worker's own connections do (``skipjack.db.use_json_text_loader``)."""
    use_json_text_loader(conn)
    conn.execute(LIFT_IDLE_TIMEOUT)


async def _no_idle_timeout_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """``_no_idle_timeout`` for the async pool."""
    use_json_text_loader(conn)
    await conn.execute(LIFT_IDLE_TIMEOUT)


ENDED = ("the handler ended the job's transaction itself (a COMMIT or ROLLBACK on "
         "current_job().conn); skipjack alone may commit or roll it back")
ABORTED = ("a statement of the handler failed and it went on, so the job's transaction was "
           "aborted and none of its writes are kept; let the error propagate, or run the "
           "statement in a savepoint (with conn.transaction(): ...)")


def check_handler_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
                              started: datetime | None = None,
                              now: datetime | None = None) -> None:
    """After a handler returned: raise if it ended or aborted the transaction it was given.

    Args:
        conn: the connection of the job's transaction.
        started, now: that transaction's ``now()`` when the job started and after the
            handler returned; they differ when the handler ended it and began another
            (COMMIT then BEGIN).

    Raises:
        HandlerTransactionError: ``conn`` is no longer in that transaction (the handler sent
            COMMIT or ROLLBACK), or its transaction is aborted (a failed statement the
            handler went on from).
    """
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise HandlerTransactionError(ABORTED)
    if status == TransactionStatus.IDLE or (started is not None and now != started):
        raise HandlerTransactionError(ENDED)


def transaction_now(conn: psycopg.Connection[Any], q: bytes) -> datetime | None:
    """``now()`` of ``conn``'s transaction, or None when it is not in a healthy one."""
    if conn.info.transaction_status != TransactionStatus.INTRANS:
        return None
    row = conn.execute(q).fetchone()
    return row[0] if row else None


async def transaction_now_async(conn: psycopg.AsyncConnection[Any],
                                 q: bytes) -> datetime | None:
    """``transaction_now`` on an async connection."""
    if conn.info.transaction_status != TransactionStatus.INTRANS:
        return None
    row = await (await conn.execute(q)).fetchone()
    return row[0] if row else None


def _completion(ctx: JobContext, result: Any) -> dict[str, str | int]:
    job = ctx.job
    return outcome_params([Outcome(job.id, job.lease_version, job.queue, "complete",
                                   result=dump_result(result), progress=ctx.reported)])


def run_complete(conn: psycopg.Connection[Any], record: bytes, ctx: JobContext,
                 fn: Callable[..., Any], args: dict[str, Any],
                 finishing: Callable[[], None], now_query: bytes) -> bool:
    """Run a sync handler and its fenced completion (the statement ``record``) in one
    transaction on ``conn``; ``now_query`` reads the transaction's ``now()`` before and after
    the handler, to tell a transaction it ended and began again.

    ``finishing`` is called once the handler returned, before the completion is written
    (the heartbeat then stops treating a vanished lease as lost).

    Returns:
        True if the completion committed; False if it was stale (all rolled back).

    Raises:
        HandlerTransactionError: the handler ended or aborted the transaction.
        Exception: whatever the handler raised (its writes rolled back), or a database error.
    """
    applied = False
    with conn.transaction():
        started = transaction_now(conn, now_query)
        ctx.conn = conn
        try:
            result = fn(**args)
        finally:
            ctx.conn = None
        check_handler_transaction(conn, started, transaction_now(conn, now_query))
        finishing()
        applied = bool(conn.execute(record, _completion(ctx, result)).fetchall())
        if not applied:
            raise psycopg.Rollback()
    return applied


async def run_complete_async(conn: psycopg.AsyncConnection[Any], record: bytes,
                             ctx: JobContext, fn: Callable[..., Any], args: dict[str, Any],
                             finishing: Callable[[], None], now_query: bytes) -> bool:
    """``run_complete`` for an async handler on an async connection."""
    applied = False
    async with conn.transaction():
        started = await transaction_now_async(conn, now_query)
        ctx.conn = conn
        try:
            result = await fn(**args)
        finally:
            ctx.conn = None
        check_handler_transaction(conn, started, await transaction_now_async(conn, now_query))
        finishing()
        cur = await conn.execute(record, _completion(ctx, result))
        applied = bool(await cur.fetchall())
        if not applied:
            raise psycopg.Rollback()
    return applied
