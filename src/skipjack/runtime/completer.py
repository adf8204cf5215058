"""The completer: records outcomes of attempts in fenced batches.

The completer writes every outcome that piled up while its previous write ran, in one
statement (``RECORD_OUTCOMES``), so a busy worker spends far less than one round trip per job;
while jobs still run, a small batch first waits a little for more (``linger``), and no longer
than until the outcome of the last job the worker holds comes in.
A failed write is retried on a fresh connection until it lands: an outcome is never dropped
while the worker lives, and fencing makes a late or repeated write harmless.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any

import psycopg
from psycopg._encodings import pg2pyenc

from ..db import Database, ReconnectDelay, close_quietly, connection_lost
from ..jobs import scrub_text
from ..outcome import Outcome, outcome_params
from .heartbeat import Leases

log = logging.getLogger("skipjack.worker")


# While other jobs are still running, a batch smaller than LINGER_BATCH waits LINGER seconds
# for more outcomes before it is written: short jobs then share one statement (and one
# commit) per few milliseconds instead of one per job or two. Where the slots finish jobs
# too slowly for that to gather more than a couple (a few ms each, few slots: a worker of
# concurrency 1 running 2 ms jobs wrote 4 outcomes a statement on average), the batch
# waits instead as long as the slots take to finish LINGER_OUTCOMES more, up to LINGER_MAX,
# as long as they finish at least LINGER_GAIN jobs in LINGER_MAX (see ``linger``;
# docs/performance.md, "The outcome linger").
LINGER = 0.005
LINGER_MAX = 0.02
LINGER_OUTCOMES = 8
LINGER_GAIN = 4
LINGER_BATCH = 100


def linger(run_time: float | None, concurrency: int) -> float:
    """Seconds a small batch waits for more outcomes.

    Args:
        run_time: the handlers' average run time in seconds; None before the first ended.
        concurrency: the worker's slots.

    Returns:
        The time the slots take to finish LINGER_OUTCOMES jobs (``LINGER_OUTCOMES *
        run_time / concurrency``), at least LINGER and at most LINGER_MAX; LINGER itself
        before the first job ended, or where the slots finish fewer than LINGER_GAIN jobs in
        LINGER_MAX (a longer wait would gather little and hold each outcome of slow jobs
        back). Before, a wait over LINGER_MAX fell back to LINGER: 2 ms handlers that took
        2.6 ms on a loaded machine (``asyncio.sleep(0.002)``, 8 processes of concurrency 1)
        waited 5 ms instead of 20 and wrote under 3 outcomes a statement."""
    if run_time is None or concurrency * LINGER_MAX < LINGER_GAIN * run_time:
        return LINGER
    return min(max(LINGER_OUTCOMES * run_time / concurrency, LINGER), LINGER_MAX)


class Completer:
    """Records outcomes in batches on a connection of its own.

    Args:
        db: the app's database.
        leases: the running set; a job leaves it once its outcome is written.
        report: called with each outcome written (and the job's new state and run_at) or
            rejected as stale (state None).
        more_coming: whether more outcomes are on their way (jobs still running); a small
            batch then waits ``wait()`` seconds to grow before it is written.
        wait: how long such a batch waits, in seconds (the worker's: ``linger`` of its
            handlers' average run time and its concurrency).
        on_written: called with each batch once it is written (the worker may claim again:
            a queue's concurrency limit no longer counts those jobs).
        drained: whether no job runs or waits for a slot: a batch waiting for more ends its
            wait when an outcome comes in and this is true (the last job of a burst).
    """

    def __init__(self, db: Database, leases: Leases,
                 report: Callable[[Outcome, str | None, datetime | None], None],
                 more_coming: Callable[[], bool] = lambda: False,
                 on_written: Callable[[list[Outcome]], None] = lambda batch: None,
                 wait: Callable[[], float] = lambda: LINGER,
                 drained: Callable[[], bool] = lambda: True) -> None:
        self._db = db
        self._more_coming = more_coming
        self._drained = drained
        self._wait = wait
        self._on_written = on_written
        self._leases = leases
        self._report = report
        self._pending: list[Outcome] = []
        self._refused: dict[tuple[int, int], tuple[int, str]] = {}  # refusals, the last one
        self._writing = False
        self._ready = asyncio.Event()
        self._last = asyncio.Event()  # an outcome came in with no job left (``drained``)
        self._flushed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, outcome: Outcome) -> None:
        """Queue an outcome for the next batch."""
        self._leases.finishing(outcome.id, outcome.lease_version)
        self._pending.append(outcome)
        self._ready.set()
        if self._drained():
            self._last.set()  # a linger waiting for more outcomes ends now

    async def flush(self) -> None:
        """Wait until every submitted outcome is written (a batch waiting for more is
        written at once)."""
        self._ready.set()
        self._last.set()
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
                    # let the batch grow (fewer statements) until the wait is over or the
                    # outcome of the worker's last job came in
                    self._last.clear()
                    try:
                        await asyncio.wait_for(self._last.wait(), self._wait())
                    except TimeoutError:
                        pass
                self._ready.clear()
                while self._pending:
                    batch = sorted(self._pending[:1000], key=lambda o: o.id)  # lock order
                    self._writing = True
                    try:
                        if conn is None or conn.closed:
                            conn = await self._db.connect_async()
                        q = self._db.queries
                        cur = await conn.execute(q.record_outcomes(len(batch)),
                                                 outcome_params(batch),
                                                 prepare=q.prepare_outcomes(len(batch)))
                        applied = {r[0]: (r[1], r[2]) for r in await cur.fetchall()}
                        if backoff.reset():
                            log.info("completer: the database is reachable again; "
                                     "recording outcomes")
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
                            applied, batch, kept = await self._one_by_one(conn, batch)
                        except psycopg.Error:
                            await close_quietly(conn)
                            conn = None
                            await asyncio.sleep(backoff.next())
                            continue
                        if kept:  # the others are written: try those again shortly
                            await asyncio.sleep(RETRY_REFUSED)
                    finally:
                        self._writing = False
                    done = {o.id for o in batch}
                    self._pending = [o for o in self._pending if o.id not in done]
                    self._leases.remove_many((o.id, o.lease_version) for o in batch)
                    for o in batch:
                        self._report(o, *applied.get(o.id, (None, None)))
                    self._on_written(batch)
                    if self._pending and len(self._pending) < LINGER_BATCH \
                            and self._more_coming():
                        # what came in during the write waits to grow as well, rather than
                        # go out as a statement of one or two outcomes
                        self._ready.set()
                        break
                self._flushed.set()
        finally:
            await close_quietly(conn)

    async def _one_by_one(self, conn: psycopg.AsyncConnection[Any], batch: list[Outcome]
                          ) -> tuple[dict[int, tuple[str, datetime]], list[Outcome],
                                     list[Outcome]]:
        """Write each outcome of a refused batch alone, so that one the database refuses
        holds back no other. A refused outcome is kept for the next rounds: written as it is
        up to ``TRIES_AS_IS`` times (the refusal may pass), then without its result and
        with its delay capped at an hour, its error kept and a note of the refusal added
        (``_safe``), then as a discard with only the note; refused still, it is given up
        (its lease expires and the rescuer returns the job). A lock or statement timeout
        does not count as a refusal.

        Returns:
            (job id -> (new state, run_at) for the rows written, the outcomes written, the
            outcomes kept for a later round). An outcome given up is taken from the pending
            ones here.

        Raises:
            psycopg.Error: the connection was lost.
        """
        applied: dict[int, tuple[str, datetime]] = {}
        settled: list[Outcome] = []
        kept: list[Outcome] = []
        q = self._db.queries
        for o in batch:
            key = (o.id, o.lease_version)
            refused, refusal = self._refused.get(key, (0, ""))
            if refused >= TRIES_AS_IS + 2:
                log.error("job %s: no form of its outcome was taken; its lease will expire and "
                          "the rescuer will return it", o.id)
                self._refused.pop(key, None)
                self._leases.remove(o.id, o.lease_version)
                self._pending.remove(o)
                continue
            form = o if refused < TRIES_AS_IS else _safe(o, refusal,
                                                         discard=refused > TRIES_AS_IS,
                                                         encoding=_server_encoding(conn))
            try:
                cur = await conn.execute(q.RECORD_OUTCOMES, outcome_params([form]))
                applied.update({r[0]: (r[1], r[2]) for r in await cur.fetchall()})
                self._refused.pop(key, None)
                settled.append(form)
            except psycopg.Error as exc:
                if connection_lost(exc):
                    raise
                if not isinstance(exc, _TRANSIENT):
                    refusal = str(exc).strip()
                    self._refused[key] = (refused + 1, refusal)
                    log.error("job %s: its %s was refused by the database: %s", o.id, o.kind,
                              refusal)
                kept.append(o)
        return applied, settled, kept


# Refusals that say nothing about the outcome itself: it is written again later.
_TRANSIENT = (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable,
              psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)

SAFE_DELAY_MAX = 3600.0

# A refused outcome is written as it is this many times, RETRY_REFUSED seconds apart, before
# skipjack stores it in a form the database should take (see Completer._one_by_one).
TRIES_AS_IS = 3
RETRY_REFUSED = 0.1


def _server_encoding(conn: psycopg.AsyncConnection[Any]) -> str:
    """Python's name of the database's encoding (the connection's own is UTF-8), "utf-8"
    when it is not known."""
    name = conn.info.parameter_status("server_encoding")
    try:
        return pg2pyenc(name.encode()) if name else "utf-8"
    except (psycopg.NotSupportedError, LookupError):
        return "utf-8"


def _safe(o: Outcome, refusal: str, *, discard: bool, encoding: str = "utf-8") -> Outcome:
    """A form of a refused outcome that the database should take: without the result and
    the progress, the delay capped at SAFE_DELAY_MAX seconds, the handler's error (message and
    traceback) kept, with characters the connection's ``encoding`` (Python's name of it)
    lacks replaced, and a note of the refusal added; with ``discard``, a discard with only
    the note."""
    note = f"the outcome ({o.kind}) was refused by the database: {refusal[:1000]}"
    entry: dict[str, Any] = {"attempt": None, "error": note}
    if not discard and o.error is not None:
        try:
            original = json.loads(o.error)
            entry = {"attempt": original.get("attempt"),
                     "error": str(original.get("error", ""))[:4000] + f" ({note})",
                     "traceback": str(original.get("traceback", ""))[-16_000:]}
        except (ValueError, AttributeError):
            pass
    def fit(text: str) -> str:
        return scrub_text(text).encode(encoding, "replace").decode(encoding)

    error = json.dumps({k: fit(v) if isinstance(v, str) else v for k, v in entry.items()},
                       ensure_ascii=False)
    if discard:
        return replace(o, kind="discard", delay=0.0, result=None, error=error, progress=None)
    return replace(o, delay=min(o.delay, SAFE_DELAY_MAX), result=None, error=error,
                   progress=None)
