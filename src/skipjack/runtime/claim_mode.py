"""Jobs of ``transaction="claim"`` tasks: claimed and run in one open transaction.

A runner claims one job in a transaction, runs its (sync) handler in a thread with
``current_job().conn`` on that transaction (the handler's writes in a savepoint, so a failed
handler's writes roll back), records the outcome in the same transaction and commits. A crashed
worker's job is free again at once: PostgreSQL rolls the claim back, with no rescue. The
lease bounds the handler instead: past its job's lease the worker ends the claim's session
(the server rolls the claim back) and counts the attempt as timed out, so that the job is
retried after its backoff and its attempts run out, rather than being claimed again at once,
with no attempt counted, while the handler's thread still runs. No claim takes the job
between the claim's end and that count (see ``END_OVERDUE_CLAIM`` in
``skipjack.sql.claim``). The server's timeouts of the claim's transaction (idle in it, one
statement, from PostgreSQL 17 on the whole transaction) are the job's lease plus
``SERVER_TIMEOUT_MARGIN``, set by the claim statement itself, so the server ends the
transaction of a worker that stalled, and cancels a statement left running by a worker that
was killed.

Runners grow with the work: each claim that finds a job starts one more runner while slots
are free, and a runner ends when its queue has no job for it. While every slot is busy, a
queue with no runner gets one that waits for the next slot to free (the buffered jobs wait
behind it), so claim-mode jobs are not held back by a backlog of others. The other way
round, the producer claims other jobs for the slots runners hold (``Slots.room``); while
such jobs wait, a runner gives its slot back after a job if runners hold more slots than the
running jobs, or starts one more runner (which takes the next slot to free) if they hold
fewer, so a steady stream of claim-mode jobs does not hold back the worker's other queues,
nor the other way round: with backlogs of both, each has about half of the slots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from ..app import Task
from ..context import Job, JobContext, current_job, set_current
from ..db import Database, connection_lost
from ..errors import ArgumentsError, HandlerTransactionError
from ..hooks import Hooks
from ..outcome import DEFAULT_BACKOFF, Outcome, decide, outcome_params
from ..sql.arrays import number_array
from ..sql.claim import LOST_CLAIM_LOCK_TIMEOUT, claim_lock_key
from .executor import ENDED, Executor, check_handler_transaction, transaction_now
from .heartbeat import Leases
from .report import Reporter, WorkerStats
from .skips import SkipList
from .slots import Slots

log = logging.getLogger("skipjack.worker")

# Seconds by which the server's timeouts of a claim-mode transaction follow the lease, at
# which a worker that is not stalled ends the claim itself (and counts the attempt); a
# claim the server ends first is undone with no attempt counted. A worker whose handler
# threads keep the GIL busy is slow to do so: one worker of concurrency 8, 16 jobs of a 1 s
# lease each running 3 s of pure-Python CPU work (PostgreSQL 15): with a 1 s margin the
# server ended 87 claims and the worker 8, and 33 (job, attempt) pairs started more than
# once; with 3 s, 1 and 48, none twice; with 5 s, 0 and 48.
SERVER_TIMEOUT_MARGIN = 5.0
# Seconds a handler thread whose claim was ended at its lease waits for the attempt's count.
OVERDUE_COUNT_WAIT = 10.0
# CLAIM_IN_TRANSACTION's column of the session's process id, after the job's columns
_PID_COLUMN = len(dataclasses.fields(Job))
# Seconds the worker waits for its session to queue for an overdue job's claim lock.
LOCK_QUEUE_WAIT = 5.0

# (queue, most jobs, claim-mode claim?) -> the claim statement's bind values
ClaimParams = Callable[[str, int, bool], dict[str, Any]]


class _Skipped(Exception):
    """A claim-mode claim failed on one job, now skipped: claim again."""


class _Refused(Exception):
    """The database refused the outcome of a handler that succeeded (``error``)."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__()
        self.error = error


def _with_progress(outcome: Outcome | None) -> Outcome:
    """``outcome`` (never None here: no cancellation ends a claim-mode handler) with the
    progress its handler reported, written with it (the claim is unseen by others until
    then)."""
    assert outcome is not None
    reported = current_job().reported
    return outcome if reported is None else dataclasses.replace(outcome, progress=reported)


