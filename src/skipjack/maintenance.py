"""Maintenance that any worker may run at any time, alone or with many others at once.

- the stager makes due scheduled jobs available and wakes their queues;
- the rescuer returns jobs whose lease expired to their queue, or to the dead letter;
- the cron scheduler enqueues each due slot once (see :mod:`skipjack.cron`);
- the pruner deletes finished jobs past their retention.

None of them needs a leader: each takes its rows with ``SKIP LOCKED`` (so none
waits on, or deadlocks with, workers or one another), and uniqueness in the database makes
duplicates impossible. The rescuer reads only the job row (lease expiry and fencing token),
never a worker registry, so a crashed worker's jobs are recovered whatever name the next
worker has.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from .completer import connection_lost
from .cron import schedule_due
from .migrate import channel_name
from .queries import Queries
from .reconnect import Backoff as ReconnectBackoff

if TYPE_CHECKING:
    from .app import App

log = logging.getLogger("skipjack.maintenance")
BATCH = 1000


def rescue(conn: psycopg.Connection[Any], queries: Queries,
           limit: int = BATCH) -> list[tuple[int, str]]:
    """Rescue up to ``limit`` jobs whose lease expired.

    Step 1 reads the candidates and their fencing tokens; step 2 moves each one only if it is
    still running under that token with an expired lease (a completion or re-claim that
    landed in between is never overwritten).

    Returns:
        (job id, new state) for each job moved: ``available``, or ``discarded`` when that was
        its last attempt.

    Raises:
        psycopg.Error: the database could not be reached; nothing was changed.
    """
    candidates = conn.execute(queries.RESCUE_CANDIDATES, {"limit": limit}).fetchall()
    if not candidates:
        return []
    rows = conn.execute(
        queries.RESCUE,
        {"id": [c[0] for c in candidates], "lease_version": [c[1] for c in candidates]},
    ).fetchall()
    for job_id, state, _ in rows:
        log.warning("rescued job %s (lease expired) -> %s", job_id, state)
    notify(conn, queries, {queue for _, state, queue in rows if state == "available"})
    return [(r[0], r[1]) for r in rows]


def notify(conn: psycopg.Connection[Any], queries: Queries, queues: set[str]) -> None:
    """Wake the workers of ``queues`` (delivered when ``conn``'s transaction commits)."""
    if queues:
        conn.execute(queries.NOTIFY_QUEUES, {"channel": channel_name(queries.schema),
                                             "queues": sorted(queues)})


def stage(conn: psycopg.Connection[Any], queries: Queries, schema: str,
          limit: int = BATCH) -> dict[str, int]:
    """Make up to ``limit`` due scheduled jobs available; returns {queue: jobs staged}."""
    rows = conn.execute(queries.STAGE, {"limit": limit,
                                        "channel": channel_name(schema)}).fetchall()
    return {r[0]: r[1] for r in rows}


def prune(conn: psycopg.Connection[Any], queries: Queries, *, retention: float,
          discarded_retention: float | None = None, limit: int = BATCH) -> int:
    """Delete finished jobs past their retention, one batch per state group.

    Args:
        retention: seconds to keep succeeded and cancelled jobs.
        discarded_retention: seconds to keep discarded jobs (the dead letter); None keeps
            them for ten times ``retention``.
        limit: the most rows deleted per group in this call.

    Returns:
        The number of jobs deleted.
    """
    deleted = 0
    for states, age in ((["succeeded", "cancelled"], retention),
                        (["discarded"], 10 * retention if discarded_retention is None
                         else discarded_retention)):
        rows = conn.execute(queries.PRUNE, {"age": age, "states": states,
                                            "limit": limit}).fetchall()
        deleted += len(rows)
    conn.execute(queries.PRUNE_CRON, {"age": max(retention, 86400.0)})
    return deleted


def _stage_and_wake(conn: psycopg.Connection[Any], app: App,
                    on_staged: Callable[[str], None]) -> None:
    """Stage batch after batch (at most 50 per run) while full batches come back."""
    for _ in range(50):
        staged = stage(conn, app.queries, app.schema)
        for queue in staged:
            on_staged(queue)
        if sum(staged.values()) < BATCH:
            return


@dataclass
class Duty:
    """One periodic task of the maintenance thread."""

    name: str
    interval: float  # seconds
    run: Callable[[psycopg.Connection[Any]], object]
    next_at: float = 0.0


class Maintenance(threading.Thread):
    """Runs the stager, rescuer, cron scheduler and pruner on a connection of its own.

    Args:
        app: the application.
        stage_interval, rescue_interval: seconds.
        retention: seconds to keep finished jobs (None: this worker does not prune).
        discarded_retention: seconds to keep discarded jobs (see :func:`prune`).
        on_staged: called (from this thread) with each queue that got runnable jobs.

    Each duty's first run is at a random point of its first interval and later runs are
    jittered by +-20%, so many workers spread out.
    """

    def __init__(self, app: App, *, stage_interval: float, rescue_interval: float,
                 retention: float | None, discarded_retention: float | None,
                 on_staged: Callable[[str], None]) -> None:
        super().__init__(name="skipjack-maintenance", daemon=True)
        self._app = app
        self._stop_event = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        q = app.queries
        self._duties = [
            Duty("stager", stage_interval, lambda c: _stage_and_wake(c, app, on_staged)),
            Duty("rescuer", rescue_interval, lambda c: rescue(c, q)),
        ]
        if app.crons:
            self._duties.append(Duty("cron", 1.0, lambda c: schedule_due(app, c)))
        if retention is not None:
            self._duties.append(Duty("pruner", 10.0, lambda c: prune(
                c, q, retention=retention, discarded_retention=discarded_retention)))
        now = time.monotonic()
        for duty in self._duties:
            duty.next_at = now + duty.interval * random.uniform(0.1, 1.0)

    def stop(self) -> None:
        """Ask the thread to end after its current step."""
        self._stop_event.set()

    def run(self) -> None:
        backoff = ReconnectBackoff()
        tick = min(d.interval for d in self._duties)
        while not self._stop_event.wait(tick):
            for duty in self._duties:
                if time.monotonic() < duty.next_at or self._stop_event.is_set():
                    continue
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = self._app.connect()
                    duty.run(self._conn)
                    backoff.reset()
                except psycopg.Error as exc:
                    if self._conn is not None and not self._conn.broken \
                            and not connection_lost(exc):
                        # the database refused the statement (e.g. a foreign key of the
                        # application's blocks a prune): the connection is fine, and the
                        # other duties must not wait for this one
                        log.warning("%s: %s (it runs again at its next interval)",
                                    duty.name, str(exc).strip())
                    else:
                        if self._conn is not None:
                            self._conn.close()
                            self._conn = None
                        log.warning("%s: %s (retrying in %.1fs)", duty.name,
                                    str(exc).strip(), backoff.peek())
                        self._stop_event.wait(backoff.next())
                        continue  # the other duties still get their turn
                except Exception:  # a bug in one duty must not stop the others
                    log.exception("%s failed; it runs again at its next interval", duty.name)
                duty.next_at = time.monotonic() + duty.interval * random.uniform(0.8, 1.2)
        if self._conn is not None:
            self._conn.close()
