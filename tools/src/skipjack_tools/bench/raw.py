"""The database's raw limits, measured in the same run as skipjack, with no queue at all: a
plain table and the fewest statements that do each job.

- one INSERT and its commit per call, on one connection (what W1 one-per-call is bounded by);
- one ``INSERT ... SELECT FROM unnest(...)`` of a whole batch (W1 bulk's bound);
- a loop on one connection that takes 100 rows ``FOR UPDATE SKIP LOCKED`` and deletes them
  in one statement, a transaction each (W2's bound);
- the pickup of one row: an INSERT and its NOTIFY commit in one statement on one connection
  (before run Q: BEGIN, INSERT, NOTIFY and COMMIT, four round trips), a LISTEN on another
  hears it, and a third takes the row (``FOR UPDATE SKIP LOCKED``) and deletes it, 20 ms
  apart as W3's enqueues: from the commit's return to the take's (W3 pickup's bound), and
  from the moment before the INSERT to the take's return (W3's latency's bound);
- 8 asyncio tasks sleeping 2 ms in a loop on the worker's event loop, with no queue at all
  (W4's bound in one process: the sleeps alone).

For the loop, and for one W2 drain, :func:`cost` also reads what each job cost: the server's
CPU (the ``/proc`` times of its processes, when the server runs on this machine), the
client's CPU, WAL bytes and commits.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from typing import Any

import psycopg

from skipjack.runtime import eventloop

from .common import BULK_CALLS, Settings, connect, fresh_database, median, percentiles, rate

TABLE = """
CREATE TABLE raw_jobs (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue  text NOT NULL,
    args   jsonb NOT NULL,
    run_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX raw_jobs_queue ON raw_jobs (queue, run_at, id)
"""
INSERT_ONE = "INSERT INTO raw_jobs (queue, args) VALUES ('bench', %s::jsonb)"
INSERT_UNNEST = ("INSERT INTO raw_jobs (queue, args) "
                 "SELECT 'bench', a FROM unnest(%s::jsonb[]) AS a")
TAKE = ("SELECT id FROM raw_jobs WHERE queue = 'bench' ORDER BY run_at, id LIMIT 100 "
        "FOR UPDATE SKIP LOCKED")
DELETE = "DELETE FROM raw_jobs WHERE id = ANY(%s::bigint[])"
CHANNEL = "raw_jobs"
# One row and its notification in one statement, one round trip and commit (as skipjack's
# own enqueue statement sends its wake-up)
INSERT_NOTIFY = ("WITH i AS (INSERT INTO raw_jobs (queue, args) VALUES ('bench', %s::jsonb) "
                 f"RETURNING id) SELECT pg_notify('{CHANNEL}', '') FROM i")
TAKE_ONE = ("DELETE FROM raw_jobs WHERE id = (SELECT id FROM raw_jobs WHERE queue = 'bench' "
            "ORDER BY run_at, id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING id, args")
PICKUP_GAP = 0.02  # seconds between enqueues, as in W3
SLEEPERS, SLEEP = 8, 0.002  # W4: 8 slots, 2 ms handlers
COUNTERS = """
SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),
       pg_current_wal_lsn()
