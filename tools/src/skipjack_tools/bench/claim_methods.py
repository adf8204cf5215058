"""W6: the article's three ways to take a job (docs/performance.md), and one queue per query
versus ``= ANY``.

Part 1 runs 8 worker threads (each with its own connection) over one plain table of 2,000
jobs whose "work" is a 2 ms sleep, with each method:

- ``no_lock``: ``SELECT`` the oldest pending id, work, then mark it done (no lock at all);
- ``for_update``: in one transaction, ``SELECT ... FOR UPDATE`` the oldest pending row, work,
  mark it done, commit (the row lock is held during the work);
- ``skip_locked``: the same with ``FOR UPDATE SKIP LOCKED``.

Part 2 times the claim's ``SELECT`` on skipjack's own table and index with 100,000 runnable
rows in 20 queues: one statement with ``queue = ANY(10 queues)`` versus ``queue = $1``.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from typing import Any

from psycopg import Rollback, sql

from .common import Settings, connect, fresh_app

WORKERS = 8
_PICK = {
    "no_lock": "SELECT id FROM {t} WHERE status = 'pending' ORDER BY id LIMIT 1",
    "for_update": "SELECT id FROM {t} WHERE status = 'pending' ORDER BY id LIMIT 1 FOR UPDATE",
    "skip_locked": "SELECT id FROM {t} WHERE status = 'pending' ORDER BY id LIMIT 1 "
                   "FOR UPDATE SKIP LOCKED",
}


def _method(settings: Settings, method: str, jobs: int) -> dict[str, Any]:
    with fresh_app(settings.dsn, "w6") as app:
        return _method_in(app.dsn, sql.Identifier(app.schema, "claims"), method, jobs)


def _method_in(dsn: str, table: sql.Identifier, method: str, jobs: int) -> dict[str, Any]:
    with connect(dsn) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, status text NOT NULL "
                             "DEFAULT 'pending')").format(table))
        conn.execute(sql.SQL("CREATE INDEX ON {} (id) WHERE status = 'pending'").format(table))
        conn.execute(sql.SQL("INSERT INTO {} (id) SELECT generate_series(1, %s)").format(table),
                     [jobs])
        conn.execute(sql.SQL("ANALYZE {}").format(table))
    pick = sql.SQL(_PICK[method]).format(t=table)
    done = sql.SQL("UPDATE {} SET status = 'done' WHERE id = %s").format(table)
    left = sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE status = 'pending')").format(table)
    executed: list[list[int]] = [[] for _ in range(WORKERS)]
    empty_picks = [0] * WORKERS
    deadline = time.monotonic() + 120

    def work(n: int) -> None:
        with connect(dsn) as c:
            while time.monotonic() < deadline:
                if method == "no_lock":
                    row = c.execute(pick).fetchone()
                    if row:
                        time.sleep(0.002)
                        c.execute(done, row)
                else:
                    with c.transaction():
                        row = c.execute(pick).fetchone()
                        if row:
                            time.sleep(0.002)
                            c.execute(done, row)
                if row:
                    executed[n].append(row[0])
                    continue
                empty_picks[n] += 1
                exists = c.execute(left).fetchone()
                if not (exists and exists[0]):
                    return

    threads = [threading.Thread(target=work, args=(n,)) for n in range(WORKERS)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    runs = sum(len(e) for e in executed)
    distinct = len({i for e in executed for i in e})
    return {
        "jobs_per_s": round(distinct / elapsed, 1),
        "executions": runs,
        "duplicate_executions": runs - distinct,
        "jobs_done": distinct,
        "per_worker": sorted(len(e) for e in executed),
        "empty_picks": sum(empty_picks),
        "workers_with_nothing": sum(1 for e in executed if not e),
    }


def _multi_queue(settings: Settings) -> dict[str, Any]:
    rows = settings.n(100_000, minimum=1000)
    queues = [f"q{i:02d}" for i in range(20)]
    wanted = queues[::2]
    with fresh_app(settings.dsn, "w6") as app, connect(app.dsn) as conn:
        t = sql.Identifier(app.schema, "jobs")
        conn.execute(sql.SQL(
            "INSERT INTO {} (queue, task, priority, run_at) "
            "SELECT 'q' || lpad((g %% 20)::text, 2, '0'), 'bench.noop', (g %% 11) - 5, "
            "       now() - (g %% 1000) * interval '1 ms' FROM generate_series(1, %s) g"
        ).format(t), [rows])
        conn.execute(sql.SQL("ANALYZE {}").format(t))
        base = ("SELECT id FROM {t} WHERE state = 'available' AND queue {cond} "
                "AND run_at <= now() ORDER BY priority DESC, run_at, id LIMIT 10 "
                "FOR UPDATE SKIP LOCKED")
        any_q = sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) " + base).format(
            t=t, cond=sql.SQL("= ANY(%s::text[])"))
        one_q = sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) " + base).format(
            t=t, cond=sql.SQL("= %s"))
        timings: dict[str, list[float]] = {"any": [], "one_queue": []}
        plans: dict[str, bool] = {}
        rng = random.Random(4)
        for _ in range(20):
            for name, stmt, param in (("any", any_q, wanted),
                                      ("one_queue", one_q, rng.choice(wanted))):
                with conn.transaction():
                    row = conn.execute(stmt, [param]).fetchone()
                    assert row is not None
                    plan = row[0][0]
                    timings[name].append(plan["Execution Time"])
                    plans[name] = '"Sort"' in str(plan).replace("'", '"')
                    raise Rollback()  # release the claim's row locks
    return {
        "pending_rows": rows, "queues": len(queues), "queues_claimed": len(wanted),
        "any_ms": round(statistics.median(timings["any"]), 3),
        "one_queue_ms": round(statistics.median(timings["one_queue"]), 3),
        "any_plan_sorts": plans["any"], "one_queue_plan_sorts": plans["one_queue"],
    }


def run(settings: Settings) -> dict[str, Any]:
    """W6 (single runs: its figures are about direction, not speed)."""
    jobs = settings.n(2000, minimum=100)
    out: dict[str, Any] = {"workers": WORKERS, "jobs": jobs, "work_ms": 2, "methods": {}}
    for method in _PICK:
        settings.log(f"W6 claim method {method}: {WORKERS} workers, {jobs} jobs x 2 ms")
        out["methods"][method] = _method(settings, method, jobs)
    settings.log("W6 multi-queue: = ANY(...) versus one queue per query")
    out["multi_queue"] = _multi_queue(settings)
    return out

