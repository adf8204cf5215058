"""W8: the claim with a long history in the table, and behind a long-open snapshot.

The table gets 1,000,000 succeeded jobs, 100,000 jobs due tomorrow and 20,000 runnable jobs,
each with a 2.4 KB payload (text that PostgreSQL's TOAST compresses, as most JSON is), then
autovacuum's work is done once (``VACUUM ANALYZE``). The bench then checks the claim's plan
(no sequential scan) and times skipjack's own claim statement (batches of 10, each followed
by the batched completion) on one connection: first on the quiet table, then while another
session holds a REPEATABLE READ snapshot open for 60 s and jobs keep flowing (2,000 a second
enqueued, claimed and completed), so dead rows pile up that vacuum may not remove. Last,
it prunes the finished jobs as a worker's pruner does, and reports the rate and the cost
per pruned job.
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
from psycopg import sql

from skipjack.admin import BATCH, prune
from skipjack.app import App
from skipjack.outcome import Outcome, outcome_params
from skipjack.sql.claim import claim_params

from . import raw
from .common import Settings, connect, fresh_app, payload, percentiles, rate
from .tasks import register

FILL = """
INSERT INTO {t} (queue, task, args, args_bytes, state, attempt, run_at, created_at,
                 attempted_at, finished_at)
SELECT 'bench', 'bench.noop', jsonb_build_object('i', g, 'data', %(data)s::text),
       %(bytes)s, %(state)s, %(attempt)s, now() + %(due)s * interval '1 s',
       now() - interval '1 day', CASE WHEN %(done)s THEN now() - interval '1 day' END,
       CASE WHEN %(done)s THEN now() - interval '1 day' + g * interval '1 ms' END
  FROM generate_series(1, %(n)s) g
"""


def _fill(conn: psycopg.Connection[Any], app: App, n: int, state: str, due: float) -> None:
    done = state == "succeeded"
    data = payload(2350)
    stmt = sql.SQL(FILL).format(t=sql.Identifier(app.schema, "jobs"))
    for start in range(0, n, 100_000):
        conn.execute(stmt, {"data": data, "bytes": len(data) + 30, "state": state,
                            "attempt": 1 if done else 0, "due": due, "done": done,
                            "n": min(100_000, n - start)})


def _claim_loop(app: App, conn: psycopg.Connection[Any], claims: int,
                seconds: float | None = None, enqueue_per_s: float = 0.0) -> list[float]:
    """Claim 10 and complete them, ``claims`` times or for ``seconds``; claim times in ms."""
    q = app.queries
    noop = app.tasks["bench.noop"]
    data = payload(2350)
    params = claim_params("bench", 10, lease=30.0, worker="bench")
    times: list[float] = []
    started = time.monotonic()
    fed = 0
    while True:
        elapsed = time.monotonic() - started
        if seconds is None and len(times) >= claims:
            break
        if seconds is not None and elapsed >= seconds:
            break
        due = int(enqueue_per_s * elapsed) - fed
        if due >= 100:
            app.enqueue_many([noop.job(data=data) for _ in range(due)], conn=conn)
            fed += due
        t0 = time.perf_counter()
        rows = conn.execute(q.CLAIM, params).fetchall()
        times.append((time.perf_counter() - t0) * 1000)
        if rows:
            conn.execute(q.record_outcomes(len(rows)), outcome_params(
                [Outcome(r[0], r[7], r[1], "complete") for r in rows]),
                prepare=q.prepare_outcomes(len(rows)))
        elif seconds is not None:
            time.sleep(0.005)  # wait for the feed
    return times


def _plan(app: App, conn: psycopg.Connection[Any]) -> dict[str, Any]:
    row = conn.execute(b"EXPLAIN (FORMAT JSON) " + app.queries.CLAIM,
                       claim_params("bench", 10, lease=30.0, worker="bench")).fetchone()
    assert row is not None
    text = json.dumps(row[0])
    nodes = sorted({n.strip('"') for n in text.split('"Node Type": ')[1:]
                    for n in [n.split(",")[0]]})
    return {"seq_scan": "Seq Scan" in nodes, "nodes": nodes,
            "uses_claim_index": "jobs_claim_idx" in text}


def _prune_cost(settings: Settings, app: App, jobs: int) -> dict[str, Any]:
    """Delete the ``jobs`` finished jobs as the worker's pruner does (batches of
    ``skipjack.admin.BATCH``, each its own transaction, until a batch comes back short):
    jobs/s and the cost per job (see ``raw.cost``)."""
    elapsed: list[float] = []

    def prune_all() -> None:
        with connect(app.dsn) as conn:
            started = time.monotonic()
            while prune(conn, app.queries, retention=3600.0) >= BATCH:
                pass
            elapsed.append(time.monotonic() - started)

    per_job = raw.cost(app.dsn, jobs, prune_all, settle=raw.settle_for(settings))
    return {"jobs": jobs, "jobs_per_s": rate(jobs, elapsed[0]), "per_job": per_job}


def run(settings: Settings) -> dict[str, Any]:
    """W8 (a single run)."""
    history, future, runnable = (settings.n(1_000_000, 1000), settings.n(100_000, 100),
                                 settings.n(20_000, 1000))
    snapshot_s = settings.seconds(60.0, 1.0)
    settings.log(f"W8 history: loading {history} finished, {future} future, {runnable} "
                 "runnable jobs of 2.4 KB")
    with fresh_app(settings.dsn, "w8") as app, connect(app.dsn) as conn:
        register(app)
        started = time.monotonic()
        _fill(conn, app, history, "succeeded", 0)
        _fill(conn, app, future, "available", 86400)
        _fill(conn, app, runnable, "available", -1)
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(app.schema, "jobs")))
        load_s = time.monotonic() - started
        size = conn.execute("SELECT pg_total_relation_size(%s)",
                            [f"{app.schema}.jobs"]).fetchone()
        plan = _plan(app, conn)
        settings.log("W8 history: claim latency on the full table")
        quiet = _claim_loop(app, conn, claims=max(50, runnable // 40))
        settings.log(f"W8 history: claim latency under a snapshot held for {snapshot_s:.0f} s")
        holder = connect(app.dsn)
        try:
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute(sql.SQL("SELECT count(*) FROM {} WHERE id < 0").format(
                sql.Identifier(app.schema, "jobs")))
            held = _claim_loop(app, conn, claims=0, seconds=snapshot_s, enqueue_per_s=2000)
            tail = held[int(len(held) * 0.83):]
            after_plan = _plan(app, conn)
        finally:
            holder.close()
        settings.log(f"W8 history: pruning the {history} finished jobs as a worker does")
        pruned = _prune_cost(settings, app, history)
    return {
        "finished_jobs": history, "future_jobs": future, "runnable_jobs": runnable,
        "payload_bytes": 2400, "load_seconds": round(load_s, 1),
        "table_mib": round((size[0] if size else 0) / 2**20, 1),
        "plan": plan,
        "claim_ms": {**percentiles(quiet), "claims": len(quiet)},
        "snapshot_seconds": snapshot_s,
        "claim_ms_during_snapshot": {**percentiles(held), "claims": len(held)},
        "claim_ms_end_of_snapshot": {**percentiles(tail), "claims": len(tail)},
        "plan_after_snapshot": after_plan,
        "prune": pruned,
        "p99_ms": percentiles(quiet)["p99"],
    }