# What a runner reports of one claim: the outcome, the job's new state and its run_at (None
# when nothing was written).
Recorded = tuple[Outcome | None, str | None, datetime | None]


def _undone(job: Job, outcome: Outcome) -> dict[str, Any]:
    """COUNT_UNDONE_ATTEMPT's bind values: count the failed attempt of ``job`` whose claim
    was undone, with the error and retry delay of ``outcome``."""
    return {"id": job.id, "attempt": job.attempt, "delay": outcome.delay,
            "error": outcome.error}


def _state(rows: list[Any]) -> tuple[str | None, datetime | None]:
    """(state, run_at) of the first row an outcome statement returned, or (None, None)."""
    return (rows[0][1], rows[0][2]) if rows else (None, None)


class _Overdue:
    """The watch on one claim-mode job's lease (armed on the event loop at the claim).

    Either the handler's thread reaches its commit first (``finishing``) or the lease runs
    out first (``fire``), never both: a claim is never ended once its commit may have begun,
    nor committed once its end has begun."""

    def __init__(self, job: Job, task: Task, pid: int, lease: float) -> None:
        self.job, self.task, self.pid, self.lease = job, task, pid, lease
        self.timer: asyncio.TimerHandle | None = None
        self._lock = threading.Lock()
        self._finishing = False
        self.fired = False  # the lease ran out: the claim's session is being ended
        self.counted = threading.Event()  # the end and the attempt's count were tried
        self.recorded: Recorded = (None, None, None)

    def fire(self) -> bool:
        """The lease ran out (on the event loop): whether the claim is to be ended."""
        with self._lock:
            self.fired = not self._finishing
            return self.fired

    def unfire(self) -> None:
        """The claim's transaction had ended before its lease ran out (its handler
        committed or rolled it back itself): nothing to end."""
        with self._lock:
            self.fired = False

    def finishing(self) -> bool:
        """The handler's thread is about to commit: whether it may (the lease has not run
        out, or the claim's transaction had ended already)."""
        with self._lock:
            self._finishing = not self.fired
        return not self.ended_at_lease()

    def ended_at_lease(self) -> bool:
        """Whether the worker ended the claim at its lease (waiting for that to be done)."""
        if self.fired:
            self.counted.wait(OVERDUE_COUNT_WAIT)
        return self.fired

    def disarm(self) -> None:
        """The claim's transaction ended (called on the event loop)."""
        if self.timer is not None:
            self.timer.cancel()


class _EndedAtLease(Exception):
    """The claim's transaction was ended at its lease (``_Overdue``)."""


