"""The worker: claims jobs, runs their handlers, and records outcomes, all fenced.

Pieces, each an asyncio task on one event loop unless noted:

- producer: claims up to ``batch_size`` jobs from ONE queue per statement, round-robin over
  the worker's queues, whenever a queue may have work (a NOTIFY, the poll timer, a retry
  timer, or a full previous batch) and slots are free;
- executor: one task per job; ``async def`` handlers run on the loop, sync handlers in a
  thread pool of ``concurrency`` threads;
- completer: writes outcomes in batches (all that piled up while the previous write ran) in
  one fenced statement, retrying on a fresh connection until the write lands;
- listener: LISTEN on the schema's channel with a health check, reconnecting with capped
  backoff and rescanning every queue after each (re)connect;
- heartbeat (a thread with its own connection): renews leases and runs the rescuer.

Each piece has its own connection, so handlers that exhaust the application's pool can never
starve lease renewal or completion.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from . import eventloop, transactional
from .app import Task
from .completer import (
    Completer,
    Outcome,
    WorkerStats,
    close_quietly,
    connection_lost,
    error_json,
    outcome_params,
)
from .context import Job, JobContext, set_current
from .errors import ConfigError, Discard, Snooze
from .heartbeat import Heartbeat, Leases
from .jobs import LEASE_MAX, QUEUE_MAX_BYTES, check_name, dump_result
from .listener import listen, probe
from .maintenance import Maintenance
from .queries import claim_params
from .reconnect import Backoff as ReconnectBackoff
from .retry import Backoff

if TYPE_CHECKING:
    from .app import App

log = logging.getLogger("skipjack.worker")


@dataclass
class _Running:
    job: Job
    ctx: JobContext
    task: asyncio.Task[None] | None = None
    is_async: bool = False
    superseded: bool = False  # a later claim of the same job replaced this run


@dataclass
class Worker:
    """Runs jobs from some queues of an :class:`~skipjack.App`.

    Args:
        app: the application (task registry and database).
        queues: queue names to serve; each is claimed with its own statement.
        concurrency: the most jobs running at once in this process (1..10,000).
        batch_size: the most jobs one claim takes (default: ``concurrency + prefetch``, at
            most 1,000: one claim can fill every free slot and the prefetch buffer).
        lease: seconds a claim is valid without renewal. A job whose lease expires is
            rescued (returned to the queue) by any worker.
        heartbeat: seconds between lease renewals; must be < lease / 2 so one lost renewal
            cannot let a live job's lease expire (default lease / 6, at most 10).
        poll_interval: seconds between polls of every queue, the fallback for lost
            notifications (default 5).
        rescue_interval: seconds between rescuer runs in this worker (default lease / 2, at
            most 15).
        stage_interval: seconds between stager runs, which make due scheduled jobs
            (delayed, retried) available (default 1).
        retention: seconds to keep succeeded and cancelled jobs; this worker then prunes
            older ones (default None: no pruning here).
        discarded_retention: seconds to keep discarded jobs (default 10 x retention).
        prefetch: jobs claimed ahead of free slots (default ``concurrency``, at most 100), so
            a slot that frees starts its next job at once instead of after a claim round
            trip. Their leases are renewed while they wait; they count as started (an
            attempt) and are released at shutdown. 0 claims only for free slots.
        fairness_every: every n-th claim that takes jobs from a queue (limited or not) takes
            the oldest runnable jobs whatever their priority, so no priority waits forever
            (0 disables: strict priority, where a steady stream of higher priorities starves
            lower ones).
        shutdown_grace: seconds running jobs get to finish after SIGTERM; the rest are then
            released back to their queue, their attempt not counted.
        name: the worker's name stored on claimed rows (default host:pid:random). Only for
            people: recovery never depends on it.
        inline_args_bytes: args larger than this (serialised bytes) are not fetched by the
            claim but loaded just before the handler runs, and at most
            ``large_args_concurrency`` such jobs run at once, so a batch of huge payloads
            cannot exhaust the worker's memory.

    Raises:
        ConfigError: a setting outside its range, or a heartbeat too slow for the lease.
    """

    app: App
    queues: Sequence[str]
    concurrency: int = 10
    batch_size: int | None = None
    lease: float = 30.0
    heartbeat: float | None = None
    poll_interval: float = 5.0
    rescue_interval: float | None = None
    stage_interval: float = 1.0
    retention: float | None = None
    discarded_retention: float | None = None
    fairness_every: int = 10
    prefetch: int | None = None
    shutdown_grace: float = 30.0
    name: str = ""
    listen_health_interval: float = 10.0
    inline_args_bytes: int = 256 * 1024
    large_args_concurrency: int = 4
    stats: WorkerStats = field(default_factory=WorkerStats)

    def __post_init__(self) -> None:
        if isinstance(self.queues, str) or not self.queues:
            raise ConfigError("queues: give a non-empty list of queue names")
        self._queues = [check_name("queue", q, QUEUE_MAX_BYTES) for q in dict.fromkeys(self.queues)]
        self.queues = tuple(self._queues)
        if not 1 <= self.concurrency <= 10_000:
            raise ConfigError(f"concurrency: {self.concurrency} is out of range 1..10000")
        if self.prefetch is None:
            self.prefetch = min(self.concurrency, 100)
        if self.batch_size is None:
            self.batch_size = min(self.concurrency + self.prefetch, 1000)
        if not 0 <= self.prefetch <= 10_000:
            raise ConfigError(f"prefetch: {self.prefetch} is out of range 0..10000")
        if not 1 <= self.batch_size <= 10_000:
            raise ConfigError(f"batch_size: {self.batch_size} is out of range 1..10000")
        if not 0 < self.lease <= LEASE_MAX:
            raise ConfigError(f"lease: {self.lease} seconds is out of range 0..{LEASE_MAX:.0f}")
        if self.heartbeat is None:
            self.heartbeat = min(self.lease / 6, 10.0)
        if not 0 < self.heartbeat < self.lease / 2:
            raise ConfigError(
                f"heartbeat: {self.heartbeat}s cannot keep a {self.lease}s lease alive; "
                f"it must be > 0 and < lease / 2 = {self.lease / 2}s"
            )
        if self.rescue_interval is None:
            self.rescue_interval = min(self.lease / 2, 15.0)
        for name in ("poll_interval", "rescue_interval", "listen_health_interval",
                     "stage_interval"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0 seconds, got {getattr(self, name)}")
        if self.shutdown_grace < 0:
            raise ConfigError(f"shutdown_grace: must be >= 0 seconds, got {self.shutdown_grace}")
        self.name = self.name or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._leases = Leases()
        self._running: dict[int, _Running] = {}
        self._ready: dict[int, Job] = {}  # claimed, waiting for a slot (insertion order)
        self._due = dict.fromkeys(self._queues, True)
        self._held_due = dict.fromkeys(self._queues, True)
        self._held_busy = 0
        self._stuck_threads = 0
        self._claims_paused = False  # too many outcomes wait to be written (see _room)
        self._held_runners: set[asyncio.Task[None]] = set()
        self._held_names: list[str] = []
        self._controlled: set[str] = set()
        self._claims = dict.fromkeys(self._queues, 0)
        self._held_timeout_ms = 0
        self._default_backoff = Backoff()
        self._stop_requested = False
        self._first_signal = 0.0
        self._pool: ConnectionPool[psycopg.Connection[Any]] | None = None
        self._apool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def run(self) -> None:
        """Run until SIGTERM or SIGINT, then shut down gracefully. A second signal exits at
        once with status 1 (the jobs' leases then expire and the rescuer returns them).

        Unlike ``asyncio.run``, it does not wait for handlers that ignored cancellation (their
        jobs were already released); the interpreter still waits for such sync handlers'
        threads at exit (a warning says so), unless the process ends with ``os._exit``. Its
        event loop's timers fire on time (see :mod:`skipjack.eventloop`)."""
        loop = eventloop.new_event_loop()
        try:
            loop.run_until_complete(self._run_with_signals())
        finally:
            loop.close()

    async def _run_with_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        await self.run_async()

    def _on_signal(self, sig: int) -> None:
        if self._stop_requested:
            if time.monotonic() - self._first_signal < 1.0:
                return  # the same stop sent twice (e.g. to the process group): not a second
            log.warning("second %s: exiting now", signal.Signals(sig).name)
            os._exit(1)
        self._first_signal = time.monotonic()
        log.info("%s: stopping (grace %.1fs)", signal.Signals(sig).name, self.shutdown_grace)
        self.stop()

    def stop(self) -> None:
        """Ask the worker to stop claiming and shut down (thread-safe)."""
        loop = getattr(self, "_loop", None)
        if loop is None:
            self._stop_requested = True
        else:
            loop.call_soon_threadsafe(self._request_stop)

    def _request_stop(self) -> None:
        self._stop_requested = True
        self._stopping.set()
        self._wakeup.set()

    async def run_async(self) -> None:
        """Run on the current event loop until :meth:`stop` is called.

        Database errors never end it: every component reconnects with capped backoff.

        Raises:
            SchemaVersionError: the schema is missing or of another version.
            ConfigError: a task's lease is too short for the heartbeat.
            Exception: a worker component failed on a bug (after a graceful shutdown), so a
                supervisor sees a non-zero exit instead of a worker that silently idles.
        """
        self._check_task_leases()
        held = [t for t in self.app.tasks.values() if t.transaction == "claim"]
        self._held_names = [t.name for t in held]
        self._held_timeout_ms = int(1000 * max([t.lease or self.lease for t in held], default=0))
        await asyncio.to_thread(self.app.check_schema)
        await probe(self.app)
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._stopping = asyncio.Event()
        self._completer = Completer(self.app, self._leases, self.stats,
                                    more_coming=lambda: bool(self._running),
                                    on_written=self._wakeup.set)
        self._large_args = asyncio.Semaphore(self.large_args_concurrency)
        await self._open_pools()
        if self._stop_requested:
            self._stopping.set()
        self._threads = ThreadPoolExecutor(self.concurrency, thread_name_prefix="skipjack-job")
        dsn = self.app.dsn
        heartbeat = Heartbeat(
            lambda: self.app.connect(),
            self.app.queries,
            self._leases,
            lease=self.lease,
            interval=self.heartbeat or 1.0,
            on_lost=self._threadsafe(self._lease_lost),
            on_cancel=self._threadsafe(self._cancel_requested),
        )
        maintenance = Maintenance(
            self.app, stage_interval=self.stage_interval,
            rescue_interval=self.rescue_interval or 1.0, retention=self.retention,
            discarded_retention=self.discarded_retention,
            on_staged=self._threadsafe(self._mark_due))
        heartbeat.start()
        maintenance.start()
        log.info("worker %s serving %s (concurrency %d) on %s", self.name,
                 ", ".join(self.queues), self.concurrency, _safe_dsn(dsn))
        task_queues = sorted({t.queue for t in self.app.tasks.values()})
        if self.queues == ("default",) and task_queues and "default" not in task_queues:
            log.warning("serving only the queue 'default', which no task of this app has as its "
                        "queue (they have %s): name them with --queue", ", ".join(task_queues))
        producer = asyncio.create_task(self._produce(), name="skipjack-producer")
        helpers = [asyncio.create_task(listen(self.app, self._mark_due, self._mark_all_due,
                                              self.listen_health_interval),
                                       name="skipjack-listener"),
                   asyncio.create_task(self._completer.run(), name="skipjack-completer")]
        stopping = asyncio.create_task(self._stopping.wait())
        failure: BaseException | None = None
        try:
            done, _ = await asyncio.wait([producer, stopping, *helpers],
                                         return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopping and not (t is producer and self._stopping.is_set()
                                              and not t.exception()):
                    # components only end by failing: never stop silently
                    failure = t.exception() or RuntimeError(f"{t.get_name()} ended")
                    log.error("worker component %s failed; shutting down", t.get_name(),
                              exc_info=failure)
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
            await self._drain()
        finally:
            stopping.cancel()
            for t in helpers:
                t.cancel()
            await asyncio.gather(*helpers, stopping, return_exceptions=True)
            heartbeat.stop()
            maintenance.stop()
            self._threads.shutdown(wait=False, cancel_futures=True)
            if self._stuck_threads:
                log.warning("%d sync handler threads are still running (their jobs were "
                            "released); Python waits for them before this process exits "
                            "(os._exit stops at once, as the skipjack CLI does)",
                            self._stuck_threads)
            if self._apool is not None:
                await self._apool.close()
            if self._pool is not None:
                await asyncio.to_thread(self._pool.close)
            log.info("worker %s stopped: %s", self.name, self.stats)
        if failure is not None:
            raise failure

    async def _open_pools(self) -> None:
        """Connections for handlers that run in a transaction of their own, if any."""
        atomic = [t for t in self.app.tasks.values() if t.transaction != "none"]
        if any(not inspect.iscoroutinefunction(t.fn) for t in atomic):
            self._pool = ConnectionPool(self.app.dsn, min_size=0, max_size=self.concurrency,
                                        kwargs=self.app.connect_kwargs, open=False)
            await asyncio.to_thread(self._pool.open)
        if any(inspect.iscoroutinefunction(t.fn) for t in atomic):
            self._apool = AsyncConnectionPool(self.app.dsn, min_size=0,
                                              max_size=self.concurrency,
                                              kwargs=self.app.connect_kwargs, open=False)
            await self._apool.open()

    def _check_task_leases(self) -> None:
        for task in self.app.tasks.values():
            if task.lease is not None and not task.lease > 2 * (self.heartbeat or 0):
                raise ConfigError(
                    f"task {task.name!r}: lease {task.lease}s cannot be kept alive by a "
                    f"{self.heartbeat}s heartbeat; it must be > 2 x heartbeat"
                )

    async def _drain(self) -> None:
        """Release buffered jobs, let running ones finish within the grace period, release
        the rest, flush the outcomes."""
        for job in self._ready.values():
            self._completer.submit(Outcome(job.id, job.lease_version, job.queue, "release"))
        self._ready.clear()
        if self._busy():
            log.info("waiting up to %.1fs for %d running jobs", self.shutdown_grace,
                     self._busy())
            tasks = [r.task for r in self._running.values() if r.task is not None]
            tasks += self._held_runners
            await asyncio.wait(tasks, timeout=self.shutdown_grace)
            for r in list(self._running.values()):
                r.ctx.cancel("worker shutting down")
                if r.task is not None:
                    r.task.cancel()
            for runner in self._held_runners:  # the process exit rolls their claims back
                runner.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
            for r in list(self._running.values()):  # a handler that ignores cancellation
                log.warning("job %s ignored cancellation; releasing it", r.job.id)
                self._running.pop(r.job.id, None)
                self._completer.submit(Outcome(r.job.id, r.job.lease_version, r.job.queue,
                                               "release"))
        try:
            await asyncio.wait_for(self._completer.flush(), timeout=max(self.shutdown_grace, 5.0))
        except TimeoutError:
            log.error("could not record %d outcomes before exit; their leases will expire "
                      "and the rescuer will return the jobs", len(self._completer))

    # --- producer ------------------------------------------------------------------------

    def _mark_due(self, queue: str) -> None:
        if queue in self._due:
            self._due[queue] = self._held_due[queue] = True
            self._wakeup.set()

    def _mark_all_due(self) -> None:
        for q in self._due:
            self._due[q] = self._held_due[q] = True
        self._wakeup.set()

    def _max_unwritten(self) -> int:
        """Outcomes waiting to be written past which the worker claims nothing more: ten
        claims' worth (at least 1,000), far above what piles up while one write runs, so
        only a stalled completer reaches it. It bounds the finished jobs that a crash during
        such a stall would run again."""
        return max(1000, 10 * (self.concurrency + (self.prefetch or 0)))

    def _busy(self) -> int:
        """Slots in use: jobs executing now, and threads still running abandoned handlers."""
        return len(self._running) + self._held_busy + self._stuck_threads

    def _room(self) -> int:
        """How many more jobs the producer should claim now: the free slots plus the
        prefetch buffer's free places, but nothing while the buffer is over half full (so
        claims come in batches rather than one job per finished job), nor while more
        outcomes wait to be written than :meth:`_max_unwritten` (the database is not taking
        them: a row lock held elsewhere, a slow disk)."""
        unwritten = len(self._completer)
        if unwritten >= self._max_unwritten():
            if not self._claims_paused:
                self._claims_paused = True
                log.warning("%d outcomes wait to be written; claiming paused until they are",
                            unwritten)
            return 0
        if self._claims_paused:
            self._claims_paused = False
            log.info("outcomes written; claiming again")
        prefetch = self.prefetch or 0
        if self._ready and len(self._ready) > prefetch // 2:
            return 0
        return self.concurrency + prefetch - self._busy() - len(self._ready)

    def _claim_params(self, queue: str, limit: int, held: bool) -> dict[str, Any]:
        return claim_params(queue, limit, lease=self.lease, worker=self.name,
                            min_lease=3 * (self.heartbeat or 0),
                            inline_bytes=self.inline_args_bytes,
                            held_tasks=self._held_names, held=held)

    async def _produce(self) -> None:
        loop = asyncio.get_running_loop()
        conn: psycopg.AsyncConnection[Any] | None = None
        backoff = ReconnectBackoff()
        next_poll = loop.time() + self.poll_interval
        start = 0
        refresh = True
        try:
            while not self._stopping.is_set():
                if loop.time() >= next_poll:
                    self._mark_all_due()
                    next_poll = loop.time() + self.poll_interval
                    refresh = True  # re-read which queues are limited
                self._wakeup.clear()
                order = self._queues[start:] + self._queues[:start]
                start = (start + 1) % len(self._queues)
                sharing = max(1, sum(self._due.values()))  # queues wanting work now
                for queue in order:
                    free = self._room()
                    if free <= 0 or self._stopping.is_set():
                        break
                    if self._held_names and self._held_due[queue]:
                        self._held_due[queue] = False
                        self._spawn_held(queue)  # it spawns another each time it finds a job
                        continue
                    if not self._due[queue]:
                        continue
                    # each due queue gets its share of the room, so a deep queue cannot fill
                    # the prefetch buffer ahead of a shallow one (FC-20)
                    want = min(free, self.batch_size or free, max(1, -(-free // sharing)))
                    try:
                        if conn is None or conn.closed:
                            conn = await self.app.connect_async()
                            await conn.execute(self.app.queries.ASYNC_CLAIMS)
                        if refresh:
                            cur = await conn.execute(self.app.queries.CONTROLLED_QUEUES)
                            self._controlled = {r[0] for r in await cur.fetchall()}
                            refresh = False
                        rows = await self._claim(conn, queue, want)
                        backoff.reset()
                    except psycopg.Error as exc:
                        await close_quietly(conn)
                        conn = None
                        delay = backoff.next()
                        log.warning("claim failed: %s (retrying in %.1fs)", str(exc).strip(), delay)
                        await _sleep_unless(self._stopping, delay)
                        self._mark_all_due()  # rescan after reconnecting
                        break
                    if len(rows) < want:
                        self._due[queue] = False
                        if queue in self._controlled:  # a limit may lift soon (rate window)
                            self._loop.call_later(0.5, self._mark_due, queue)
                    for row in rows:
                        self._buffer(Job(*row))
                    self._fill()
                free = self._room()
                if (free > 0 and any(self._due.values())) or self._stopping.is_set():
                    continue
                try:
                    await asyncio.wait_for(self._wakeup.wait(), max(0.0, next_poll - loop.time()))
                except TimeoutError:
                    pass
        finally:
            await close_quietly(conn)

    # --- claims held in an open transaction (Task.transaction == "claim") -----------------

    def _spawn_held(self, queue: str) -> None:
        self._held_busy += 1
        runner = asyncio.create_task(self._held_runner(queue), name=f"skipjack-held-{queue}")
        self._held_runners.add(runner)
        runner.add_done_callback(self._held_runners.discard)

    def _grow_held(self, queue: str) -> None:
        if not self._stopping.is_set() and self._busy() < self.concurrency:
            self._spawn_held(queue)

    async def _held_runner(self, queue: str) -> None:
        """Claim and run jobs one at a time in held transactions until the queue has none.
        Each claim that finds a job starts one more runner while slots are free, so the
        runners grow with the work instead of polling with empty transactions."""
        grow = self._threadsafe(self._grow_held)
        try:
            while not self._stopping.is_set():
                try:
                    outcome, state = await self._in_thread(
                        functools.partial(self._held_once, queue, grow))
                except psycopg.Error as exc:  # the transaction rolled back: the job is free
                    log.warning("held claim on %s failed: %s", queue, str(exc).strip())
                    await _sleep_unless(self._stopping, self._default_backoff.delay(1))
                    self._held_due[queue] = True
                    break
                if outcome is None:
                    break
                self.stats.claimed += 1
                self._completer.count(outcome, state)
        finally:
            self._held_busy -= 1
            self._fill()  # a buffered job may have waited for this slot
            self._wakeup.set()

    def _held_once(self, queue: str,
                   on_claimed: Callable[[str], None]) -> tuple[Outcome | None, str | None]:
        """In a handler thread: claim one job in a transaction, run it, record the outcome in
        the same transaction, commit. Returns (outcome, new state), or (None, None)."""
        q, pool = self.app.queries, self._pool
        assert pool is not None
        with pool.connection() as conn, conn.transaction():
            conn.execute(q.SET_IDLE_TIMEOUT, {"ms": self._held_timeout_ms})
            row = conn.execute(q.CLAIM_HELD, self._claim_params(queue, 1, held=True)).fetchone()
            if row is None:
                return None, None
            on_claimed(queue)
            job = Job(*row)
            task = self.app.tasks[job.task]
            ctx = JobContext(job, conn=conn)
            set_current(ctx)
            try:
                args = job.args
                if args is None:
                    loaded = conn.execute(q.LOAD_ARGS, {"id": job.id,
                                                        "lease_version": job.lease_version})
                    args = (loaded.fetchone() or [{}])[0]
                with conn.transaction():  # a savepoint: a failed handler's writes roll back
                    result = task.fn(**args)
                outcome = Outcome(job.id, job.lease_version, job.queue, "complete",
                                  result=dump_result(result))
            except Snooze as exc:
                outcome = Outcome(job.id, job.lease_version, job.queue, "release",
                                  delay=exc.seconds)
            except Exception as exc:
                outcome = self._failure(job, task, exc)
            rows = conn.execute(q.RECORD_OUTCOMES, outcome_params([outcome])).fetchall()
        return outcome, rows[0][1] if rows else None

    # --- lease-mode execution -------------------------------------------------------------

    async def _claim(self, conn: psycopg.AsyncConnection[Any], queue: str,
                     want: int) -> list[Any]:
        """One claim from one queue: through the queue's lock when it is limited; every
        ``fairness_every``-th claim that takes jobs oldest-first instead of by priority."""
        q = self.app.queries
        params = self._claim_params(queue, want, held=False)
        oldest = self.fairness_every and (self._claims[queue] + 1) % self.fairness_every == 0
        if queue in self._controlled:
            async with conn.transaction():
                await conn.execute(q.LOCK_QUEUE, {"queue": queue})
                rows = await (await conn.execute(
                    q.CLAIM_LIMITED_OLDEST if oldest else q.CLAIM_LIMITED, params)).fetchall()
        else:
            rows = await (await conn.execute(q.CLAIM_OLDEST if oldest else q.CLAIM,
                                             params)).fetchall()
        if rows:  # claims that find nothing (an empty queue, a limit reached) do not count
            self._claims[queue] += 1
        return rows

    def _buffer(self, job: Job) -> None:
        """A claimed job waits here for a slot; its lease is renewed meanwhile."""
        stale = self._running.get(job.id)
        if stale is not None:
            # claimed again while it still runs here: its lease expired and it was rescued,
            # or a server crash undid its claim. The old run is cancelled and writes nothing
            # (its token is stale); until it ends it holds its slot as a stuck thread.
            self._lease_lost(job.id, stale.job.lease_version,
                             "lease lost; the job was claimed again")
            stale.superseded = True
            del self._running[job.id]
            self._stuck_threads += 1
        self.stats.claimed += 1
        self._leases.add(job.id, job.lease_version, job.lease)
        self._ready[job.id] = job

    def _fill(self) -> None:
        """Start buffered jobs while slots are free (FIFO)."""
        while self._ready and self._busy() < self.concurrency and not self._stopping.is_set():
            job_id = next(iter(self._ready))
            self._start(self._ready.pop(job_id))

    def _start(self, job: Job) -> None:
        task = self.app.tasks.get(job.task)
        running = _Running(job, JobContext(job), is_async=task is not None and task.is_async)
        self._running[job.id] = running
        running.task = self._loop.create_task(self._execute(running))

    # --- executor ------------------------------------------------------------------------

    async def _execute(self, running: _Running) -> None:
        job, ctx = running.job, running.ctx
        set_current(ctx)
        task = self.app.tasks.get(job.task)
        outcome: Outcome | None
        try:
            if task is None:
                raise LookupError(f"unknown task {job.task!r}: no handler of that name is "
                                  "registered in this worker's app")
            if job.args is not None:
                result = await self._call(running, task, job.args)
            else:
                async with self._large_args:  # bounds the memory that big payloads take
                    result = await self._call(running, task, await self._load_args(job))
            if task.transaction == "complete":
                outcome = None  # recorded inside the handler's transaction
                self._completer.count(Outcome(job.id, job.lease_version, job.queue, "complete"),
                            "succeeded" if result else None)
            elif ctx.is_cancelled:
                outcome = self._after_cancel(job, task, ctx)
            else:
                outcome = Outcome(job.id, job.lease_version, job.queue, "complete",
                                  result=dump_result(result))
        except asyncio.CancelledError as exc:
            # ours (lease lost, cancel requested, shutdown) or the handler's own
            outcome = (self._after_cancel(job, task, ctx) if ctx.is_cancelled
                       else self._failure(job, task, exc))
        except Snooze as exc:
            outcome = Outcome(job.id, job.lease_version, job.queue, "release", delay=exc.seconds)
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # a handler never ends us
            if ctx.is_cancelled:
                outcome = self._after_cancel(job, task, ctx, exc)
            else:
                outcome = self._failure(job, task, exc)
        finally:
            if running.superseded:  # see _buffer
                self._stuck_threads -= 1
            elif self._running.get(job.id) is running:
                del self._running[job.id]
            self._fill()  # the next buffered job takes the slot at once
            if job.queue in self._controlled:
                self._due[job.queue] = True  # a slot of its limit may be free again
            self._wakeup.set()
        if outcome is None:
            self._leases.remove(job.id, job.lease_version)
        else:
            self._completer.submit(outcome)

    def _failure(self, job: Job, task: Task | None, exc: BaseException) -> Outcome:
        """The outcome of an attempt whose handler raised ``exc``."""
        error = error_json(job, exc)
        if isinstance(exc, Discard):
            return Outcome(job.id, job.lease_version, job.queue, "discard", error=error)
        if task is not None and task.transaction != "none" and connection_lost(exc):
            # the database went away under the job's own transaction: not the job's fault,
            # so the attempt is not counted
            return Outcome(job.id, job.lease_version, job.queue, "release",
                           delay=self._default_backoff.delay(1), error=error)
        backoff = task.backoff if task is not None else self._default_backoff
        return Outcome(job.id, job.lease_version, job.queue, "retry",
                       delay=backoff.delay(job.attempt), error=error)

    async def _call(self, running: _Running, task: Task, args: dict[str, Any]) -> Any:
        """Run the handler within the task's timeout (see :meth:`_call_now`)."""
        if task.timeout is None:
            return await self._call_now(running, task, args)
        try:
            return await asyncio.wait_for(self._call_now(running, task, args), task.timeout)
        except TimeoutError:
            running.ctx.cancel(f"timed out after {task.timeout}s")
            raise

    async def _call_now(self, running: _Running, task: Task, args: dict[str, Any]) -> Any:
        """Run the handler; for transaction="complete" tasks, return whether the completion
        committed (see :mod:`skipjack.transactional`), else the handler's result."""
        fn, q, ctx = task.fn, self.app.queries, running.ctx
        finishing = functools.partial(self._leases.finishing, ctx.job.id, ctx.job.lease_version)
        if task.transaction == "complete":
            if running.is_async:
                assert self._apool is not None
                async with self._apool.connection() as aconn:
                    return await transactional.run_async(aconn, q, ctx, fn, args, finishing)

            pool = self._pool
            assert pool is not None

            def atomic() -> bool:
                with pool.connection() as conn:
                    return transactional.run_sync(conn, q, ctx, fn, args, finishing)

            return await self._in_thread(atomic)
        if running.is_async:
            return await fn(**args)
        return await self._in_thread(functools.partial(fn, **args))

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the handler pool. If the wait is cancelled (timeout, lost lease,
        shutdown) while the thread still runs, that thread counts as busy until it returns,
        so the worker never claims jobs that would only wait for a thread."""
        future = self._threads.submit(contextvars.copy_context().run, fn)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.done():
                self._stuck_threads += 1
                future.add_done_callback(self._threadsafe(self._thread_freed))
            raise

    def _thread_freed(self, _future: object = None) -> None:
        self._stuck_threads -= 1
        self._fill()
        self._wakeup.set()

    def _after_cancel(self, job: Job, task: Task | None, ctx: JobContext,
                      exc: BaseException | None = None) -> Outcome | None:
        """The outcome of a handler stopped by the worker, by ``ctx.reason``."""
        if ctx.reason.startswith("lease"):
            return None  # the job belongs to someone else now: write nothing
        if ctx.reason == "cancel requested":
            return Outcome(job.id, job.lease_version, job.queue, "cancel")
        if ctx.reason.startswith("timed out"):
            return self._failure(job, task, TimeoutError(ctx.reason))
        return Outcome(job.id, job.lease_version, job.queue, "release")  # shutting down

    async def _load_args(self, job: Job) -> dict[str, Any]:
        async with await self.app.connect_async() as conn:
            cur = await conn.execute(self.app.queries.LOAD_ARGS,
                                     {"id": job.id, "lease_version": job.lease_version})
            row = await cur.fetchone()
        if row is None:
            raise asyncio.CancelledError("lease lost before the args were loaded")
        args: dict[str, Any] = row[0]
        return args

    def _threadsafe(self, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn`` as a callback other threads may call: it runs on the event loop."""

        def call(*args: Any) -> None:
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is closed: the worker has stopped
                pass

        return call

    def _cancel_requested(self, job_id: int, lease_version: int) -> None:
        waiting = self._ready.get(job_id)
        if waiting is not None and waiting.lease_version == lease_version:
            del self._ready[job_id]
            self._completer.submit(Outcome(job_id, lease_version, waiting.queue, "cancel"))
            return
        running = self._running.get(job_id)
        if running is None or running.job.lease_version != lease_version:
            return
        log.info("job %s: cancellation requested; cancelling its handler", job_id)
        running.ctx.cancel("cancel requested")
        if running.is_async and running.task is not None:
            running.task.cancel()

    def _lease_lost(self, job_id: int, lease_version: int, reason: str) -> None:
        waiting = self._ready.get(job_id)
        if waiting is not None and waiting.lease_version == lease_version:
            del self._ready[job_id]
            self.stats.leases_lost += 1
            log.warning("job %s: %s before it started; dropping it", job_id, reason)
            return
        running = self._running.get(job_id)
        if running is None or running.job.lease_version != lease_version:
            return
        self.stats.leases_lost += 1
        log.warning("job %s: %s; cancelling its handler", job_id, reason)
        running.ctx.cancel(reason)
        if running.is_async and running.task is not None:
            running.task.cancel()

async def _sleep_unless(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        pass


def _safe_dsn(dsn: str) -> str:
    """The DSN without a password, for logs."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<dsn>"
    info.pop("password", None)
    return " ".join(f"{k}={v}" for k, v in info.items())
