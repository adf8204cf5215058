"""The heartbeat thread: renews the leases of running jobs and hears cancellation requests.

It has its own thread and its own connection, so it keeps renewing while a sync handler
holds the GIL in long stretches or an async handler blocks the event loop, and it never waits
for a connection that handlers use. A second small thread gives up the leases it could not
renew in time, even while a renewal hangs (a lock wait, or a network that drops packets).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from ..context import Job
from ..db import Database, ReconnectDelay, connection_lost
from ..sql.outcomes import PREPARE_HEARTBEAT

log = logging.getLogger("skipjack.heartbeat")

PROGRESS_INTERVAL = 1.0  # seconds: the most often a job's progress is written


@dataclass(slots=True)
class Lease:
    """One running job as the heartbeat sees it."""

    id: int
    lease_version: int
    lease: float  # seconds
    renewed_at: float  # time.monotonic() of the last confirmed renewal (or of the claim)
    finishing: bool = False  # the handler ended; its outcome is waiting to be written
    # A claim-mode job, claimed in a transaction still open: the heartbeat does not see the
    # claim (nothing to renew, nothing lost) until its handler commits it itself; it is then
    # renewed like any other.
    uncommitted: bool = False
    progress: str | None = None  # a progress report not written yet (JSON text)


@dataclass
class Leases:
    """The worker's running jobs, shared between the event loop and the heartbeat thread."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    by_id: dict[int, Lease] = field(default_factory=dict)

    def add(self, job_id: int, lease_version: int, lease: float,
            uncommitted: bool = False) -> None:
        """Hold a claimed job (its lease of ``lease`` seconds starts now); ``uncommitted``
        for a claim-mode job (see ``Lease``)."""
        with self.lock:
            self.by_id[job_id] = Lease(job_id, lease_version, lease, time.monotonic(),
                                       uncommitted=uncommitted)

    def add_jobs(self, jobs: Iterable[Job]) -> None:
        """Hold the claimed ``jobs`` (their leases start now): ``add`` for each, under one
        acquisition of the lock."""
        now = time.monotonic()
        with self.lock:
            by_id = self.by_id
            for job in jobs:
                by_id[job.id] = Lease(job.id, job.lease_version, job.lease, now)

    def finishing(self, job_id: int, lease_version: int) -> None:
        with self.lock:
            lease = self.by_id.get(job_id)
            if lease is not None and lease.lease_version == lease_version:
                lease.finishing = True

    def report(self, job_id: int, lease_version: int, progress: str) -> None:
        """A handler reported progress (JSON text): the heartbeat thread writes it."""
        with self.lock:
            lease = self.by_id.get(job_id)
            if lease is not None and lease.lease_version == lease_version:
                lease.progress = progress

    def take_progress(self) -> list[tuple[int, int, str]]:
        """The progress reports not written yet, (id, lease_version, JSON text), cleared."""
        out = []
        with self.lock:
            for x in self.by_id.values():
                if x.progress is not None:
                    out.append((x.id, x.lease_version, x.progress))
                    x.progress = None
        return out

    def put_back_progress(self, reports: list[tuple[int, int, str]]) -> None:
        """Reports that could not be written (the row was locked): written next time, unless
        a newer report came meanwhile or the job is no longer held."""
        with self.lock:
            for job_id, lease_version, progress in reports:
                lease = self.by_id.get(job_id)
                if (lease is not None and lease.lease_version == lease_version
                        and lease.progress is None):
                    lease.progress = progress

    def remove(self, job_id: int, lease_version: int) -> None:
        """Let go of a job held under ``lease_version`` (not of a later claim of it)."""
        self.remove_many(((job_id, lease_version),))

    def remove_many(self, held: Iterable[tuple[int, int]]) -> None:
        """``remove`` for each (job id, lease_version), under one acquisition of the lock."""
        with self.lock:
            by_id = self.by_id
            for job_id, lease_version in held:
                lease = by_id.get(job_id)
                if lease is not None and lease.lease_version == lease_version:
                    del by_id[job_id]

    def snapshot(self) -> list[Lease]:
        with self.lock:
            return [Lease(x.id, x.lease_version, x.lease, x.renewed_at, x.finishing,
                          x.uncommitted) for x in self.by_id.values()]

    def __len__(self) -> int:
        with self.lock:
            return len(self.by_id)


