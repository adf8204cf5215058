"""The completer: records outcomes of attempts in fenced batches.

The completer writes every outcome that piled up while its previous write ran, in one
statement (``RECORD_OUTCOMES``), so a busy worker spends far less than one round trip per job.
A failed write is retried on a fresh connection until it lands: an outcome is never dropped
while the worker lives, and fencing makes a late or repeated write harmless.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from ..db import Database, ReconnectDelay, close_quietly, connection_lost
from ..outcome import Outcome, outcome_params
from .heartbeat import Leases

log = logging.getLogger("skipjack.worker")


@dataclass
class WorkerStats:
    """Counters since the worker started."""

    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    discarded: int = 0
    released: int = 0
    stale_writes: int = 0  # outcome writes rejected by fencing
    leases_lost: int = 0


# While other jobs are still running, a batch smaller than LINGER_BATCH waits LINGER seconds
# for more outcomes before it is written: short jobs then share one statement (and one
# commit) per few milliseconds instead of one per job or two.
LINGER = 0.005
LINGER_BATCH = 100


class Completer:
    """Records outcomes in batches on a connection of its own.

    Args:
        db: the app's database.
        leases: the running set; a job leaves it once its outcome is written.
        stats: counters to update.
        more_coming: whether more outcomes are on their way (jobs still running); a small
            batch then waits ``LINGER`` seconds to grow before it is written.
        on_written: called after each batch is written (the worker may claim again).
    """

    def __init__(self, db: Database, leases: Leases, stats: WorkerStats,
                 more_coming: Callable[[], bool] = lambda: False,
                 on_written: Callable[[], None] = lambda: None) -> None:
        self._db = db
        self._more_coming = more_coming
        self._on_written = on_written
        self._leases = leases
        self._stats = stats
        self._pending: list[Outcome] = []
        self._writing = False
        self._ready = asyncio.Event()
        self._flushed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, outcome: Outcome) -> None:
        """Queue an outcome for the next batch."""
        self._leases.finishing(outcome.id, outcome.lease_version)
        self._pending.append(outcome)
        self._ready.set()

    async def flush(self) -> None:
        """Wait until every submitted outcome is written."""
        self._ready.set()
        while self._pending or self._writing:
            self._flushed.clear()
            await self._flushed.wait()

    async def run(self) -> None:
        """Write batches until cancelled."""
        conn: psycopg.AsyncConnection[Any] | None = None
        backoff = ReconnectDelay()
        try:
            while True:
                await self._ready.wait()
                if len(self._pending) < LINGER_BATCH and self._more_coming():
                    await asyncio.sleep(LINGER)  # let the batch grow: fewer statements
                self._ready.clear()
                while self._pending:
                    batch = sorted(self._pending[:1000], key=lambda o: o.id)  # lock order
                    self._writing = True
                    try:
                        if conn is None or conn.closed:
                            conn = await self._db.connect_async()
                        cur = await conn.execute(self._db.queries.RECORD_OUTCOMES,
                                                 outcome_params(batch))
                        applied = dict(await cur.fetchall())
                        backoff.reset()
                    except psycopg.Error as exc:
                        if connection_lost(exc) or conn is None or conn.broken:
                            await close_quietly(conn)
                            conn = None
                            delay = backoff.next()
                            log.warning("recording %d outcomes failed: %s (retrying in %.1fs)",
                                        len(batch), str(exc).strip(), delay)
                            await asyncio.sleep(delay)
                            continue
                        # the server refused the statement itself: write the batch one by
                        # one so that one bad outcome cannot hold back the others
                        log.warning("recording %d outcomes refused: %s; recording them one by "
                                    "one", len(batch), str(exc).strip())
                        try:
                            applied = await self._one_by_one(conn, batch)
                        except psycopg.Error:
                            await close_quietly(conn)
                            conn = None
                            await asyncio.sleep(backoff.next())
                            continue
                    finally:
                        self._writing = False
                    done = {o.id for o in batch}
                    self._pending = [o for o in self._pending if o.id not in done]
                    for o in batch:
                        self._leases.remove(o.id, o.lease_version)
                        self.count(o, applied.get(o.id))
                    self._on_written()
                self._flushed.set()
        finally:
            await close_quietly(conn)

    async def _one_by_one(self, conn: psycopg.AsyncConnection[Any],
                          batch: list[Outcome]) -> dict[int, str]:
        """Write each outcome alone: three tries as it is (the refusal may pass), then three
        without its result and error (they may be what the database refuses). An outcome
        refused all six times is dropped with an error log; its lease then expires and the
        rescuer returns the job."""
        applied: dict[int, str] = {}
        for o in batch:
            for i, attempt in enumerate((o, o, o, _stripped(o), _stripped(o), _stripped(o))):
                try:
                    cur = await conn.execute(self._db.queries.RECORD_OUTCOMES,
                                             outcome_params([attempt]))
                    applied.update(dict(await cur.fetchall()))
                    break
                except psycopg.Error as exc:
                    if connection_lost(exc):
                        raise
                    log.error("job %s: outcome refused by the database (try %d of 6): %s",
                              o.id, i + 1, str(exc).strip())
                    await asyncio.sleep(0.1 * (i + 1))
        return applied

    def count(self, o: Outcome, state: str | None) -> None:
        """Account for an outcome that was written (``state``: the job's new state) or
        rejected as stale (``state`` None)."""
        if state is None:
            self._stats.stale_writes += 1
            log.warning("job %s: stale %s rejected (lease_version %s is no longer current)",
                        o.id, o.kind, o.lease_version)
        elif o.kind == "complete":
            self._stats.succeeded += 1
        elif o.kind == "release":
            self._stats.released += 1
        elif state == "cancelled":
            log.info("job %s cancelled", o.id)
        elif state == "discarded":
            self._stats.discarded += 1
            log.warning("job %s discarded (dead letter)", o.id)
        else:
            self._stats.retried += 1  # the stager makes it runnable when its delay is over
            log.info("job %s: attempt failed, retrying in %.1fs", o.id, o.delay)


def _stripped(o: Outcome) -> Outcome:
    """The outcome without what the database refused to store."""
    note = json.dumps({"attempt": None, "error": "the outcome's result or error could not be "
                       "stored and was dropped"})
    return Outcome(o.id, o.lease_version, o.queue, o.kind, o.delay, None, note)
