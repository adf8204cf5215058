"""W2 drain, W4 the article's 2 ms case (docs/performance.md), and worker memory (RSS)."""

from __future__ import annotations

import functools
import time
from typing import Any

from . import raw
from .common import QUEUE, Settings, drain_span, fresh_app, payload, rate, repeat, wait_for
from .tasks import register
from .worker_run import StateCounter, WorkerProcesses, drain_with_process


def _drain_once(settings: Settings, jobs: int, concurrency: int) -> dict[str, Any]:
    with fresh_app(settings.dsn, "w2") as app:
        noop = register(app)["noop"]
        app.enqueue_many(noop.job(i=i) for i in range(jobs))
        drain_with_process(app, jobs, "--concurrency", str(concurrency),
                           timeout=60 + jobs / 200, metrics=settings.metrics)
        done, span = drain_span(app)
    return {"jobs_per_s": rate(done, span), "seconds": round(span or 0, 3)}


def drain_rate(settings: Settings, jobs: int, concurrency: int) -> float | None:
    """One W2 drain of ``jobs`` no-op jobs at ``concurrency``: jobs/s."""
    value = _drain_once(settings, jobs, concurrency)["jobs_per_s"]
    return float(value) if value else None


def _drain_cost(settings: Settings, jobs: int, concurrency: int) -> dict[str, Any]:
    """What one job of a W2 drain costs: the server's and the worker process's CPU (from
    its start-up on, which is not counted: the queue is paused until the worker listens),
    WAL bytes and commits (see :func:`raw.cost`)."""
    with fresh_app(settings.dsn, "w2cost") as app:
        noop = register(app)["noop"]
        app.pause_queue(QUEUE)
        app.enqueue_many(noop.job(i=i) for i in range(jobs))
        workers = WorkerProcesses(app, 1, "--concurrency", str(concurrency), logged=True)
        counter = StateCounter(app)

        def drain() -> None:
            app.resume_queue(QUEUE)
            wait_for(lambda: counter() >= jobs, 60 + jobs / 200, what="W2 cost jobs")

        try:
            workers.wait_listening()
            return raw.cost(app.dsn, jobs, drain, client_pid=workers.procs[0].pid,
                            settle=raw.settle_for(settings))
        finally:
            counter.close()
            workers.stop()


def w2(settings: Settings, concurrencies: tuple[int, ...] = (1, 10, 100)) -> dict[str, Any]:
    """W2: pre-enqueued no-op jobs drained by one in-process worker at each concurrency.

    Jobs/s is succeeded jobs over (last ``finished_at`` - first ``attempted_at``) as the
    database recorded them. Medians of ``settings.runs``; 100,000 jobs once, unless quick.
    """
    jobs = settings.n(10_000)
    out: dict[str, Any] = {"jobs": jobs, "by_concurrency": {}}
    for c in concurrencies:
        settings.log(f"W2 drain: {jobs} jobs, concurrency {c}")
        out["by_concurrency"][str(c)] = repeat(
            settings.runs, functools.partial(_drain_once, settings, jobs, c))
    best = choose_best(out)
    settings.log(f"W2 drain: {jobs} jobs, concurrency {best}, measuring the cost per job")
    out["per_job"] = _drain_cost(settings, jobs, best)
    if not settings.quick:
        big = settings.n(100_000)
        settings.log(f"W2 drain: {big} jobs, concurrency {best}")
        out["large"] = {"jobs": big, "concurrency": best, **_drain_once(settings, big, best)}
    return out


def choose_best(w2: dict[str, Any]) -> int:
    """Set ``w2``'s best concurrency (the highest jobs/s of ``by_concurrency``) and its
    jobs/s; returns that concurrency."""
    by = w2["by_concurrency"]
    best = max(by, key=lambda c: by[c].get("jobs_per_s") or 0)
    w2["best_concurrency"] = int(best)
    w2["best_jobs_per_s"] = by[best].get("jobs_per_s")
    return int(best)


def _two_ms_once(settings: Settings, jobs: int, processes: int) -> dict[str, Any]:
    with fresh_app(settings.dsn, "w4") as app:
        sleep = register(app)["sleep"]
        if processes == 1:
            app.enqueue_many(sleep.job(seconds=0.002) for _ in range(jobs))
            drain_with_process(app, jobs, "--concurrency", "8", timeout=60 + jobs / 50,
                               metrics=settings.metrics)
        else:
            workers = WorkerProcesses(app, processes, "--concurrency", "1",
                                      metrics=settings.metrics)
            counter = StateCounter(app)
            try:
                workers.wait_listening()
                app.enqueue_many(sleep.job(seconds=0.002) for _ in range(jobs))
                wait_for(lambda: counter() >= jobs, 60 + jobs / 50, what="W4 jobs")
            finally:
                counter.close()
                workers.stop()
        done, span = drain_span(app)
    return {"jobs_per_s": rate(done, span)}


def w4(settings: Settings) -> dict[str, Any]:
    """W4: 2,000 jobs whose handler sleeps 2 ms, 8 at once: one process with concurrency 8,
    and 8 worker processes of concurrency 1. The ideal is 8 / 2 ms = 4,000 jobs/s."""
    jobs = settings.n(2000)
    settings.log(f"W4 the article's case: {jobs} jobs x 2 ms, 8 concurrent (1 and 8 processes)")
    one = repeat(settings.runs, lambda: _two_ms_once(settings, jobs, 1))
    eight = repeat(settings.runs, lambda: _two_ms_once(settings, jobs, 8))
    return {"jobs": jobs, "ideal_jobs_per_s": 4000, "one_process": one,
            "eight_processes": eight, "jobs_per_s": one["jobs_per_s"]}


def memory(settings: Settings) -> dict[str, Any]:
    """Peak RSS of a worker process at concurrency 100 draining 10,000 jobs of 2.4 KB."""
    jobs = settings.n(10_000)
    settings.log(f"memory: worker RSS at concurrency 100, {jobs} jobs of 2.4 KB")
    with fresh_app(settings.dsn, "mem") as app:
        noop = register(app)["noop"]
        data = payload()
        workers = WorkerProcesses(app, 1, "--concurrency", "100")
        counter = StateCounter(app)
        proc = workers.procs[0]
        try:
            workers.wait_listening()
            idle = _rss_kib(proc.pid, "VmRSS")
            app.enqueue_many(noop.job(data=data) for _ in range(jobs))
            started = time.monotonic()
            wait_for(lambda: counter() >= jobs, 60 + jobs / 100, what="memory-test jobs")
            elapsed = time.monotonic() - started
            peak = _rss_kib(proc.pid, "VmHWM")
        finally:
            counter.close()
            workers.stop()
    return {"jobs": jobs, "payload_bytes": len(data), "concurrency": 100,
            "idle_rss_mib": round(idle / 1024, 1), "peak_rss_mib": round(peak / 1024, 1),
            "drain_seconds": round(elapsed, 2)}


def _rss_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0