"""
WAL_SINCE = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)::bigint"
SERVER_PIDS = "SELECT pid FROM pg_stat_activity"
# seconds: a backend publishes its statistics (the commit counts) at most once a second
# while busy, and up to 10 s after it goes idle (PostgreSQL's PGSTAT_IDLE_INTERVAL)
STATS_FLUSH = 11.0


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (index 1: ppid, 11/12: utime
    and stime, 13/14: the reaped children's), or None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _server_cpu(conn: psycopg.Connection[Any]) -> float | None:
    """Seconds of CPU the server's processes used so far, those that ended included: the
    live ones' own times, and the postmaster's own and its reaped children's (None: the
    server is not on this machine)."""
    tick = os.sysconf("SC_CLK_TCK")
    live: dict[int, list[str]] = {}
    for (pid,) in conn.execute(SERVER_PIDS).fetchall():
        fields = _stat(pid)
        if fields is not None:
            live[pid] = fields
    if not live:
        return None
    parents = {int(fields[1]) for fields in live.values()}
    postmaster = next((p for p in parents if p not in live and _stat(p) is not None), None)
    total = sum(int(f[11]) + int(f[12]) for f in live.values())  # ticks
    if postmaster is not None:
        own = _stat(postmaster)
        if own is not None:
            total += int(own[11]) + int(own[12]) + int(own[13]) + int(own[14])
    return total / tick


def settle_for(settings: Settings) -> float:
    """How long ``cost`` waits for the counters: STATS_FLUSH, or 1.2 s in quick runs."""
    return settings.seconds(STATS_FLUSH, 1.2)


def _client_cpu(pid: int | None) -> float:
    """CPU seconds used so far by this process, or by the live process ``pid``."""
    if pid is None:
        return time.process_time()
    fields = _stat(pid)
    if fields is None:
        raise RuntimeError(f"process {pid} is gone: its CPU cannot be read")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cost(dsn: str, jobs: int, run: Callable[[], object], client_pid: int | None = None,
         settle: float = STATS_FLUSH) -> dict[str, Any]:
    """What ``run`` cost per job: server and client CPU (µs; the client: this process, or
    the live process ``client_pid``, e.g. a worker), WAL bytes, commits. ``settle``: seconds
    to wait before reading the counters (see STATS_FLUSH; shorter in quick runs, whose
    commit counts may then be low)."""
    with connect(dsn) as conn:
        commits, lsn = conn.execute(COUNTERS).fetchone()  # type: ignore[misc]
        server = _server_cpu(conn)
        client = _client_cpu(client_pid)
        run()
        client = _client_cpu(client_pid) - client
        # after a pause: the commit counts are published, and a backend the run closed has
        # ended and been reaped by the postmaster (its CPU then counts in the postmaster's
        # children's times; read at once, it was in neither)
        time.sleep(settle)
        server_after = _server_cpu(conn)
        wal = conn.execute(WAL_SINCE, [lsn]).fetchone()[0]  # type: ignore[index]
        commits_after = conn.execute(COUNTERS).fetchone()[0]  # type: ignore[index]
    per = max(1, jobs)
    return {
        "server_cpu_us": (round((server_after - server) * 1e6 / per, 1)
                          if server is not None and server_after is not None else None),
        "client_cpu_us": round(client * 1e6 / per, 1),
        "wal_bytes": round(wal / per, 1),
        "commits": round((commits_after - commits) / per, 4),
    }


def _insert_each(dsn: str, jobs: int) -> float | None:
    with connect(dsn) as conn:
        started = time.perf_counter()
        for i in range(jobs):
            conn.execute(INSERT_ONE, [json.dumps({"i": i})])
        return rate(jobs, time.perf_counter() - started)


def _insert_unnest(dsn: str, jobs: int) -> float | None:
    """The median of BULK_CALLS statements of ``jobs`` rows each (as W1 bulk is measured)."""
    calls = []
    with connect(dsn) as conn:
        for _ in range(BULK_CALLS):
            started = time.perf_counter()
            conn.execute(INSERT_UNNEST, [[json.dumps({"i": i}) for i in range(jobs)]])
            calls.append(rate(jobs, time.perf_counter() - started))
    return median(calls)


def _take_and_delete(dsn: str) -> int:
    done = 0
    with connect(dsn) as conn:
        conn.autocommit = False
        while True:
            ids = [r[0] for r in conn.execute(TAKE).fetchall()]
            if not ids:
                conn.commit()
                return done
            conn.execute(DELETE, [ids])
            conn.commit()
            done += len(ids)


def _pickups(dsn: str, jobs: int) -> tuple[list[float], list[float]]:
    """``jobs`` pickups of one row each (see the module's docstring), in milliseconds: (from
    the return of the enqueue's commit to the return of the statement that took the row,
    from the moment before the enqueue's INSERT to that return). The second is W3's own
    measure (enqueue to start) with no queue: the floor of W3's latency on this machine."""
    pickups, totals = [], []
    with connect(dsn) as sender, connect(dsn) as listener, connect(dsn) as taker:
        listener.execute(f"LISTEN {CHANNEL}")
        for i in range(jobs):
            time.sleep(PICKUP_GAP)  # the servers and this process idle, as in W3
            started = time.perf_counter()
            sender.execute(INSERT_NOTIFY, [json.dumps({"i": i})])
            committed = time.perf_counter()
            heard = sum(1 for _ in listener.notifies(timeout=5, stop_after=1))
            taken = taker.execute(TAKE_ONE).fetchall()
            if heard and taken:
                done = time.perf_counter()
                pickups.append((done - committed) * 1000)
                totals.append((done - started) * 1000)
    return pickups, totals


def _sleep_loops(jobs: int) -> float | None:
    """Jobs/s of SLEEPERS tasks that each sleep SLEEP seconds ``jobs / SLEEPERS`` times, on
    the event loop a worker runs (``skipjack.runtime.eventloop``)."""
    async def sleeper(times: int) -> None:
        for _ in range(times):
            await asyncio.sleep(SLEEP)

    async def all_of_them() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(sleeper(jobs // SLEEPERS) for _ in range(SLEEPERS)))
        return time.perf_counter() - started

    with asyncio.Runner(loop_factory=eventloop.new_event_loop) as runner:
        return rate(jobs // SLEEPERS * SLEEPERS, runner.run(all_of_them()))


def run(settings: Settings) -> dict[str, Any]:
    """The raw limits (medians of ``settings.runs``), and the loop's cost per job."""
    single, bulk, drain = settings.n(2000), settings.n(10_000), settings.n(10_000)
    picked, slept = settings.n(200, minimum=20), settings.n(2000, minimum=SLEEPERS)
    out: dict[str, Any] = {"insert_each": {"jobs": single}, "insert_unnest": {"jobs": bulk},
                           "take_and_delete": {"jobs": drain, "batch": 100},
                           "pickup": {"jobs": picked, "gap_s": PICKUP_GAP},
                           "sleep_loops": {"jobs": slept, "tasks": SLEEPERS,
                                           "sleep_s": SLEEP}}
    each, unnest, loop, costs, pickups, sleeps = [], [], [], [], [], []
    for _ in range(settings.runs):
        with fresh_database(settings.dsn, "raw") as dsn:
            with connect(dsn) as conn:
                conn.execute(TABLE)
            settings.log(f"raw limits: {single} INSERT + commit, {bulk} in one INSERT, "
                         f"{drain} taken 100 at a time and deleted")
            each.append(_insert_each(dsn, single))
            with connect(dsn) as conn:
                conn.execute("TRUNCATE raw_jobs")
            unnest.append(_insert_unnest(dsn, bulk))
            with connect(dsn) as conn:
                conn.execute("TRUNCATE raw_jobs")
                conn.execute(INSERT_UNNEST, [[json.dumps({"i": i}) for i in range(drain)]])
                conn.execute("VACUUM ANALYZE raw_jobs")
            span: list[float] = []

            def timed(dsn: str = dsn, span: list[float] = span) -> None:
                started = time.perf_counter()
                _take_and_delete(dsn)
                span.append(time.perf_counter() - started)

            costs.append(cost(dsn, drain, timed, settle=settle_for(settings)))
            loop.append(rate(drain, span[0]))
            settings.log(f"raw limits: {picked} pickups of one row, {slept} sleeps of "
                         f"{SLEEP * 1000:g} ms in {SLEEPERS} tasks")
            with connect(dsn) as conn:
                conn.execute("TRUNCATE raw_jobs")
            picks, totals = _pickups(dsn, picked)
            pickups.append({**percentiles(picks),
                            **{f"total_{k}": v for k, v in percentiles(totals).items()}})
            sleeps.append(_sleep_loops(slept))
    out["insert_each"]["jobs_per_s"] = median(each)
    out["insert_unnest"]["jobs_per_s"] = median(unnest)
    out["take_and_delete"]["jobs_per_s"] = median(loop)
    out["take_and_delete"]["per_job"] = {
        key: median([c[key] for c in costs]) for key in costs[0]}
    out["pickup"].update({f"{key}_ms": median([p[key] for p in pickups])
                          for key in pickups[0]})
    out["sleep_loops"]["jobs_per_s"] = median(sleeps)
    return out
