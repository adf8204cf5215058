"""W10: many worker processes against one server. 1, 2, 4 and 8 worker processes at
concurrency 50 drain one backlog of no-op jobs; for each count: throughput, the claim
latency a client sees meanwhile, and what the server's active sessions waited on.

The claim latency comes from a probe: one more connection that claims one job every 10 ms
with skipjack's own claim statement (and completes it), timing each claim. The wait events
are sampled from ``pg_stat_activity`` every 20 ms (LWLock and MultiXact waits are the ones
to watch: contention on the claim's index and on row locks).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from skipjack.app import App
from skipjack.outcome import Outcome, outcome_params
from skipjack.sql.claim import claim_params

from .common import Settings, connect, drain_span, fresh_app, percentiles, rate, wait_for
from .tasks import register
from .worker_run import StateCounter, WorkerProcesses

PROCESS_COUNTS = (1, 2, 4, 8)
CONCURRENCY = 50
WAITS = """
SELECT wait_event_type, wait_event, count(*) FROM pg_stat_activity
 WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()
   AND wait_event IS NOT NULL
 GROUP BY 1, 2
"""


def claim_probe(app: App, stop: threading.Event, seen: list[tuple[float, float]],
                every: float = 0.01, started: float = 0.0) -> None:
    """Until ``stop``: claim one job every ``every`` seconds with skipjack's own claim
    statement and complete it; appends (seconds since ``started`` on the monotonic clock,
    the claim's round trip in ms) to ``seen``."""
    q = app.queries
    params = claim_params("bench", 1, lease=30.0, worker="probe")
    with connect(app.dsn) as conn:
        while not stop.wait(every):
            t0 = time.monotonic()
            rows = conn.execute(q.CLAIM, params).fetchall()
            seen.append((t0 - started, (time.monotonic() - t0) * 1000))
            if rows:
                conn.execute(q.record_outcomes(len(rows)), outcome_params(
                    [Outcome(r[0], r[7], r[1], "complete") for r in rows]),
                    prepare=q.prepare_outcomes(len(rows)))


def _sample_waits(app: App, stop: threading.Event, waits: Counter[str]) -> None:
    with connect(app.dsn) as conn:
        while not stop.wait(0.02):
            for kind, event, n in conn.execute(WAITS).fetchall():
                waits[f"{kind}:{event}"] += n


def _once(settings: Settings, jobs: int, processes: int) -> dict[str, Any]:
    with fresh_app(settings.dsn, "w10") as app:
        noop = register(app)["noop"]
        claims: list[tuple[float, float]] = []
        waits: Counter[str] = Counter()
        stop = threading.Event()
        workers = WorkerProcesses(app, processes, "--concurrency", str(CONCURRENCY))
        counter = StateCounter(app)
        try:
            workers.wait_listening()
            helpers = [threading.Thread(target=claim_probe, args=(app, stop, claims)),
                       threading.Thread(target=_sample_waits, args=(app, stop, waits))]
            for helper in helpers:
                helper.start()
            app.enqueue_many(noop.job(i=i) for i in range(jobs))
            wait_for(lambda: counter() >= jobs, 120 + jobs / 200, what="W10 jobs")
            stop.set()
            for helper in helpers:
                helper.join()
        finally:
            stop.set()
            counter.close()
            workers.stop()
        done, span = drain_span(app)
    return {"jobs_per_s": rate(done, span), "claim_ms": percentiles([ms for _, ms in claims]),
            "wait_events": dict(waits.most_common(8))}


def w10(settings: Settings) -> dict[str, Any]:
    """W10 (see the module's doc): one run per process count."""
    jobs = settings.n(20_000, minimum=500)
    out: dict[str, Any] = {"jobs": jobs, "concurrency": CONCURRENCY, "by_processes": {}}
    for n in PROCESS_COUNTS:
        settings.log(f"W10 many workers: {n} process(es) x concurrency {CONCURRENCY}, "
                     f"{jobs} jobs")
        out["by_processes"][str(n)] = _once(settings, jobs, n)
    return out