class HeartbeatThread(threading.Thread):
    """Renews the leases of this worker's running jobs every ``interval`` seconds, each by
    the lease it was claimed with (``Lease.lease``).

    Args:
        db: the app's database.
        leases: the shared running set.
        interval: seconds between renewals (< lease / 2, checked by the worker).
        on_lost: called (from this thread) with (job id, lease_version, reason) for a job whose
            lease this worker no longer holds: the renewal found the token changed, or no
            renewal succeeded for a whole lease period (the database was unreachable or the
            process was stopped).
        on_cancel: called (from this thread) with (job id, lease_version) for a job whose
            cancellation was requested.
    """

    def __init__(
        self,
        db: Database,
        leases: Leases,
        *,
        interval: float,
        on_lost: Callable[[int, int, str], None],
        on_cancel: Callable[[int, int], None],
    ) -> None:
        super().__init__(name="skipjack-heartbeat", daemon=True)
        self._db = db
        self._leases = leases
        self._interval = interval
        self._on_lost = on_lost
        self._on_cancel = on_cancel
        self._stop_event = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        self._reconnect = ReconnectDelay()
        self._cancelled: set[tuple[int, int]] = set()

    def stop(self) -> None:
        """Ask the thread to end after its current step."""
        self._stop_event.set()

    def run(self) -> None:
        tick = min(self._interval, PROGRESS_INTERVAL)
        watch = threading.Thread(target=self._watch, args=(tick,), daemon=True,
                                 name="skipjack-lease-watch")
        watch.start()
        last_beat = last_progress = time.monotonic()
        while not self._stop_event.wait(tick):
            try:
                if time.monotonic() - last_progress >= PROGRESS_INTERVAL - tick / 2:
                    last_progress = time.monotonic()
                    self._write_progress()
                if time.monotonic() - last_beat < self._interval - tick / 2:
                    continue
                last_beat = time.monotonic()
                self._beat()
                if self._reconnect.reset():
                    log.info("heartbeat: the database is reachable again")
            except psycopg.Error as exc:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                log.warning("heartbeat: %s (retrying in %.1fs)", str(exc).strip(),
                            self._reconnect.peek())
                self._stop_event.wait(self._reconnect.next())
            except Exception:  # never let the renewals stop
                log.exception("heartbeat failed; retrying")
        if self._conn is not None:
            self._conn.close()
        watch.join()

    def _watch(self, tick: float) -> None:
        """Expire the leases not renewed for a whole lease period, every ``tick`` seconds,
        in a thread of its own: a renewal can hang for as long as the connection's TCP
        timeouts allow (30 s: ``tcp_user_timeout``) when the network drops the packets
        without a word, and the handlers of jobs that other workers may have rescued
        meanwhile must not run on for that long."""
        while not self._stop_event.wait(tick):
            try:
                self._expire_local()
            except Exception:  # never let the expiry stop
                log.exception("lease expiry failed; retrying")

    def _write_progress(self) -> None:
        """Write the progress reports made since the last tick, in one statement. A report
        the database cannot take (a character its encoding lacks, say) is dropped with a
        warning, so that it holds back neither the other reports nor the renewals.

        Raises:
            psycopg.Error: the connection was lost (the reports are kept for the next tick).
        """
        pending = self._leases.take_progress()
        if not pending:
            return
        try:
            written = self._record_progress(pending)
        except Exception as exc:
            if isinstance(exc, psycopg.Error) and (connection_lost(exc) or self._broken()):
                self._leases.put_back_progress(pending)
                raise
            written = self._record_progress_each(pending)
        except BaseException:
            self._leases.put_back_progress(pending)
            raise
        self._leases.put_back_progress([r for r in pending if r[0] not in written])

    def _broken(self) -> bool:
        return self._conn is None or self._conn.broken

    def _record_progress(self, reports: list[tuple[int, int, str]]) -> set[int]:
        """Write ``reports`` (job id, lease_version, JSON text) in one statement; the ids
        written (a job whose lease this worker lost, or whose row is locked, is not)."""
        if self._conn is None or self._conn.closed:
            self._conn = self._db.connect()
        # the reports are JSON text already: one array of objects, built as text
        body = ",".join(f'{{"id":{i},"lease_version":{v},"progress":{p}}}'
                        for i, v, p in reports)
        return {r[0] for r in self._conn.execute(self._db.queries.RECORD_PROGRESS,
                                                 {"progress": f"[{body}]"}).fetchall()}

    def _record_progress_each(self, reports: list[tuple[int, int, str]]) -> set[int]:
        """Write each report alone, after their batch was refused; drop those refused
        (counted as written). Raises psycopg.Error when the connection is lost, with the
        reports not yet written put back."""
        written: set[int] = set()
        for n, report in enumerate(reports):
            try:
                written |= self._record_progress([report])
            except Exception as exc:
                if isinstance(exc, psycopg.Error) and (connection_lost(exc) or self._broken()):
                    self._leases.put_back_progress(reports[n:])
                    raise
                log.warning("progress of job %d could not be written, dropped: %s", report[0],
                            str(exc).strip())
                written.add(report[0])
        return written

    def _beat(self) -> None:
        started = time.monotonic()
        held = self._leases.snapshot()
        if not held:
            return
        if self._conn is None or self._conn.closed:
            self._conn = self._db.connect()
        rows = self._conn.execute(
            self._db.queries.HEARTBEAT,
            {"id": [x.id for x in held], "lease_version": [x.lease_version for x in held],
             "lease": [x.lease for x in held]},
            prepare=PREPARE_HEARTBEAT,
        ).fetchall()
        # job id -> cancel_requested, or None for a job still held but locked by another
        # transaction (not renewed this time); a job missing from the rows lost its lease
        still_held = {job_id: cancel for job_id, cancel in rows}
        lost, cancel = [], []
        with self._leases.lock:
            for x in held:
                current = self._leases.by_id.get(x.id)
                if current is None or current.lease_version != x.lease_version:
                    continue
                if x.id in still_held:
                    if still_held[x.id] is None:
                        continue
                    current.renewed_at = started
                    if still_held[x.id] and (x.id, x.lease_version) not in self._cancelled:
                        cancel.append(x)
                elif current.uncommitted:
                    current.renewed_at = started  # not visible yet: nobody else can take it
                elif not current.finishing:
                    del self._leases.by_id[x.id]
                    lost.append(x)
        for x in lost:
            self._on_lost(x.id, x.lease_version, "lease lost: the job was rescued or re-claimed")
        for x in cancel:
            self._cancelled.add((x.id, x.lease_version))
            self._on_cancel(x.id, x.lease_version)

    def _expire_local(self) -> None:
        """A lease not renewed for a whole lease period may belong to another worker now."""
        now = time.monotonic()
        with self._leases.lock:
            expired = [x for x in self._leases.by_id.values()
                       if not x.finishing and now - x.renewed_at > x.lease]
            for x in expired:
                del self._leases.by_id[x.id]
        for x in expired:
            self._on_lost(x.id, x.lease_version,
                          f"lease expired: not renewed for {now - x.renewed_at:.1f}s")
