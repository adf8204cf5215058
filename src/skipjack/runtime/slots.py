"""The worker's capacity: which jobs run, which wait for a slot, and how many more to claim.

One ``Slots`` is shared by the producer (which claims while there is room), the executor
(which starts buffered jobs in free slots) and the claim-mode runners (each holds a slot for
its open transaction). They all use it from the worker's event loop, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ..context import Job, JobContext

log = logging.getLogger("skipjack.worker")

# The adaptive prefetch (``Slots(prefetch=None)``, the worker's default): the buffer holds
# about PREFETCH_HORIZON seconds of work at the rate the slots finish jobs (concurrency /
# the average handler time), at most MAX_PREFETCH jobs. Short jobs get large claims, so a
# claim's round trip and commit are shared by many jobs; long jobs get few or none, so a
# worker does not hold work that another worker could start now. docs/performance.md
# ("How many jobs a claim takes") has the measurements that chose these figures.
PREFETCH_HORIZON = 0.05
MAX_PREFETCH = 1000
# Weight of the latest handler time in the running average (an exponentially weighted
# moving average: about the last 1 / RUN_TIME_WEIGHT jobs count).
RUN_TIME_WEIGHT = 0.05
# Seconds between two warnings that outcomes waiting to be written paused the claims: a
# worker kept at that limit by a saturated machine pauses several times a second (run U of
# docs/performance.md, W5 at 90% of W2: ten pauses in four seconds).
PAUSE_WARNING_INTERVAL = 60.0


@dataclass
class Running:
    """One job the executor runs now, with its context and the asyncio task running it."""

    job: Job
    ctx: JobContext
    task: asyncio.Task[None] | None = None
    is_async: bool = False
    superseded: bool = False  # a later claim of the same job replaced this run, or:
    abandoned: bool = False  # it ignored its cancellation; its attempt is recorded already


class Slots:
    """Slots in use and jobs claimed ahead of them.

    Args:
        concurrency: the most jobs running at once (slots).
        prefetch: jobs claimed ahead of free slots, waiting in ``ready``; None adapts it to
            the handlers' average run time (see ``ran`` and ``PREFETCH_HORIZON``), starting
            at 0 until the first job ends.

    A slot is in use by a running job (``running``), by a claim-mode runner
    (``claim_mode``), or by a handler thread that the worker stopped waiting for but that
    has not returned yet, or an async handler that went on after its cancellation
    (``stuck_threads``): claiming for it would only make a job wait for a thread. A
    claim-mode runner's slot counts as free for claims (``room``): while claimed jobs wait,
    runners give slots back after their jobs until they hold about as many as the running
    jobs (``skipjack.runtime.claim_mode``), so that a steady stream of claim-mode jobs
    cannot keep a worker's other queues from ever being claimed.
    """

    def __init__(self, concurrency: int, prefetch: int | None) -> None:
        self.concurrency = concurrency
        self.adaptive = prefetch is None
        self.prefetch = 0 if prefetch is None else prefetch
        self.run_time: float | None = None  # average handler run time, seconds
        self.running: dict[int, Running] = {}
        self.ready: dict[int, Job] = {}  # claimed, waiting for a slot (insertion order)
        self.claim_mode = 0
        self.stuck_threads = 0
        self.claims_paused = False
        self._pause_warned = False  # the present pause was logged
        self._warned_at: float | None = None  # time.monotonic() of the last such warning
        self._pauses_unwarned = 0  # pauses since then
        # Outcomes waiting to be written past which nothing more is claimed: ten times the
        # slots plus two full prefetch buffers (at least 1,000), far above what piles up
        # while one write runs: a stalled completer reaches it, or one that a saturated
        # machine leaves behind (W5 at 90% of W2 in run U of docs/performance.md: 2,100-2,500
        # outcomes at 48,000 jobs/s on 2 cores), where pausing the claims is the back-pressure
        # wanted. It bounds the finished jobs that a crash during such a stall would run again.
        most = MAX_PREFETCH if prefetch is None else prefetch
        self.max_unwritten = max(1000, 10 * concurrency + 2 * most)

    def ran(self, seconds: float) -> None:
        """A handler ran for ``seconds``: update the average run time and, when adaptive,
        the prefetch: ``concurrency * PREFETCH_HORIZON / average`` jobs (the work the slots
        finish in PREFETCH_HORIZON seconds), rounded down, 0 to ``MAX_PREFETCH``."""
        avg = seconds if self.run_time is None else (
            self.run_time + RUN_TIME_WEIGHT * (seconds - self.run_time))
        self.run_time = avg
        if self.adaptive:
            ahead = self.concurrency * PREFETCH_HORIZON
            self.prefetch = MAX_PREFETCH if ahead >= avg * MAX_PREFETCH else int(ahead / avg)

    def busy(self) -> int:
        """Slots in use."""
        return len(self.running) + self.claim_mode + self.stuck_threads

    def has_free_slot(self) -> bool:
        """Whether one more job could start now."""
        return self.busy() < self.concurrency

    def claimable(self) -> bool:
        """Whether the slots and the buffer leave room for a claim now (``room`` may still
        say 0 while too many outcomes wait to be written)."""
        return self._free() > 0

    def room(self, unwritten: int) -> int:
        """How many more jobs to claim now, with ``unwritten`` outcomes waiting to be written:
        the free slots plus the prefetch buffer's free places; but nothing while the buffer
        is over half full (so claims come in batches rather than one job per finished job),
        nor from the moment ``max_unwritten`` outcomes wait (the database is not taking
        them: a row lock held elsewhere, a slow disk, a saturated machine) until no more
        than half as many do, so that a worker held at the limit does not pause and resume
        at every outcome batch. A pause is logged as a warning, at most once every
        ``PAUSE_WARNING_INTERVAL`` seconds (with the count of pauses since the last one)."""
        if self.claims_paused:
            if unwritten > self.max_unwritten // 2:
                return 0
            self.claims_paused = False
            if self._pause_warned:
                log.info("outcomes written; claiming again")
        elif unwritten >= self.max_unwritten:
            self.claims_paused = True
            self._pause_warned = False
            now = time.monotonic()
            if self._warned_at is None or now - self._warned_at >= PAUSE_WARNING_INTERVAL:
                since = (f" ({self._pauses_unwarned} more pauses since the last such warning)"
                         if self._pauses_unwarned else "")
                log.warning("%d outcomes wait to be written; claiming paused until no more "
                            "than %d do%s", unwritten, self.max_unwritten // 2, since)
                self._pause_warned, self._warned_at, self._pauses_unwarned = True, now, 0
            else:
                self._pauses_unwarned += 1
            return 0
        return self._free()

    def _free(self) -> int:
        """Free slots (those of claim-mode runners included) plus the buffer's free places;
        0 while the buffer is over half full."""
        if self.ready and len(self.ready) > self.prefetch // 2:
            return 0
        return (self.concurrency + self.prefetch - len(self.running) - self.stuck_threads
                - len(self.ready))
