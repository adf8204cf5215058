"""The producer: the worker's claim loop.

It claims up to ``batch_size`` jobs from ONE queue per statement, round-robin over the
worker's queues, whenever a queue may have work (a notification, the poll timer, a limit that
may have lifted, or a previous claim that came back full) and there is room (see
``skipjack.runtime.slots.Slots.room``). Each due queue gets its share of the room, so a
deep queue cannot fill the prefetch buffer ahead of a shallow one (FC-20 in
``tests/CASES.md``). Every ``fairness_every``-th claim that takes jobs from a queue takes the
oldest runnable ones of the priority whose oldest job has waited longest, whatever that
priority is. Queues with a concurrency or rate limit are
claimed under the queue's row lock (``LOCK_QUEUE`` then ``CLAIM_LIMITED``); which queues are
limited is re-read at every poll.

Its connection claims with ``synchronous_commit = off`` (see ``skipjack.sql``), and is
replaced after a lost connection, with capped backoff; every queue is rescanned after that.
A claim statement the database refuses (a trigger of the application's raising for one job,
a counter that would overflow) is retried job by job in a transaction rolled back afterwards,
to find the jobs it fails on; those are skipped for a while (backing off while they fail) so
that the rest of the queue runs, and claimed again once the fault has gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import psycopg

from ..context import Job
from ..db import Database, ReconnectDelay, close_quietly, connection_lost
from ..outcome import Outcome
from ..sql.arrays import number_array
from ..sql.claim import in_claim_order
from .claim_mode import ClaimModeRunners, ClaimParams
from .completer import Completer
from .executor import Executor
from .skips import SkipList
from .slots import Slots

log = logging.getLogger("skipjack.worker")

# Seconds after a limited queue's claim came back short with jobs held back by its limits
# (``HELD_BACK``) before it is claimed again: a rate window may have closed meanwhile (sooner
# for a shorter rate period, down to MIN_LIMITED_RETRY). A concurrency limit lifts sooner,
# when the completer writes an outcome of the queue (``Producer.outcomes_written``). One
# retry a queue is pending at a time. A queue that had no more jobs waits for a wake-up or
# the next poll, as any other.
LIMITED_RETRY = 0.5
MIN_LIMITED_RETRY = 0.05


class Producer:
    """Claims jobs into the executor's buffer.

    Args:
        db: the app's database.
        queues: the queues to serve, in round-robin order.
        slots: the shared capacity state.
        executor: takes the claimed jobs (``Executor.buffer``) and starts them.
        claim_mode: the claim-mode runners, started here for queues that may have such jobs.
        completer: its backlog of unwritten outcomes pauses claims.
        stopping: set when the worker shuts down.
        claim_params: bind values of the claim statements.
        batch_size: the most jobs per claim statement.
        fairness_every: every n-th claim that takes jobs is oldest-first (0: never).
        poll_interval: seconds between rescans of every queue.
    """

    def __init__(self, db: Database, queues: Sequence[str], slots: Slots, executor: Executor,
                 claim_mode: ClaimModeRunners, completer: Completer, stopping: asyncio.Event,
                 claim_params: ClaimParams, *, batch_size: int, fairness_every: int,
                 poll_interval: float) -> None:
        self._db = db
        self._queues = list(queues)
        self._slots = slots
        self._executor = executor
        self._claim_mode = claim_mode
        self._completer = completer
        self._stopping = stopping
        self._claim_params = claim_params
        self._batch_size = batch_size
        self._fairness_every = fairness_every
        self._poll_interval = poll_interval
        self.wakeup = asyncio.Event()
        self.due = dict.fromkeys(self._queues, True)  # queues that may have jobs for us
        # wake-ups per queue: one that comes while a claim of the queue runs (a commit the
        # claim's snapshot missed) keeps the queue due when the claim comes back short
        self._woken = dict.fromkeys(self._queues, 0)
        self._claims = dict.fromkeys(self._queues, 0)  # claims that took jobs, per queue
        self._limited: dict[str, float | None] = {}  # limited queues: their rate periods
        self._retrying: set[str] = set()  # limited queues with a retry pending
        self._refresh = True  # re-read which queues are limited before the next claim
        self._skipped = SkipList()
        self._oldest = False  # whether the last claim was oldest-first
        self._poll_due = False  # the poll interval has passed (``_poll``)

    def mark_due(self, queue: str, claim_mode: bool = True) -> None:
        """``queue`` may have runnable jobs now (a notification, or the stager made some);
        with ``claim_mode`` False, only jobs for its lease-mode claims."""
        if queue in self.due:
            self.due[queue] = True
            if claim_mode:
                self._claim_mode.due[queue] = True
            self._woken[queue] += 1
            self.wakeup.set()

    def settings_changed(self, queue: str) -> None:
        """``queue`` was paused, resumed or given other limits: re-read which queues are
        limited before the next claim, and claim from it again."""
        self._refresh = True
        self.mark_due(queue)

    def mark_all_due(self) -> None:
        """Every queue may have runnable jobs (after a poll interval, or a reconnection)."""
        for q in self.due:
            self.due[q] = self._claim_mode.due[q] = True
            self._woken[q] += 1
        self.wakeup.set()

    def _retry_delay(self, queue: str) -> float:
        """Seconds until a limited queue whose claim came back short is claimed again:
        ``LIMITED_RETRY``, or its rate period if shorter (at least ``MIN_LIMITED_RETRY``)."""
        period = self._limited.get(queue)
        return LIMITED_RETRY if period is None else max(min(LIMITED_RETRY, period),
                                                        MIN_LIMITED_RETRY)

    def _retry(self, queue: str) -> None:
        """``_retry_delay`` seconds after a limited queue's claim came back short: claim
        from it again (its limit may have lifted)."""
        self._retrying.discard(queue)
        self.mark_due(queue, claim_mode=False)  # limits do not apply to claim-mode jobs

    def _poll(self) -> None:
        """The poll interval has passed: rescan every queue at the claim loop's next turn."""
        self._poll_due = True
        self.wakeup.set()

    def outcomes_written(self, outcomes: Sequence[Outcome]) -> None:
        """The completer wrote ``outcomes``: claim again. Their jobs no longer count against
        their queues' concurrency limits, so those queues are due again: the claim a freed
        slot set off before the outcome was written found the limit still reached (the
        finished job counted as running), and the queue would otherwise wait for the retry
        ``LIMITED_RETRY`` seconds later. 20 jobs of 0.5 s on a queue of limit 2, one worker of
        concurrency 10 (PostgreSQL 15): 6.0-7.0 s from the first start to the last end
        before, 5.05 s since (ideal 5)."""
        if self._limited:
            for queue in {o.queue for o in outcomes} & self._limited.keys():
                self.due[queue] = True
                self._woken[queue] += 1  # due still if a claim of it under way comes back short
        self.wakeup.set()

    def slot_freed(self, queue: str | None = None) -> None:
        """A slot freed: claim again if the slots and the buffer leave room for a claim
        (``Slots.claimable``); a limited queue's limit may allow more jobs now; a claim-mode
        runner waiting for a slot may go on.

        While the buffer is over half full a freed slot takes a buffered job and nothing is
        claimed, so the claim loop is not woken for it: in ``skipjack bench``'s W4 (2,000
        jobs of 2 ms, concurrency 8, 90 claims) its coroutine ran 1,632 times when every
        freed slot woke it, 261 times since (docs/performance.md, "The end of a burst and
        the claim loop's wake-ups")."""
        self._claim_mode.slot_freed()
        if queue in self._limited:
            self.due[queue] = True
        elif not self._slots.claimable():
            return
        self.wakeup.set()

    async def run(self) -> None:
        """Claim until the worker stops; database errors never end it."""
        loop = asyncio.get_running_loop()
        conn: psycopg.AsyncConnection[Any] | None = None
        backoff = ReconnectDelay()
        poll_timer = loop.call_later(self._poll_interval, self._poll)
        start = 0
        self._refresh = True
        try:
            while not self._stopping.is_set():
                if self._poll_due:
                    self._poll_due = False
                    self.mark_all_due()
                    self._refresh = True  # re-read which queues are limited
                    poll_timer = loop.call_later(self._poll_interval, self._poll)
                self.wakeup.clear()
                order = self._queues[start:] + self._queues[:start]
                start = (start + 1) % len(self._queues)
                sharing = max(1, sum(self.due.values()))  # queues wanting work now
                for queue in order:
                    free = self._slots.room(len(self._completer))
                    if free <= 0 or self._stopping.is_set():
                        break
                    if (self._claim_mode.task_names and self._claim_mode.due[queue]
                            and self._claim_mode.wants_runner(queue)):
                        self._claim_mode.due[queue] = False
                        self._claim_mode.spawn(queue)  # it spawns more as it finds jobs
                        continue
                    if not self.due[queue]:
                        continue
                    want = min(free, self._batch_size, max(1, -(-free // sharing)))
                    woken = self._woken[queue]
                    try:
                        if conn is None or conn.closed:
                            conn = await self._db.connect_async()
                            await conn.execute(self._db.queries.NO_WAIT_FOR_FLUSH)
                        if self._refresh:
                            self._refresh = False
                            cur = await conn.execute(self._db.queries.LIMITED_QUEUES)
                            self._limited = dict(await cur.fetchall())
                        rows, held_back = await self._claim(conn, queue, want)
                        if backoff.reset():
                            log.info("claim: the database is reachable again")
                    except psycopg.Error as exc:
                        if (conn is not None and not conn.broken and not connection_lost(exc)
                                and await self._skip_failing(conn, queue, want, exc)):
                            self.due[queue] = True  # claim again, without them
                            continue
                        await close_quietly(conn)
                        conn = None
                        delay = backoff.next()
                        log.warning("claim failed: %s (retrying in %.1fs)", str(exc).strip(),
                                    delay)
                        try:
                            await asyncio.wait_for(self._stopping.wait(), delay)
                        except TimeoutError:
                            pass
                        self.mark_all_due()  # rescan after reconnecting
                        break
                    if len(rows) < want and self._woken[queue] == woken:
                        self.due[queue] = False
                        if held_back and queue not in self._retrying:
                            self._retrying.add(queue)  # a limit may lift soon (rate window)
                            loop.call_later(self._retry_delay(queue), self._retry, queue)
                    self._executor.buffer([Job.from_row(r) for r in in_claim_order(rows)])
                    self._executor.fill()
                free = self._slots.room(len(self._completer))
                if (free > 0 and any(self.due.values())) or self._stopping.is_set():
                    continue
                await self.wakeup.wait()  # set by the poll timer (``_poll``) at the latest
        finally:
            poll_timer.cancel()
            await close_quietly(conn)

    def _params(self, queue: str, want: int) -> dict[str, Any]:
        """Bind values of a lease-mode claim, skipping the jobs whose claim failed lately."""
        params = self._claim_params(queue, want, False)
        if self._skipped:
            params["skip"] = number_array(self._skipped.ids())
        return params

    async def _skip_failing(self, conn: psycopg.AsyncConnection[Any], queue: str, want: int,
                            exc: psycopg.Error) -> bool:
        """After a claim statement the database refused: find the jobs the claim fails on
        (each tried alone, in a transaction rolled back afterwards) and skip them for a
        while (see ``skipjack.runtime.skips``), so the rest of the queue runs. Returns
        whether any was found; if not, the failure is not a job's and the caller backs off
        as after a lost connection."""
        q = self._db.queries
        params = self._params(queue, want)
        failing: list[tuple[int, str]] = []
        try:
            async with conn.transaction() as dry_run:
                listed = q.CLAIM_CANDIDATES_OLDEST if self._oldest else q.CLAIM_CANDIDATES
                ids = [r[0] for r in await (await conn.execute(listed, params)).fetchall()]
                for job_id in ids:
                    try:
                        async with conn.transaction():
                            await (await conn.execute(q.CLAIM_BY_ID,
                                                      {**params, "id": job_id})).fetchall()
                    except psycopg.Error as one:
                        if connection_lost(one):
                            raise
                        failing.append((job_id, str(one).strip()))
                raise psycopg.Rollback(dry_run)
        except psycopg.Error:
            return False
        for job_id, error in failing:
            self._skipped.add(job_id, error)
        if not failing:
            log.warning("claim on %s refused (%s), but by no job of it alone", queue,
                        str(exc).strip())
        return bool(failing)

    async def _claim(self, conn: psycopg.AsyncConnection[Any], queue: str,
                     want: int) -> tuple[list[Any], bool]:
        """One claim from one queue: through the queue's lock when it is limited; every
        ``fairness_every``-th claim that takes jobs oldest-first instead of by priority.
        Returns the claimed rows, and whether a limited queue's claim came back short with
        jobs still waiting (``HELD_BACK``): an empty limited queue is not claimed again
        every ``LIMITED_RETRY`` seconds (each claim a row lock on the queue, written to the
        WAL) while the cluster is idle."""
        q = self._db.queries
        params = self._params(queue, want)
        every = self._fairness_every
        oldest = every and (self._claims[queue] + 1) % every == 0
        self._oldest = bool(oldest)
        held_back = False
        if queue in self._limited:
            async with conn.transaction():
                await conn.execute(q.LOCK_QUEUE, {"queue": queue})
                rows = await (await conn.execute(
                    q.CLAIM_LIMITED_OLDEST if oldest else q.CLAIM_LIMITED, params)).fetchall()
                if len(rows) < want:
                    held_back = bool((await (await conn.execute(q.HELD_BACK, params))
                                      .fetchone() or [False])[0])
        else:
            rows = await (await conn.execute(q.CLAIM_OLDEST if oldest else q.CLAIM,
                                             params)).fetchall()
        if rows:  # claims that find nothing (an empty queue, a limit reached) do not count
            self._claims[queue] += 1
            if self._skipped:
                for row in rows:  # a job skipped before was claimed: the fault has gone
                    self._skipped.claimed(row[0])
        return rows, held_back
