"""The worker: a supervisor that wires the parts that claim, run and record jobs.

Parts, each with one job and (where it talks to the database) its own connection, so that
handlers that exhaust the application's pool can never starve lease renewal or completion:

- ``skipjack.runtime.producer.Producer`` (asyncio task): the claim loop;
- ``skipjack.runtime.executor.Executor``: runs each claimed job (asyncio task per job,
  sync handlers in a thread pool), ``transaction`` "none" and "complete";
- ``skipjack.runtime.claim_mode.ClaimModeRunners``: ``transaction="claim"`` jobs;
- ``skipjack.runtime.slots.Slots``: the capacity they share;
- ``skipjack.runtime.completer.Completer`` (asyncio task): writes outcomes in fenced
  batches;
- ``skipjack.runtime.listener.listen`` (asyncio task): LISTEN, so notifications wake the
  producer;
- ``skipjack.runtime.heartbeat.HeartbeatThread``: renews leases every ``heartbeat``
  seconds, hears cancellation requests;
- ``skipjack.runtime.maintenance.Maintenance`` (thread): stager, rescuer, cron, pruner,
  the notification queue's watch.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..app import App
from ..db import safe_dsn
from ..errors import ConfigError
from ..jobs import DEFAULT_RETENTION, LEASE_MAX, LEASE_MIN, QUEUE_MAX_BYTES, check_name
from ..migrate import check_schema
from ..outcome import UNKNOWN_TASK_GRACE, Outcome
from ..roles import check_worker
from ..sql.claim import claim_params
from . import eventloop
from .claim_mode import ClaimModeRunners
from .completer import Completer, linger
from .executor import Executor
from .heartbeat import HeartbeatThread, Leases
from .listener import listen, probe
from .maintenance import Maintenance, Registry, schedule_due
from .producer import Producer
from .report import Reporter, WorkerStats
from .slots import MAX_PREFETCH, Slots

log = logging.getLogger("skipjack.worker")

# Seconds a stopping worker waits for its producer to finish the claim in flight (a claim
# takes milliseconds; a connection attempt to an unreachable server up to its timeout).
PRODUCER_STOP_TIMEOUT = 15.0
# Seconds a stopping worker waits for its maintenance thread's step in progress to end.
MAINTENANCE_STOP_TIMEOUT = 5.0

# The longest worker name (UTF-8 bytes): it is stored on every claimed row and keys the
# worker registry.
NAME_MAX_BYTES = 255

DAY = 86_400.0
YEAR = 365.25 * DAY
# The shortest poll, rescue, stage and listener health interval (seconds): shorter ones only
# spin (a 1 ns poll interval kept a core busy).
MIN_INTERVAL = 0.01


@dataclass
class Worker:
    """Runs jobs from some queues of an ``skipjack.App``.

    Args:
        app: the application (task registry and database).
        queues: queue names to serve; each is claimed with its own statement.
        concurrency: the most jobs running at once in this process (1..10,000).
        batch_size: the most jobs one claim takes (default: ``concurrency + prefetch``, at
            most 1,000, with an adaptive prefetch counted at its largest: one claim can fill
            every free slot and the prefetch buffer).
        lease: seconds a claim is valid without renewal. A job whose lease expires is
            rescued (returned to the queue) by any worker.
        heartbeat: seconds between heartbeats (lease renewals); must be < lease / 2 so one
            lost renewal cannot let a live job's lease expire (default lease / 6, at most 10).
        poll_interval: seconds between polls of every queue, the fallback for lost
            notifications (default 5).
        rescue_interval: seconds between rescuer runs in this worker (default lease / 2, at
            most 15).
        stage_interval: seconds between stager runs, which make due scheduled jobs
            (delayed, retried) available (default 1).
        retention: seconds to keep succeeded and cancelled jobs; this worker prunes older
            ones (default ``skipjack.jobs.DEFAULT_RETENTION``, 7 days; None: it prunes
            nothing, and the table keeps every job).
        discarded_retention: seconds to keep discarded jobs (default 10 x retention).
        prefetch: jobs claimed ahead of free slots, so a slot that frees starts its next job
            at once instead of after a claim round trip. Their leases are renewed while they
            wait; they count as started (an attempt) and are released at shutdown. 0 claims
            only for free slots. Default None: adaptive, about 0.05 s of work at the
            handlers' average run time (``concurrency * 0.05 / average``, 0 to 1,000; see
            ``skipjack.runtime.slots``): short jobs are claimed a thousand at a time, jobs
            of 0.5 s or longer one per free slot, so they spread across workers.
        fairness_every: every n-th claim that takes jobs from a queue (limited or not) takes
            the oldest runnable jobs of the priority whose oldest job has waited longest,
            whatever that priority is, so no priority waits forever
            (0 disables: strict priority, where a steady stream of higher priorities starves
            lower ones).
        shutdown_grace: seconds running jobs get to finish after SIGTERM; the rest are then
            released back to their queue, their attempt not counted.

    The intervals (``poll_interval``, ``rescue_interval``, ``stage_interval``,
    ``listen_health_interval``) must be 0.01 s to a day, ``lease`` 0.1 s to 7 days,
    ``shutdown_grace`` 0 to a day, ``unknown_task_grace`` at most 7 days, the retentions at
    most 10 years; every setting of a count must be an int.
        name: the worker's name stored on claimed rows and in the live worker registry
            (default host:pid:random; printable, at most 255 bytes). Only for people:
            recovery never depends on it.
        inline_args_bytes: args larger than this (serialised bytes) are not fetched by the
            claim but loaded just before the handler runs, and at most
            ``large_args_concurrency`` such jobs run at once, so a batch of huge payloads
            cannot exhaust the worker's memory.
        listen_health_interval: seconds of silence after which the listener checks its
            connection.
        unknown_task_grace: seconds after its enqueue during which a job of a task this
            worker's app does not know is released (its attempt not counted) for a worker
            that knows it, as during a rolling deploy; then it goes to the dead letter
            (default 600).
        stats: counters since the worker started.

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
    retention: float | None = DEFAULT_RETENTION
    discarded_retention: float | None = None
    fairness_every: int = 10
    prefetch: int | None = None
    shutdown_grace: float = 30.0
    name: str = ""
    listen_health_interval: float = 10.0
    inline_args_bytes: int = 256 * 1024
    large_args_concurrency: int = 4
    unknown_task_grace: float = UNKNOWN_TASK_GRACE
    stats: WorkerStats = field(default_factory=WorkerStats)

    def __post_init__(self) -> None:
        if isinstance(self.queues, str) or not self.queues:
            raise ConfigError("queues: give a non-empty list of queue names")
        self.queues = tuple(check_name("queue", q, QUEUE_MAX_BYTES)
                            for q in dict.fromkeys(self.queues))
        for name in ("concurrency", "prefetch", "batch_size", "fairness_every",
                     "inline_args_bytes", "large_args_concurrency"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{name}: must be an int, got {value!r}")
        for name in ("lease", "heartbeat", "poll_interval", "rescue_interval", "stage_interval",
                     "listen_health_interval", "shutdown_grace", "retention",
                     "discarded_retention", "unknown_task_grace"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, int | float)):
                raise ConfigError(f"{name}: must be seconds (a number), got {value!r}")
        if self.fairness_every < 0:
            raise ConfigError(f"fairness_every: {self.fairness_every} must be >= 0 (0: never)")
        if not 1 <= self.large_args_concurrency <= 10_000:
            raise ConfigError(f"large_args_concurrency: {self.large_args_concurrency} is out "
                              "of range 1..10000")
        if self.inline_args_bytes < 0:
            raise ConfigError(f"inline_args_bytes: {self.inline_args_bytes} must be >= 0")
        if "\x00" in self.name or not self.name.isprintable():
            raise ConfigError("name: must be printable text without NUL")
        if len(self.name.encode(errors="replace")) > NAME_MAX_BYTES:
            raise ConfigError(f"name: {len(self.name.encode(errors='replace'))} bytes, at most "
                              f"{NAME_MAX_BYTES}")
        if not 1 <= self.concurrency <= 10_000:
            raise ConfigError(f"concurrency: {self.concurrency} is out of range 1..10000")
        if self.prefetch is not None and not 0 <= self.prefetch <= 10_000:
            raise ConfigError(f"prefetch: {self.prefetch} is out of range 0..10000")
        if self.batch_size is None:
            most = MAX_PREFETCH if self.prefetch is None else self.prefetch
            self.batch_size = min(self.concurrency + most, 1000)
        if not 1 <= self.batch_size <= 10_000:
            raise ConfigError(f"batch_size: {self.batch_size} is out of range 1..10000")
        if not LEASE_MIN <= self.lease <= LEASE_MAX:
            raise ConfigError(f"lease: {self.lease} seconds is out of range "
                              f"{LEASE_MIN}..{LEASE_MAX:.0f}")
        if self.heartbeat is None:
            self.heartbeat = min(self.lease / 6, 10.0)
        if not 0 < self.heartbeat < self.lease / 2:
            raise ConfigError(
                f"heartbeat: {self.heartbeat}s cannot keep a {self.lease}s lease alive; "
                f"it must be > 0 and < lease / 2 = {self.lease / 2}s"
            )
        if self.rescue_interval is None:
            self.rescue_interval = min(self.lease / 2, 15.0)
        for name, low, high in (("poll_interval", MIN_INTERVAL, DAY),
                                ("rescue_interval", MIN_INTERVAL, DAY),
                                ("listen_health_interval", MIN_INTERVAL, DAY),
                                ("stage_interval", MIN_INTERVAL, DAY),
                                ("unknown_task_grace", 0, 7 * DAY),
                                ("shutdown_grace", None, DAY), ("retention", 0, 10 * YEAR),
                                ("discarded_retention", 0, 10 * YEAR)):
            value = getattr(self, name)
            if value is None and name.endswith("retention"):
                continue
            # low None: at least 0; 0: more than 0; else at least low
            above = value >= 0 if low is None else value > 0 if low == 0 else value >= low
            if not (above and value <= high):
                least = ">= 0" if low is None else "> 0" if low == 0 else f">= {low}"
                raise ConfigError(f"{name}: {value!r} is out of range: seconds, {least} and "
                                  f"<= {high:,.0f}")
        self.name = self.name or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        db = self.app.db
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested = False
        self._first_signal = 0.0
        self._stopping = asyncio.Event()
        self._serving = False  # started and not yet stopping
        # set once the worker serves (claims), for threads and supervisors that wait for it
        self.started = threading.Event()
        self._listening = False  # LISTEN connected (else only polling)
        self._leases = Leases()
        self._slots = Slots(self.concurrency, self.prefetch)
        self._report = Reporter(self.app.hooks, self.stats)
        self._completer = Completer(db, self._leases, self._recorded,
                                    more_coming=lambda: bool(self._slots.running),
                                    on_written=lambda batch: self._producer.outcomes_written(batch),
                                    wait=lambda: linger(self._slots.run_time,
                                                        self.concurrency),
                                    drained=lambda: not (self._slots.running
                                                         or self._slots.ready))
        self._executor = Executor(db, self.app.tasks, self._slots, self._leases,
                                  self._completer, self.stats, self._report, self.app.hooks,
                                  self._stopping,
                                  concurrency=self.concurrency,
                                  large_args_concurrency=self.large_args_concurrency,
                                  on_slot_freed=lambda q: self._producer.slot_freed(q),
                                  unknown_task_grace=self.unknown_task_grace,
                                  transactions=self.app.complete_transaction,
                                  async_transactions=self.app.complete_transaction_async)
        self._claim_mode = ClaimModeRunners(db, self.app.tasks, self.queues, self._slots,
                                            self._leases, self._executor, self._report,
                                            self.app.hooks, self.stats,
                                            self._stopping, self._claim_params,
                                            on_slot_freed=lambda: self._producer.slot_freed())
        self._producer = Producer(db, self.queues, self._slots, self._executor,
                                  self._claim_mode, self._completer, self._stopping,
                                  self._claim_params, batch_size=self.batch_size,
                                  fairness_every=self.fairness_every,
                                  poll_interval=self.poll_interval)
        self._heartbeat_thread = HeartbeatThread(
            db, self._leases, interval=self.heartbeat,
            on_lost=self._threadsafe(self._executor.lease_lost),
            on_cancel=self._threadsafe(self._executor.cancel_requested))
        self._maintenance = Maintenance(
            db, stage_interval=self.stage_interval, rescue_interval=self.rescue_interval,
            retention=self.retention, discarded_retention=self.discarded_retention,
            on_staged=self._threadsafe(self._producer.mark_due),
            cron=(lambda c: schedule_due(self.app, c)) if self.app.crons else None,
            poll_interval=self.poll_interval,
            registry=Registry(db.queries, name=self.name, queues=self.queues,
                              concurrency=self.concurrency, interval=self.heartbeat,
                              snapshot=lambda: (self._slots.busy(), asdict(self.stats))),
            registry_interval=self.heartbeat,
            on_rescued=self._count_rescued)

    # --- lifecycle -----------------------------------------------------------------------

    def run(self) -> None:
        """Run until SIGTERM or SIGINT, then shut down gracefully. A second signal exits at
        once with status 1 (the jobs' leases then expire and the rescuer returns them).

        Unlike ``asyncio.run``, it does not wait for handlers that ignored cancellation (their
        jobs were already released); the interpreter still waits for such sync handlers'
        threads at exit (a warning says so), unless the process ends with ``os._exit``. Its
        event loop's timers fire on time (see ``skipjack.runtime.eventloop``)."""
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
        # _stop_requested is set on the loop's next turn: a signal of the same turn (SIGINT
        # from the terminal with the supervisor's SIGTERM) finds only _first_signal set
        if self._stop_requested or self._first_signal:
            if time.monotonic() - self._first_signal < 1.0:
                return  # the same stop sent twice (e.g. to the process group): not a second
            log.warning("second %s: exiting now", signal.Signals(sig).name)
            os._exit(1)
        self._first_signal = time.monotonic()
        log.info("%s: stopping (grace %.1fs)", signal.Signals(sig).name, self.shutdown_grace)
        self.stop()

    def stop(self) -> None:
        """Ask the worker to stop claiming and shut down (thread-safe)."""
        if self._loop is None:
            self._stop_requested = True
        else:
            self._loop.call_soon_threadsafe(self._request_stop)

    def _request_stop(self) -> None:
        self._stop_requested = True
        self._stopping.set()
        self._producer.wakeup.set()

    async def run_async(self) -> None:
        """Run on the current event loop until ``stop`` is called.

        Database errors never end it: every component reconnects with capped backoff.

        Raises:
            SchemaVersionError: the schema is missing or of another version.
            ConfigError: a task's lease is too short for the heartbeat, or the database
                role lacks a worker's privileges on the schema.
            Exception: a worker component failed on a bug (after a graceful shutdown), so a
                supervisor sees a non-zero exit instead of a worker that silently idles.
        """
        self._check_task_leases()
        self._claim_mode.prepare()
        await asyncio.to_thread(self._check_database)
        await probe(self.app.db)
        self._loop = asyncio.get_running_loop()
        await self._executor.open()
        if self._stop_requested:
            self._stopping.set()
        self._heartbeat_thread.start()
        self._maintenance.start()
        log.info("worker %s serving %s (concurrency %d) on %s", self.name,
                 ", ".join(self.queues), self.concurrency, safe_dsn(self.app.dsn))
        task_queues = sorted({t.queue for t in self.app.tasks.values()})
        if self.queues == ("default",) and task_queues and "default" not in task_queues:
            log.warning("serving only the queue 'default', which no task of this app has as its "
                        "queue (they have %s): name them with --queue", ", ".join(task_queues))
        for queue in self.queues:
            # a queue no task has may be reached by configure(queue=): only a near miss of
            # a task's queue is worth a word
            close = [] if queue in task_queues else difflib.get_close_matches(
                queue, task_queues, n=1, cutoff=0.8)
            if close:
                log.warning("serving the queue %r, which no task of this app has as its queue "
                            "(did you mean %r?)", queue, close[0])
        producer = asyncio.create_task(self._producer.run(), name="skipjack-producer")
        helpers = [asyncio.create_task(listen(self.app.db, self._producer.mark_due,
                                              self._listener_connected,
                                              self.listen_health_interval,
                                              on_lost=self._listener_lost,
                                              on_settings=self._producer.settings_changed,
                                              on_due=self._maintenance.stage_at),
                                       name="skipjack-listener"),
                   asyncio.create_task(self._completer.run(), name="skipjack-completer")]
        stopping = asyncio.create_task(self._stopping.wait())
        failure: BaseException | None = None
        self._serving = True
        self.started.set()
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
            self._serving = False
            await self._stop_producer(producer)
            await self._drain()
        finally:
            self._serving = False
            stopping.cancel()
            for t in helpers:
                t.cancel()
            await asyncio.gather(*helpers, stopping, return_exceptions=True)
            self._heartbeat_thread.stop()
            self._maintenance.stop()
            # it removes this worker's registry row as it ends
            await asyncio.to_thread(self._maintenance.join, MAINTENANCE_STOP_TIMEOUT)
            await self._executor.close()
            self._report.say_unlogged()
            log.info("worker %s stopped: %s", self.name, self.stats,
                     extra={"worker": self.name, **asdict(self.stats)})
        if failure is not None:
            raise failure

    async def _stop_producer(self, producer: asyncio.Task[None]) -> None:
        """Let the producer end by itself, so that a claim in flight when the stop came
        reaches the buffer (and is released by ``_drain``) instead of committing on the
        server unseen (its jobs would stay running until their leases expired, and run again
        with an attempt counted). It is cancelled only if it does not end within
        ``PRODUCER_STOP_TIMEOUT`` seconds (a connection attempt to an unreachable server)."""
        self._request_stop()
        done, _ = await asyncio.wait([producer], timeout=PRODUCER_STOP_TIMEOUT)
        if not done:
            log.warning("the producer did not stop within %.0fs; cancelling it (jobs of a claim "
                        "in flight come back when their leases expire)", PRODUCER_STOP_TIMEOUT)
            producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)

    def status(self) -> dict[str, Any]:
        """For health checks (any thread): ``serving`` (started and not stopping),
        ``listening`` (notifications reach the worker; else it only polls), and ``loop`` (its
        event loop once it runs, else None)."""
        return {"serving": self._serving and not self._stopping.is_set(),
                "listening": self._listening, "loop": self._loop}

    def _recorded(self, o: Outcome, state: str | None, run_at: datetime | None = None) -> None:
        """An outcome was written: reported; a job retried or released to run again soon
        gets the stager then, not at its next interval."""
        self._report.recorded(o, state, run_at)
        if state == "scheduled" and run_at is not None:
            self._maintenance.stage_at((run_at - datetime.now(UTC)).total_seconds())

    def _count_rescued(self, n: int) -> None:
        self.stats.rescued += n  # only this worker's maintenance thread writes it

    def _listener_connected(self) -> None:
        self._listening = True
        self._producer.mark_all_due()

    def _listener_lost(self) -> None:
        self._listening = False

    def gauges(self) -> dict[str, int]:
        """What the worker holds now: ``running`` (jobs whose handler runs, a stuck thread's
        included), ``buffered`` (claimed ahead, waiting for a slot), ``outcomes_pending``
        (waiting to be written), ``concurrency`` and ``prefetch`` (the jobs it claims ahead
        of free slots now, adaptive unless set). Safe to call from any thread (a snapshot,
        possibly a moment old)."""
        slots = self._slots
        return {"running": slots.busy(), "buffered": len(slots.ready),
                "outcomes_pending": len(self._completer), "concurrency": self.concurrency,
                "prefetch": slots.prefetch}

    def pool_gauges(self) -> dict[tuple[str, str], int]:
        """Connections of the handlers' pools (which open only for tasks with their own
        transaction): (``sync`` or ``async``, ``open`` or ``idle``) -> count."""
        return self._executor.pool_gauges()

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
        slots = self._slots
        for job in slots.ready.values():
            self._completer.submit(Outcome(job.id, job.lease_version, job.queue, "release",
                                           job=job))
        slots.ready.clear()
        self._claim_mode.slot_freed()  # a runner waiting for a slot sees the stop and ends
        if slots.busy():
            log.info("waiting up to %.1fs for %d running jobs", self.shutdown_grace,
                     slots.busy())
            tasks = [r.task for r in slots.running.values() if r.task is not None]
            tasks += self._claim_mode.runners
            if tasks:  # none when the only busy slots are threads stuck past their timeout
                await asyncio.wait(tasks, timeout=self.shutdown_grace)
            self._executor.shut_down()
            for runner in self._claim_mode.runners:  # the process exit rolls their claims back
                runner.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
            for r in list(slots.running.values()):  # a handler that ignores cancellation
                log.warning("job %s ignored cancellation; releasing it", r.job.id)
                slots.running.pop(r.job.id, None)
                self._completer.submit(Outcome(r.job.id, r.job.lease_version, r.job.queue,
                                               "release", job=r.job))
        try:
            await asyncio.wait_for(self._completer.flush(), timeout=max(self.shutdown_grace, 5.0))
        except TimeoutError:
            log.error("could not record %d outcomes before exit; their leases will expire "
                      "and the rescuer will return the jobs", len(self._completer))

    def _check_database(self) -> None:
        """The schema's version, then the role's privileges (see ``run_async``)."""
        with self.app.connect() as conn:
            check_schema(conn, self.app.schema)
            check_worker(conn, self.app.schema)

    def _claim_params(self, queue: str, limit: int, claim_mode: bool) -> dict[str, Any]:
        return claim_params(queue, limit, lease=self.lease, worker=self.name,
                            min_lease=3 * (self.heartbeat or 0),
                            inline_bytes=self.inline_args_bytes,
                            claim_mode_tasks=self._claim_mode.task_names,
                            claim_mode_leases=self._claim_mode.task_leases,
                            claim_mode=claim_mode)

    def _threadsafe(self, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn`` as a callback other threads may call: it runs on the event loop."""

        def call(*args: Any) -> None:
            if self._loop is None:
                return
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is closed: the worker has stopped
                pass

        return call