class ClaimModeRunners:
    """Starts and tracks the runners of claim-mode tasks.

    Args:
        db: the app's database.
        tasks: the app's task registry.
        queues: the queues this worker serves.
        slots: the shared capacity state (each runner holds a slot).
        leases: the running set the heartbeat renews (a claim-mode job joins it, renewed
            only once its handler ended the claim's transaction itself).
        executor: runs the handlers in its thread pool, on its sync connection pool.
        report: told about each outcome (written by the runners themselves).
        hooks: the app's hooks, entered around each handler call.
        stats: counters to update.
        stopping: set when the worker shuts down (no more runners start).
        claim_params: bind values of the claim statement.
        on_slot_freed: called when a runner ends.
    """

    def __init__(self, db: Database, tasks: Mapping[str, Task], queues: Sequence[str],
                 slots: Slots, leases: Leases, executor: Executor, report: Reporter,
                 hooks: Hooks, stats: WorkerStats,
                 stopping: asyncio.Event, claim_params: ClaimParams, *,
                 on_slot_freed: Callable[[], None]) -> None:
        self._db = db
        self._tasks = tasks
        self._slots = slots
        self._leases = leases
        self._executor = executor
        self._report = report
        self._hooks = hooks
        self._stats = stats
        self._stopping = stopping
        self._claim_params = claim_params
        self._on_slot_freed = on_slot_freed
        self.due = dict.fromkeys(queues, True)  # queues that may have claim-mode jobs
        self.runners: set[asyncio.Task[None]] = set()
        self.per_queue: Counter[str] = Counter()  # runners of each queue
        self._freed = asyncio.Event()  # a slot freed: a runner waiting for one may go on
        self._waiting = 0  # runners waiting for a slot (each counted in Slots.claim_mode)
        self._rejoin: set[str] = set()  # queues whose last runner gave its slot back
        self.task_names: list[str] = []
        self.task_leases: list[float | None] = []  # each task's lease (seconds), or None
        self._skipped = SkipList()  # used from the handler threads, one claim at a time each
        # the server's statement and transaction timeouts (ms, 0: none), read once
        self._server_timeouts: dict[str, int] | None = None
        self._claim_lock = claim_lock_key(db.schema)
        self._ending: set[asyncio.Task[None]] = set()  # claims being ended at their lease

    def prepare(self) -> None:
        """Read the app's claim-mode tasks (call when the worker starts)."""
        mine = [t for t in self._tasks.values() if t.transaction == "claim"]
        self.task_names = [t.name for t in mine]
        self.task_leases = [t.lease for t in mine]

    def wants_runner(self, queue: str) -> bool:
        """Whether to start a runner for ``queue`` (which may have claim-mode jobs): when a
        slot is free, or when every slot is busy and the queue has no runner (it then waits
        for the next slot; one such runner a queue, so polls do not pile them up)."""
        return self._slots.has_free_slot() or not self.per_queue[queue]

    def spawn(self, queue: str) -> None:
        """Start a runner for ``queue``; it holds a slot until it ends (one over the
        concurrency when none was free: it claims once a running job has given one up)."""
        self._slots.claim_mode += 1
        self.per_queue[queue] += 1
        runner = asyncio.create_task(self._run(queue), name=f"skipjack-claim-mode-{queue}")
        self.runners.add(runner)
        runner.add_done_callback(self.runners.discard)

    def slot_freed(self) -> None:
        """A slot freed, or the worker stops: a runner waiting for a slot looks again."""
        if self._waiting:
            self._freed.set()

    def _gives_slot_back(self) -> bool:
        """With claimed jobs waiting: whether runners hold more slots than the running jobs
        (by two or more, so that an odd concurrency does not swap a slot at every job),
        or every slot."""
        runners, jobs = self._slots.claim_mode, len(self._slots.running)
        return runners > jobs + 1 or not jobs

    def _takes_one_more(self) -> bool:
        """With claimed jobs waiting: whether runners hold fewer slots than the running jobs
        (by two or more) and no runner waits for a slot yet."""
        return self._slots.claim_mode + 1 < len(self._slots.running) and not self._waiting

    async def _wait_for_slot(self) -> None:
        """Wait until the slots in use, leaving out those of the runners waiting (this one
        among them), leave one free: then this runner's slot is within the concurrency.
        Buffered jobs start only below the concurrency, so they wait behind it."""
        self._waiting += 1
        try:
            while (self._slots.busy() - self._waiting >= self._slots.concurrency
                   and not self._stopping.is_set()):
                self._freed.clear()
                await self._freed.wait()
        finally:
            self._waiting -= 1

    def _grow(self, queue: str) -> None:
        if not self._stopping.is_set() and self._slots.has_free_slot():
            self.spawn(queue)

    async def _run(self, queue: str) -> None:
        """Claim and run jobs one at a time until the queue has none for this runner, or
        it gives its slot back to claimed jobs (``_gives_slot_back``)."""
        loop = asyncio.get_running_loop()

        def on_loop(fn: Callable[..., None], *args: Any) -> None:  # from the handler thread
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is closed: the worker has stopped
                pass

        gave_back = False
        try:
            await self._wait_for_slot()  # at once unless it started with no slot free
            while not self._stopping.is_set():
                try:
                    outcome, state, run_at = await self._executor.in_thread(
                        functools.partial(self._once, queue, on_loop))
                except _Skipped:
                    continue  # claim again, without that job
                except psycopg.Error as exc:  # the transaction rolled back: the job is free
                    log.warning("claim-mode claim on %s failed: %s", queue, str(exc).strip())
                    try:
                        await asyncio.wait_for(self._stopping.wait(), DEFAULT_BACKOFF.delay(1))
                    except TimeoutError:
                        pass
                    self.due[queue] = True
                    break
                if outcome is None:
                    break
                self._stats.claimed += 1
                self._report.recorded(outcome, state, run_at)
                if self._slots.ready:  # claimed jobs wait: share the slots with them
                    if self._gives_slot_back():
                        gave_back = self.due[queue] = True  # back in the queue's turn
                        break
                    if self._takes_one_more():
                        self.spawn(queue)  # it takes the next slot to free
        finally:
            self._slots.claim_mode -= 1
            self.per_queue[queue] -= 1
            jobs = len(self._slots.running)
            self._executor.fill()  # a buffered job may have waited for this slot
            if gave_back and not self.per_queue[queue]:
                self._rejoin.add(queue)
            if len(self._slots.running) > jobs and self._rejoin and not self._stopping.is_set():
                # a buffered job took this slot: a queue whose last runner gave its slot back
                # gets one that takes the next slot to free (at concurrency 1: turns)
                rejoining = self._rejoin.pop()
                if not self.per_queue[rejoining]:
                    self.spawn(rejoining)
            self._on_slot_freed()

    def _claimed(self, queue: str, watch: _Overdue) -> None:
        """On the event loop, after a claim: start one more runner while a slot is free, and
        arm the watch on the job's lease."""
        self._grow(queue)
        watch.timer = asyncio.get_running_loop().call_later(watch.lease, self._overdue,
                                                            watch)

    def _overdue(self, watch: _Overdue) -> None:
        """The job's lease has run out while its claim's transaction is open: end it."""
        if watch.fire():
            ending = asyncio.create_task(self._end_overdue(watch))
            self._ending.add(ending)
            ending.add_done_callback(self._ending.discard)

    async def _end_overdue(self, watch: _Overdue) -> None:
        """End the claim's session and count the attempt as timed out, if the claim's
        transaction is still open (``CLAIM_OPEN``); the handler's thread reports that count
        (``Recorded``) as its attempt's. One session queues for the job's claim lock, held by
        the claim's transaction; then another ends the claim's session. The server hands the
        lock to the waiting session as it rolls the claim back, so no claim takes the job
        before that session has counted the attempt (see ``END_OVERDUE_CLAIM`` in
        ``skipjack.sql.claim``)."""
        job, q = watch.job, self._db.queries
        outcome = decide(job, watch.task, cancelled=(
            "timed out", f"ran past its lease of {watch.lease:g}s (transaction=\"claim\"): "
                         f"its claim was ended"))
        assert outcome is not None
        watch.recorded = (outcome, None, None)  # until the count says the job's new state
        claim = {"pid": watch.pid, "claimed_at": job.attempted_at}
        try:
            checker = await self._db.connect_async()
            try:
                if not (await (await checker.execute(q.CLAIM_OPEN, claim)).fetchone() or [0])[0]:
                    watch.unfire()  # its handler committed or rolled it back itself
                    return
                ended, counted = await self._end_and_count(checker, watch, outcome)
            finally:
                await checker.close()
            if counted:
                watch.recorded = (outcome, *_state(counted))
                log.error("job %s ran past its lease of %gs: its claim's transaction was ended "
                          "and the attempt counted as timed out", job.id, watch.lease)
            else:
                log.warning("job %s ran past its lease of %gs: its claim's transaction %s; "
                            "the attempt was counted before, or the job claimed again",
                            job.id, watch.lease, "was ended" if ended else "had ended")
        except psycopg.Error as exc:
            log.warning("job %s ran past its lease of %gs; ending its claim failed: %s",
                        job.id, watch.lease, str(exc).strip())
        finally:
            watch.counted.set()

    async def _end_and_count(self, checker: psycopg.AsyncConnection[Any], watch: _Overdue,
                             outcome: Outcome) -> tuple[int, list[Any]]:
        """Queue a new session for the job's claim lock, end the claim's session from
        ``checker`` once it waits (or at once if it does not within ``LOCK_QUEUE_WAIT``),
        and count the attempt in the waiting session once it holds the lock. Returns the
        sessions ended (0 or 1) and the count's rows (none if not counted).

        Raises:
            psycopg.Error: a statement failed, or the lock was not had within
                ``OVERDUE_LOCK_TIMEOUT``.
        """
        job, q = watch.job, self._db.queries
        claim = {"pid": watch.pid, "claimed_at": job.attempted_at}
        waiter = await self._db.connect_async()
        try:
            async with waiter.transaction():
                (waiter_pid, _), = await (await waiter.execute(q.OVERDUE_LOCK_TIMEOUT)
                                          ).fetchall()
                taking = asyncio.ensure_future(waiter.execute(
                    q.TAKE_CLAIM_LOCK, {"claim_lock": self._claim_lock, "id": job.id}))
                ended = 0
                try:
                    deadline = time.monotonic() + LOCK_QUEUE_WAIT
                    waiting = {"waiter": waiter_pid}
                    while not taking.done() and time.monotonic() < deadline:
                        if (await (await checker.execute(q.CLAIM_LOCK_AWAITED,
                                                         waiting)).fetchone() or [0])[0]:
                            break
                        await asyncio.sleep(0.001)
                    if not taking.done():  # the claim's transaction holds the lock
                        ended = (await (await checker.execute(q.END_OVERDUE_CLAIM,
                                                              claim)).fetchone() or [0])[0]
                finally:
                    await taking
                counted = await (await waiter.execute(q.COUNT_UNDONE_ATTEMPT,
                                                      _undone(job, outcome))).fetchall()
        finally:
            await waiter.close()
        return ended, counted

    def _once(self, queue: str, on_loop: Callable[..., None]) -> Recorded:
        """In a handler thread: claim one job in a transaction, run it, record the outcome in
        the same transaction, commit. Returns (outcome, new state, run_at), or (None, None,
        None) when the queue had no job.

        A handler still running at its job's lease has its claim ended by the worker
        (``_end_overdue``): the statement that then fails returns that count instead.

        A claim statement the database refuses skips its job for a while (see
        ``skipjack.runtime.skips``) and raises ``_Skipped``. A transaction that
        fails after its handler ran (its outcome or its commit refused: a deferred
        constraint, a trigger) is rolled back, claim and all: the failed attempt is then
        counted on its own, so the job cannot run again and again without using attempts.

        Raises:
            psycopg.Error: the connection was lost, or a failure not of one job.
        """
        q, pool = self._db.queries, self._executor.pool
        assert pool is not None
        claimed: list[tuple[Job, Task]] = []
        watch: _Overdue | None = None
        try:
            with pool.connection() as conn, conn.transaction():
                params = {**self._claim_params(queue, 1, True), **self._timeouts(conn),
                          "claim_lock": self._claim_lock}
                if self._skipped:
                    params["skip"] = number_array(self._skipped.ids())
                row = conn.execute(q.CLAIM_IN_TRANSACTION, params).fetchone()
                if row is None:
                    return None, None, None
                job = Job.from_row(row)
                task = self._tasks[job.task]
                # the job's own lease, else its task's, else the worker's (TASK_LEASE); the
                # claim set its transaction's timeouts from it
                watch = _Overdue(job, task, row[_PID_COLUMN], job.lease)
                on_loop(self._claimed, queue, watch)
                claimed.append((job, task))
                self._skipped.claimed(job.id)
                set_current(JobContext(job, conn=conn))
                # renewed by the heartbeat once the claim is visible (its handler committed it
                # itself), so that it is not rescued while the handler still runs
                self._leases.add(job.id, job.lease_version, job.lease, uncommitted=True)
                try:
                    outcome, rows = self._run_and_record(conn, job, task)
                finally:
                    self._leases.remove(job.id, job.lease_version)
                if not watch.finishing():  # its session has been ended: no commit
                    raise _EndedAtLease()
            return (outcome, *_state(rows))
        except (psycopg.Error, _EndedAtLease) as exc:
            if watch is not None and watch.ended_at_lease():
                return watch.recorded
            assert isinstance(exc, psycopg.Error)
            if connection_lost(exc):
                counted = self._count_lost_session(*claimed[0], exc) if claimed else None
                if counted is None:
                    raise
                return counted
            if claimed:
                return self._count_failed_commit(*claimed[0], exc)
            self._skip_first_candidate(queue, exc)
            raise _Skipped() from exc
        finally:
            if watch is not None:
                on_loop(watch.disarm)

    def _timeouts(self, conn: psycopg.Connection[Any]) -> dict[str, Any]:
        """CLAIM_IN_TRANSACTION's bind values for its transaction's timeouts: the margin,
        and the server's own statement timeout (read on the first claim), above which the
        claim never raises it, since a statement it cancels fails the attempt, which is then
        counted. The transaction timeout (PostgreSQL 17 on) is set whatever the server's: a
        shorter one would end the claim of every job that runs longer with no attempt
        counted, for ever."""
        if self._server_timeouts is None:
            self._server_timeouts = dict(conn.execute(self._db.queries.SERVER_TIMEOUTS)
                                         .fetchall())
        own = self._server_timeouts
        return {"timeout_margin": SERVER_TIMEOUT_MARGIN,
                "server_statement_ms": own["statement_timeout"],
                "transaction_timeout": "transaction_timeout" in own}

    def _run_and_record(self, conn: psycopg.Connection[Any], job: Job,
                        task: Task) -> tuple[Outcome, list[Any]]:
        """Run the handler and write its outcome in one savepoint of the claim's
        transaction. A handler that fails rolls back to that savepoint (its writes with
        it); its failure is then written in a savepoint of its own. An outcome the database
        refuses (a success, or such a failure) rolls back to its savepoint, and the
        attempt's failure is written instead, with the refusal as its error, in the claim's
        transaction: the claim is kept, so the job runs no second time meanwhile. (The
        success path has one savepoint, not one for the handler inside another for its
        outcome: two round trips fewer a job.)"""
        q = self._db.queries
        started = time.monotonic()
        try:
            with conn.transaction():  # a savepoint
                result = self._handle(conn, job, task)
                outcome = _with_progress(decide(job, task, result=result,
                                                ran=time.monotonic() - started))
                try:
                    return outcome, conn.execute(q.RECORD_OUTCOMES,
                                                 outcome_params([outcome])).fetchall()
                except psycopg.Error as refusal:
                    raise _Refused(refusal) from refusal  # rolls back to the savepoint
        except _Refused as refused:
            error = refused.error
        except BaseException as exc:  # the handler failed (Snooze, SystemExit... included)
            ended = conn.info.transaction_status == TransactionStatus.IDLE
            if ended and not isinstance(exc, HandlerTransactionError):
                exc = HandlerTransactionError(f"{ENDED}; it then raised "
                                              f"{type(exc).__name__}: {exc}")
            failed = _with_progress(decide(job, task, error=exc,
                                           ran=time.monotonic() - started))
            if ended:  # no transaction of the claim's is left to write in
                return failed, self._after_ended_transaction(conn, job, failed)
            try:
                with conn.transaction():  # a refusal of it rolls back to here
                    return failed, conn.execute(q.RECORD_OUTCOMES,
                                                outcome_params([failed])).fetchall()
            except psycopg.Error as refusal:
                error = refusal
        if connection_lost(error) or conn.info.transaction_status == TransactionStatus.IDLE:
            raise error
        log.error("job %s: its outcome was refused by the database: %s", job.id,
                  str(error).strip())
        instead = decide(job, task, error=error)
        assert instead is not None  # never a cancellation here
        return instead, conn.execute(q.RECORD_OUTCOMES, outcome_params([instead])).fetchall()

    def _count_failed_commit(self, job: Job, task: Task, exc: psycopg.Error) -> Recorded:
        """The claim's transaction failed after the handler ran and rolled back: count the
        failed attempt, with the database's error, on the job it made available again."""
        outcome = decide(job, task, error=exc)
        assert outcome is not None
        log.error("job %s: its transaction could not commit: %s", job.id, str(exc).strip())
        pool = self._executor.pool
        assert pool is not None
        try:
            with pool.connection() as conn:
                rows = conn.execute(self._db.queries.COUNT_UNDONE_ATTEMPT,
                                    _undone(job, outcome)).fetchall()
        except psycopg.Error as refused:
            if connection_lost(refused):
                raise
            self._skipped.add(job.id, str(refused).strip())  # nothing of it can be written
            return outcome, None, None
        return (outcome, *_state(rows))

    def _count_lost_session(self, job: Job, task: Task, exc: psycopg.Error) -> Recorded | None:
        """The claim's session was lost while its handler ran (the handler closed or ended
        it, or the server or the network did): the server rolls the claim back. Count the
        failed attempt on another connection, with that error, so that the job neither
        comes back at once, ahead of its queue's other jobs, nor runs again and again
        without using attempts. None when it cannot be counted now (the database cannot be
        reached, or still holds the claim's row lock after ``LOST_CLAIM_LOCK_TIMEOUT``):
        the job is then free again with no attempt counted, as after a crash; and when
        there was nothing to count (the job was claimed again meanwhile: the server ended
        the claim of a stalled worker, and another worker took the job)."""
        lost = decide(job, task, error=exc)  # a release: a lost connection is no failure
        assert lost is not None
        outcome = dataclasses.replace(lost, kind="retry", delay=task.backoff.delay(job.attempt))
        pool = self._executor.pool
        assert pool is not None
        try:
            with pool.connection() as conn, conn.transaction():
                conn.execute(LOST_CLAIM_LOCK_TIMEOUT)
                rows = conn.execute(self._db.queries.COUNT_UNDONE_ATTEMPT,
                                    _undone(job, outcome)).fetchall()
        except psycopg.Error as failed:
            log.warning("job %s: its claim's session was lost (%s); its attempt could not be "
                        "counted: %s", job.id, str(exc).strip(), str(failed).strip())
            return None
        if not rows:
            return None
        log.error("job %s: its claim's session was lost while its handler ran: %s", job.id,
                  str(exc).strip())
        return (outcome, *_state(rows))

    def _skip_first_candidate(self, queue: str, exc: psycopg.Error) -> None:
        """The claim of one job (the first candidate) was refused: skip that job."""
        pool = self._executor.pool
        assert pool is not None
        params = self._claim_params(queue, 1, True)
        params["skip"] = number_array(self._skipped.ids())
        row = None
        with pool.connection() as conn, conn.transaction():
            row = conn.execute(self._db.queries.CLAIM_CANDIDATES, params).fetchone()
            raise psycopg.Rollback()  # only looked
        if row is None:
            raise exc  # not a job's fault
        self._skipped.add(row[0], str(exc).strip())

    def _handle(self, conn: psycopg.Connection[Any], job: Job, task: Task) -> Any:
        """Run the handler (in the caller's savepoint of the claim's transaction); its
        result.

        Raises:
            Exception: the handler's, or ArgumentsError (args that do not fit it), or
                HandlerTransactionError (it ended or aborted the claim's transaction).
        """
        args = job.args
        if args is None:
            loaded = conn.execute(self._db.queries.LOAD_ARGS,
                                  {"id": job.id, "lease_version": job.lease_version})
            args = (loaded.fetchone() or [{}])[0]
        problem = task.arguments.mismatch(args) if task.arguments is not None else None
        if problem is not None:
            raise ArgumentsError(problem)
        result = self._hooks.wrap(job, task.fn, False)(**args)
        # the claim's now() is attempted_at
        try:
            check_handler_transaction(conn, job.attempted_at,
                                      transaction_now(conn, self._db.queries.DB_NOW))
        except HandlerTransactionError as ended:
            if (str(ended).startswith(ENDED)
                    and conn.info.transaction_status == TransactionStatus.INTRANS):
                # one the handler began after ending the claim's: not ours to keep
                conn.execute(self._db.queries.END_HANDLER_TRANSACTION)
            raise
        return result

    def _after_ended_transaction(self, conn: psycopg.Connection[Any], job: Job,
                                 outcome: Outcome) -> list[Any]:
        """Record the failed attempt of a handler that ended the claim's transaction itself.
        After a COMMIT the claim is visible: the fenced outcome applies as in lease mode.
        After a ROLLBACK the claim is undone: the attempt is counted on the available job,
        so that such a handler cannot run forever without using attempts; if the job was
        claimed again meanwhile (the ROLLBACK made it available at once), only its error is
        added to the job."""
        q = self._db.queries
        log.error("job %s: %s", job.id, ENDED)
        rows = conn.execute(q.RECORD_OUTCOMES, outcome_params([outcome])).fetchall()
        if not rows:
            rows = conn.execute(q.COUNT_UNDONE_ATTEMPT, _undone(job, outcome)).fetchall()
        if not rows:  # claimed again since the ROLLBACK: the error is still shown on the job
            log.warning("job %s was claimed again before its failed attempt could be counted",
                        job.id)
            conn.execute(q.NOTE_ERROR, {"id": job.id, "error": outcome.error})
        return [(job.id, state, run_at) for _, state, run_at in rows]
