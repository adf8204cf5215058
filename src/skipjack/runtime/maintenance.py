"""Maintenance that any worker may run at any time, alone or with many others at once.

- the stager makes due scheduled jobs available and wakes their queues;
- the rescuer returns jobs whose lease expired to their queue, or to the dead letter;
- the cron scheduler enqueues each due slot once (``schedule_due``);
- the pruner deletes finished jobs past their retention;
- the throughput rollup counts finished jobs per minute for the dashboard's charts
  (``skipjack.admin.rollup``);
- the notification queue's watch (``NotifyQueueWatch``) warns while PostgreSQL's
  notification queue is so full that wake-ups are skipped, naming the likely cause;
- the analysis after growth (``GrowthAnalysis``) ANALYZEs the jobs table soon after it has
  grown a lot, so that statements are planned for its size;
- the registry (``Registry``) keeps this worker's row in the live worker registry fresh
  and removes the rows of workers that are gone (only for people: nothing reads it to
  recover jobs).

None of them needs a leader: each takes its rows with ``SKIP LOCKED`` (so none
waits on, or deadlocks with, workers or one another), and uniqueness in the database makes
duplicates impossible (the analysis after growth, which has no rows to take, tries an
advisory lock instead and skips its turn while another worker holds it, or while any
session holds a lock its ANALYZE would wait for). The rescuer reads
only the job row (lease expiry and fencing token), never a worker registry, so a crashed
worker's jobs are recovered whatever name the next worker has.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

import psycopg

from ..admin import BATCH, notify, prune, rollup
from ..app import App
from ..channels import channel_name
from ..cron import plan
from ..db import Database, ReconnectDelay, connection_lost
from ..sql import Queries
from ..sql.arrays import number_array
from .skips import SkipList

log = logging.getLogger("skipjack.maintenance")


# Seconds between checks of the notification queue, and between repeats of its warning.
NOTIFY_CHECK_INTERVAL = 5.0
NOTIFY_WARN_EVERY = 60.0

# Seconds between runs of the throughput rollup (the dashboard's charts).
ROLLUP_INTERVAL = 15.0


def rescue(conn: psycopg.Connection[Any], queries: Queries, limit: int = BATCH,
           skipped: SkipList | None = None) -> list[tuple[int, str]]:
    """Rescue up to ``limit`` jobs whose lease expired.

    Step 1 reads the candidates and their fencing tokens; step 2 moves each one only if it is
    still running under that token with an expired lease (a completion or re-claim that
    landed in between is never overwritten).

    With ``skipped`` (the maintenance thread's), a batch the database refuses is rescued job
    by job, and the jobs it fails on are skipped for a while (see
    ``skipjack.runtime.skips``), so that one job a trigger refuses holds up no other.

    Returns:
        (job id, new state) for each job moved: ``available``, or ``discarded`` when that was
        its last attempt.

    Raises:
        psycopg.Error: the database could not be reached, or refused the batch (without
            ``skipped``); nothing was changed.
    """
    candidates = conn.execute(queries.RESCUE_CANDIDATES, {"limit": limit}).fetchall()
    if skipped:
        skip = set(skipped.ids())
        candidates = [c for c in candidates if c[0] not in skip]
    if not candidates:
        return []
    try:
        rows = conn.execute(
            queries.RESCUE,
            {"id": [c[0] for c in candidates], "lease_version": [c[1] for c in candidates]},
        ).fetchall()
    except psycopg.Error as exc:
        if skipped is None or connection_lost(exc):
            raise
        rows = []
        for job_id, lease_version in candidates:
            try:
                rows += conn.execute(queries.RESCUE, {"id": [job_id],
                                                      "lease_version": [lease_version]}
                                     ).fetchall()
            except psycopg.Error as one:
                if connection_lost(one):
                    raise
                skipped.add(job_id, str(one).strip(), "rescuing it")
    for job_id, state, _ in rows:
        log.warning("rescued job %s (lease expired) -> %s", job_id, state)
    notify(conn, queries, {queue for _, state, queue in rows if state == "available"})
    return [(r[0], r[1]) for r in rows]


def stage(conn: psycopg.Connection[Any], queries: Queries, schema: str,
          limit: int = BATCH, skipped: SkipList | None = None) -> dict[str, int]:
    """Make up to ``limit`` due scheduled jobs available and wake their queues (unless
    PostgreSQL's notification queue is too full for wake-ups: see migration 3).

    Returns:
        {queue: jobs staged}.

    With ``skipped`` (the maintenance thread's), a staging the database refuses is tried job
    by job in a transaction rolled back afterwards; the jobs it fails on are skipped for a
    while (see ``skipjack.runtime.skips``) and the rest are staged.

    Raises:
        psycopg.Error: the database could not be reached or refused the statement (without
            ``skipped``, or for no one job); nothing was staged.
    """
    params = {"limit": limit, "channel": channel_name(schema),
              "skip": number_array(skipped.ids() if skipped else [])}
    try:
        rows = conn.execute(queries.STAGE, params).fetchall()
    except psycopg.Error as exc:
        if skipped is None or connection_lost(exc) or not _skip_unstageable(
                conn, queries, params, skipped):
            raise
        params["skip"] = number_array(skipped.ids())
        rows = conn.execute(queries.STAGE, params).fetchall()
    return {r[0]: r[1] for r in rows}


def _skip_unstageable(conn: psycopg.Connection[Any], queries: Queries,
                      params: dict[str, Any], skipped: SkipList) -> bool:
    """Find the due jobs that staging fails on (each staged alone, all rolled back) and skip
    them; whether there was any."""
    failing: list[tuple[int, str]] = []
    with conn.transaction() as dry_run:
        for (job_id,) in conn.execute(queries.STAGE_CANDIDATES, params).fetchall():
            try:
                with conn.transaction():
                    conn.execute(queries.STAGE_ONE, {"id": job_id})
            except psycopg.Error as one:
                if connection_lost(one):
                    raise
                failing.append((job_id, str(one).strip()))
        raise psycopg.Rollback(dry_run)
    for job_id, error in failing:
        skipped.add(job_id, error, "staging it")
    return bool(failing)


def schedule_due(app: App, conn: psycopg.Connection[Any], now: datetime | None = None) -> int:
    """One cron scheduler pass over every cron entry of ``app``; returns the jobs enqueued.

    Each due slot is claimed (a ``cron_slots`` row) in the same transaction as its job, so
    any number of schedulers enqueue it at most once; slots the misfire policy skips are
    recorded as missed (see ``skipjack.cron``).

    Args:
        app: the application with its cron entries.
        conn: an autocommit connection.
        now: the current time (default: the database clock).

    Raises:
        psycopg.Error: the database refused a statement or could not be reached; the entry
            being scheduled is rolled back.
    """
    q = app.queries
    if now is None:
        row = conn.execute(q.DB_NOW).fetchone()
        now = row[0] if row else datetime.now(UTC)
    enqueued = 0
    for entry in app.crons.values():
        row = conn.execute(q.CRON_LAST_SLOT, {"name": entry.name}).fetchone()
        slot, missed = plan(entry, row[0] if row else None, now)
        with conn.transaction():
            if missed:
                conn.execute(q.CRON_MISSED, {"name": entry.name, "slots": missed})
            if slot is not None and conn.execute(
                    q.CRON_CLAIM_SLOT, {"name": entry.name, "slot": slot}).fetchone():
                key = f"cron:{entry.name}:{slot.isoformat()}"
                job_id = app.enqueue(entry.task.configure(idempotency_key=key)
                                     .job(**entry.args), conn=conn)
                conn.execute(q.CRON_SET_JOB, {"job_id": job_id, "name": entry.name,
                                              "slot": slot})
                enqueued += 1
    return enqueued


def _stage_and_wake(conn: psycopg.Connection[Any], db: Database,
                    on_staged: Callable[[str], None], skipped: SkipList) -> float | None:
    """Stage batch after batch (at most 50 per run) while full batches come back; return
    the seconds until the next scheduled job is due (None: none is scheduled), so that the
    stager runs again then rather than a whole interval later."""
    for _ in range(50):
        staged = stage(conn, db.queries, db.schema, skipped=skipped)
        for queue in staged:
            on_staged(queue)
        if sum(staged.values()) < BATCH:
            break
    else:
        return 0.0  # more to stage at once
    row = conn.execute(db.queries.NEXT_DUE).fetchone()
    return None if row is None or row[0] is None else max(0.0, float(row[0]))


class NotifyQueueWatch:
    """The duty that watches PostgreSQL's notification queue.

    While the queue is at least ``notify_queue_limit()`` full, every skipjack NOTIFY is
    skipped (see migration 3) and workers find new jobs only by polling. The watch then logs a
    warning that says so and names the oldest session idle in a transaction (a session that
    LISTENs and stays in a transaction keeps every notification queued): at the first check
    that sees it, then at most once per ``warn_every`` seconds while it lasts; and an info line
    once the queue has room again. Its check also lets PostgreSQL reclaim the queue's space
    once the stuck session has ended.

    Args:
        queries: the statements of the app's schema.
        poll_interval: the worker's poll interval, in seconds (for the warning's text).
        warn_every: seconds between repeats of the warning.
    """

    def __init__(self, queries: Queries, *, poll_interval: float,
                 warn_every: float = NOTIFY_WARN_EVERY) -> None:
        self._queries = queries
        self._poll_interval = poll_interval
        self._warn_every = warn_every
        self._skipping = False
        self._warned_at = 0.0

    def __call__(self, conn: psycopg.Connection[Any]) -> None:
        """Check the queue once and log what changed.

        Raises:
            psycopg.Error: the database could not be reached or refused the statement.
        """
        row = conn.execute(self._queries.NOTIFY_QUEUE_STATUS).fetchone()
        if row is not None:
            usage, skipping, limit, *holder = row
            self.observe(usage, skipping, limit, holder, time.monotonic())

    def observe(self, usage: float, skipping: bool, limit: float, holder: Sequence[Any],
                now: float) -> None:
        """Log what one check saw.

        Args:
            usage: the fraction of the queue in use (0..1).
            skipping: whether wake-ups are skipped (``usage >= limit``).
            limit: the fraction from which they are skipped.
            holder: pid, application_name, database, state and transaction start of the
                oldest session idle in a transaction (all None when none is visible).
            now: a monotonic time, in seconds.
        """
        if skipping:
            if not self._skipping or now - self._warned_at >= self._warn_every:
                log.warning(
                    "PostgreSQL's notification queue is %.0f%% full (skipjack sends no wake-up "
                    "from %.0f%%): wake-ups are skipped and new jobs are picked up by polling, "
                    "every %gs; %s", 100 * usage, 100 * limit, self._poll_interval,
                    _holder_text(holder))
                self._warned_at = now
        elif self._skipping:
            log.info("PostgreSQL's notification queue is %.0f%% full: wake-ups resumed",
                     100 * usage)
        self._skipping = skipping


def _holder_text(holder: Sequence[Any]) -> str:
    """The warning's words about the session that likely holds the notification queue."""
    pid, application_name, database, state, xact_start = holder
    if pid is None:
        return ("no session idle in a transaction is visible to this role (a session that "
                "LISTENs and stays in a transaction holds the queue back; a role with "
                "pg_read_all_stats sees every session in pg_stat_activity)")
    since = xact_start.isoformat(sep=" ", timespec="seconds") if xact_start else "?"
    return (f"the oldest session idle in a transaction (it holds the queue back if it "
            f"LISTENs): pid {pid}, application_name {application_name!r}, database "
            f"{database!r}, state {state!r}, in its transaction since {since}; end it, or set "
            f"idle_in_transaction_session_timeout")


# The analysis after growth (GrowthAnalysis): seconds between checks; how many times its
# pages at the last statistics the jobs table must have grown to; the fewest pages (8 kB
# each) worth it, where reading the whole table takes well under a millisecond; the longest
# it waits for a lock (seconds); seconds to wait after a turn that could not analyse the
# table because another session held a lock on it (a VACUUM or ANALYZE, a CREATE INDEX,
# DDL in an open transaction).
ANALYZE_CHECK_INTERVAL = 2.0
ANALYZE_GROWTH = 2.0
ANALYZE_MIN_PAGES = 128
ANALYZE_LOCK_TIMEOUT = 0.5
ANALYZE_SKIPPED_WAIT = 60.0


class GrowthAnalysis:
    """The duty that ANALYZEs the jobs table soon after it has grown a lot, so that no
    statement keeps running on a plan made for a much smaller table.

    psycopg prepares a statement it has run a few times, and PostgreSQL then keeps one
    generic plan for it, made for the table's size at that time, until the table's
    statistics change (a VACUUM or ANALYZE; autovacuum looks at a database once per
    ``autovacuum_naptime``, a minute by default, and takes longer on a large table). A claim
    planned while the table held a few hundred jobs joins the claimed ids to a sequential
    scan of the whole table (a hash join; on such a table it is the cheaper plan); once the
    same table held 300,000 more rows, one claim of one job took 34-56 ms on that plan
    (110-127 ms when the table had been analysed while nearly empty), and about 0.6 ms
    once the table was analysed again (docs/performance.md, "Plans made for a small
    table"). Every other prepared statement that reads the table is planned again too.

    Every ``ANALYZE_CHECK_INTERVAL`` seconds the duty compares the table's size with its
    size at the last statistics (``pg_class.relpages``). A table's pages never shrink but by
    a VACUUM, which updates its statistics, so every plan in use was made for a table at
    least that large; once the table is ``ANALYZE_GROWTH`` times that size or more (and at
    least ``ANALYZE_MIN_PAGES`` pages), the duty runs ``ANALYZE``, after which every
    session plans its statements on the table again. A table that stops growing is not
    analysed again (autovacuum keeps its statistics). One worker analyses at a time (an
    advisory lock). The duty never queues behind another session: while one holds a lock
    that ANALYZE would wait for (a VACUUM or ANALYZE already running, a CREATE INDEX, DDL
    in an open transaction) it skips its turns for ``ANALYZE_SKIPPED_WAIT`` seconds, and
    it waits at most ``ANALYZE_LOCK_TIMEOUT`` seconds for any lock. A role that may not
    analyse the table (neither its owner nor the database's, nor given MAINTAIN on it from
    PostgreSQL 17 on: the least-privilege worker role of ``skipjack roles``) leaves it to
    autovacuum.

    Args:
        queries: the statements of the app's schema.
        schema: the app's schema.
    """

    def __init__(self, queries: Queries, schema: str) -> None:
        self._queries = queries
        self._params = {"schema": schema, "min_pages": ANALYZE_MIN_PAGES,
                        "growth": ANALYZE_GROWTH}
        self._said_may_not = False
        self._quiet_until = 0.0

    def __call__(self, conn: psycopg.Connection[Any]) -> bool:
        """Check once, and ANALYZE the table if it has grown enough; returns whether it did.

        Raises:
            psycopg.Error: the database could not be reached or refused a statement.
        """
        if time.monotonic() < self._quiet_until:
            return False
        q = self._queries
        relpages = -1
        try:
            with conn.transaction():
                row = conn.execute(q.ANALYZE_CHECK, self._params).fetchone()
                if row is None:  # no jobs table (yet)
                    return False
                pages, relpages, may_analyze, go = row
                grown = pages >= max(ANALYZE_MIN_PAGES, ANALYZE_GROWTH * max(relpages, 1))
                if not go:
                    if grown and may_analyze:  # another session holds the table
                        self._quiet_until = time.monotonic() + ANALYZE_SKIPPED_WAIT
                    elif grown and not self._said_may_not:
                        self._said_may_not = True
                        log.info("the jobs table has grown to %d pages since its statistics "
                                 "were taken (%d pages); this role may not ANALYZE it, so "
                                 "plans made for the smaller table stay in use until it is "
                                 "next vacuumed or analysed", pages, relpages)
                    return False
                # SKIP_LOCKED covers the table's own lock only, not its indexes' or its
                # row of pg_class, which DDL in an open transaction may hold
                conn.execute(q.SET_LOCK_TIMEOUT,
                             {"timeout": str(round(ANALYZE_LOCK_TIMEOUT * 1000))})
                conn.execute(q.ANALYZE_JOBS)
                row = conn.execute(q.ANALYZE_CHECK, self._params).fetchone()
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected):
            row = None  # a lock of the table's indexes or catalog row was held
        if row is None or row[1] == relpages:  # not analysed: another session held a lock
            self._quiet_until = time.monotonic() + ANALYZE_SKIPPED_WAIT
            return False
        log.info("analysed the jobs table, grown from %d to %d pages since its statistics "
                 "were taken, so that statements are planned for its size", relpages, pages)
        return True


# Seconds between two warnings that another live worker has this worker's name.
NAME_WARN_EVERY = 60.0


class Registry:
    """This worker's row in the live worker registry (the ``workers`` table).

    Each run writes the row (created on the first), good for ``ttl`` seconds, and removes
    rows whose time is up: workers that stopped without saying so. ``unregister``
    removes the row at a clean stop.

    Args:
        queries: the app's statements.
        name, queues, concurrency: the worker's.
        interval: seconds between refreshes; the row lives ``3 x interval + 5`` seconds.
        snapshot: returns (jobs running now, the worker's counters as a dict), read from
            this thread.
    """

    def __init__(self, queries: Queries, *, name: str, queues: Sequence[str], concurrency: int,
                 interval: float, snapshot: Callable[[], tuple[int, dict[str, int]]]) -> None:
        self._q = queries
        self.ttl = 3 * interval + 5.0
        self._snapshot = snapshot
        self._warned_at = float("-inf")
        self._row: dict[str, Any] = {
            "name": name, "host": socket.gethostname(), "pid": os.getpid(),
            "version": _version(), "queues": list(queues), "concurrency": concurrency,
            "ttl": self.ttl}

    def __call__(self, conn: psycopg.Connection[Any]) -> None:
        running, stats = self._snapshot()
        other = conn.execute(self._q.REGISTER_WORKER, {**self._row, "running": running,
                                                       "stats": json.dumps(stats)}).fetchone()
        if other is not None and time.monotonic() - self._warned_at >= NAME_WARN_EVERY:
            self._warned_at = time.monotonic()
            log.warning("another live worker (host %s, pid %s) has this worker's name %r: "
                        "give each worker its own --name (the registry shows one of them)",
                        other[0], other[1], self._row["name"])
        for (name,) in conn.execute(self._q.EXPIRE_WORKERS).fetchall():
            log.info("worker %s is gone (its registry row expired); removed it", name,
                     extra={"worker": name})

    def unregister(self, conn: psycopg.Connection[Any]) -> None:
        """Remove this worker's row."""
        conn.execute(self._q.UNREGISTER_WORKER, {k: self._row[k] for k in ("name", "host", "pid")})


def _version() -> str:
    try:
        return metadata.version("skipjack")
    except metadata.PackageNotFoundError:
        return "unknown"


# Seconds until the pruner runs again after it caught up with full batches (see the pruner
# in Maintenance): a queue busy enough to fill a batch is pruned every second.
PRUNE_BUSY_INTERVAL = 1.0


@dataclass
class Duty:
    """One periodic task of the maintenance thread."""

    name: str
    interval: float  # seconds
    run: Callable[[psycopg.Connection[Any]], object]
    next_at: float = 0.0
    # run returns the seconds until it is needed again (or None), which may bring its next
    # run forward (the stager: the next scheduled job's due time; the pruner: soon while it
    # finds full batches)
    adaptive: bool = False  # the stager: stage_at() may also bring its run forward


class Maintenance(threading.Thread):
    """Runs the stager, rescuer, cron scheduler, pruner, throughput rollup, the
    notification queue's watch and the analysis after growth on a connection of its own.

    Args:
        db: the app's database.
        stage_interval, rescue_interval: seconds.
        retention: seconds to keep finished jobs (None: this worker does not prune).
        discarded_retention: seconds to keep discarded jobs (see ``prune``).
        on_staged: called (from this thread) with each queue that got runnable jobs.
        cron: the cron scheduler's pass (run every second), or None when the app has no
            cron entries.
        poll_interval: the worker's poll interval, in seconds (named by the notification
            queue's warning).
        on_rescued: called (from this thread) with how many jobs each rescuer run returned
            to their queue or the dead letter.
        registry: the worker's row in the live worker registry, refreshed every
            ``registry_interval`` seconds and removed when the thread ends (None: none).

    Each duty's first run is at a random point of its first interval and later runs are
    jittered by +-20%, so many workers spread out.
    """

    def __init__(self, db: Database, *, stage_interval: float, rescue_interval: float,
                 retention: float | None, discarded_retention: float | None,
                 on_staged: Callable[[str], None],
                 cron: Callable[[psycopg.Connection[Any]], object] | None = None,
                 poll_interval: float = 5.0, registry: Registry | None = None,
                 on_rescued: Callable[[int], None] = lambda n: None,
                 registry_interval: float = 10.0) -> None:
        super().__init__(name="skipjack-maintenance", daemon=True)
        self._db = db
        self._stop_event = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stage_requested = float("inf")  # monotonic time stage_at() last asked for
        self._conn: psycopg.Connection[Any] | None = None
        self._stage_skips = SkipList()  # jobs that staging, or rescuing, fails on
        self._rescue_skips = SkipList()
        q = db.queries
        self._duties = [
            Duty("stager", stage_interval,
                 lambda c: _stage_and_wake(c, db, on_staged, self._stage_skips),
                 adaptive=True),
            Duty("rescuer", rescue_interval,
                 lambda c: on_rescued(len(rescue(c, q, skipped=self._rescue_skips)))),
            Duty("notification queue watch", NOTIFY_CHECK_INTERVAL,
                 NotifyQueueWatch(q, poll_interval=poll_interval)),
            Duty("throughput rollup", ROLLUP_INTERVAL, lambda c: rollup(c, q)),
            Duty("analysis after growth", ANALYZE_CHECK_INTERVAL, GrowthAnalysis(q, db.schema)),
        ]
        self._registry = registry
        if registry is not None:
            self._duties.append(Duty("registry", registry_interval, registry))
        if cron is not None:
            self._duties.append(Duty("cron", 1.0, cron))
        if retention is not None:
            busy = False

            def pruner(conn: psycopg.Connection[Any]) -> float | None:
                # A full batch: more are past their retention; delete them now, one batch
                # per turn of this thread, so a busy queue's table stops growing (one batch
                # per interval pruned at most 100 jobs/s). Once it has caught up it comes
                # back in PRUNE_BUSY_INTERVAL instead of its interval, so a busy queue is
                # pruned a second's jobs at a time rather than in a burst every 10 s.
                nonlocal busy
                deleted = prune(conn, q, retention=retention,
                                discarded_retention=discarded_retention)
                if deleted >= BATCH:
                    busy = True
                    return 0.0
                caught_up, busy = busy, False
                return PRUNE_BUSY_INTERVAL if caught_up else None

            self._duties.append(Duty("pruner", 10.0, pruner))
        now = time.monotonic()
        for duty in self._duties:
            # the registry row at once: a worker shows up as soon as it runs; the stager soon,
            # as it then knows when the next scheduled job is due
            first = 0.0 if duty.name == "registry" else random.uniform(0.1, 1.0)
            if duty.adaptive:
                first = min(first, random.uniform(0.0, 0.1) / max(duty.interval, 0.1))
            duty.next_at = now + duty.interval * first

    def stop(self) -> None:
        """Ask the thread to end after its current step."""
        self._stop_event.set()
        self._wake.set()

    def stage_at(self, delay: float) -> None:
        """Run the stager ``delay`` seconds from now (sooner than planned only): a job this
        worker retried or released becomes runnable then (thread-safe)."""
        at = time.monotonic() + max(0.0, delay)
        with self._lock:
            self._stage_requested = min(self._stage_requested, at)
            stager = self._duties[0]
            if at < stager.next_at:
                stager.next_at = at
                self._wake.set()

    def run(self) -> None:
        backoff = ReconnectDelay()
        # wake when the next duty is due (a fixed tick would delay a duty whose jittered
        # time falls just after one by nearly a whole tick), or when stage_at() asks
        while True:
            with self._lock:
                wait = max(0.0, min(d.next_at for d in self._duties) - time.monotonic())
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop_event.is_set():
                break
            for duty in self._duties:
                if time.monotonic() < duty.next_at or self._stop_event.is_set():
                    continue
                needed_in: object = None
                started = time.monotonic()
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = self._db.connect()
                    needed_in = duty.run(self._conn)
                    if backoff.reset():
                        log.info("%s: the database is reachable again", duty.name)
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
                with self._lock:
                    duty.next_at = time.monotonic() + duty.interval * random.uniform(0.8, 1.2)
                    if isinstance(needed_in, float):
                        duty.next_at = min(duty.next_at, time.monotonic() + needed_in)
                    if duty.adaptive:
                        if self._stage_requested > started:  # asked for while it ran
                            duty.next_at = min(duty.next_at, self._stage_requested)
                        self._stage_requested = float("inf")
        self._unregister()
        if self._conn is not None:
            self._conn.close()

    def _unregister(self) -> None:
        """Remove the worker's registry row, if the database can be reached at once."""
        if self._registry is None:
            return
        try:
            if self._conn is None or self._conn.closed:
                self._conn = self._db.connect()
            self._registry.unregister(self._conn)
        except psycopg.Error as exc:  # it expires by itself
            log.info("could not remove this worker's registry row (%s); it expires in %.0fs",
                     str(exc).strip(), self._registry.ttl)
