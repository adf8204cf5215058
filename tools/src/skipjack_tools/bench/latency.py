"""W3 enqueue-to-start latency on an idle worker, W5 latency under a steady load, and W9
how late delayed and retried jobs start."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from typing import Any

from skipjack import Backoff, current_job
from skipjack.app import App

from .common import QUEUE, Settings, count_state, fresh_app, median, percentiles, quiet_job_failures
from .worker_run import StateCounter, run_worker

TASK = "bench.latency"


def _latency_app(app: App, seen: list[float], starts: dict[int, float] | None = None) -> None:
    @app.task(name=TASK, queue=QUEUE)
    async def latency(t0: float, i: int = -1) -> None:
        """Records handler start minus the moment before the enqueue call, in ms (and, with
        ``starts``, the start time of job number ``i``)."""
        now = time.time()
        seen.append((now - t0) * 1000)
        if starts is not None:
            starts[i] = now


def _w3_once(settings: Settings, jobs: int) -> tuple[list[float], list[float]]:
    """One W3 run: (enqueue-to-start, commit-to-start) latencies in ms. The second is the
    pickup: from the enqueue call's return (its commit) to the handler's start."""
    seen: list[float] = []
    starts: dict[int, float] = {}
    returned: dict[int, float] = {}
    with fresh_app(settings.dsn, "w3") as app:
        _latency_app(app, seen, starts)
        task = app.tasks[TASK]

        async def feed() -> None:
            await asyncio.sleep(0.5)  # the worker is listening and idle
            for i in range(jobs):
                await task.enqueue_async(t0=time.time(), i=i)
                returned[i] = time.time()
                await asyncio.sleep(0.02)
            while len(seen) < jobs:
                await asyncio.sleep(0.01)

        run_worker(app, concurrency=10, until=feed, timeout=30 + jobs * 0.1)
    pickup = [(starts[i] - returned[i]) * 1000 for i in returned if i in starts]
    return seen, pickup


def w3(settings: Settings) -> dict[str, Any]:
    """W3: an idle in-process worker (concurrency 10, woken by LISTEN/NOTIFY); 300 jobs
    enqueued one at a time, 20 ms apart, from the same process. Milliseconds; the median of
    each percentile over ``settings.runs`` runs. ``pickup_*_ms``: from the enqueue's commit
    (its call returned) to the handler's start."""
    jobs = settings.n(300, minimum=30)
    settings.log(f"W3 latency: {jobs} jobs enqueued 20 ms apart to an idle worker")
    measured = [_w3_once(settings, jobs) for _ in range(settings.runs)]
    runs = [percentiles(total) for total, _ in measured]
    pickups = [percentiles(pickup) for _, pickup in measured]
    out: dict[str, Any] = {"jobs": jobs}
    for key in runs[0]:
        out[f"{key}_ms"] = median([r[key] for r in runs])
        out[f"pickup_{key}_ms"] = median([r[key] for r in pickups])
    out["runs"] = runs
    out["samples"] = [round(x, 3) for x in measured[-1][0]]
    return out


def _produce(dsn: str, schema: str, per_second: float, seconds: float) -> None:
    """Child process: enqueue ``per_second`` jobs a second for ``seconds``, every 10 ms."""
    app = App(dsn, schema=schema)
    _latency_app(app, [])
    task = app.tasks[TASK]
    tick = 0.01
    started = time.monotonic()
    sent = 0
    while (elapsed := time.monotonic() - started) < seconds:
        due = round(per_second * min(elapsed + tick, seconds)) - sent
        if due > 0:
            t0 = time.time()
            app.enqueue_many([task.job(t0=t0) for _ in range(due)])
            sent += due
        time.sleep(max(0.0, started + elapsed + tick - time.monotonic()))
    app.close()


def _w5_once(settings: Settings, target: float, seconds: float, concurrency: int
             ) -> dict[str, Any]:
    seen: list[float] = []
    enqueued: list[int] = []
    spawn = multiprocessing.get_context("spawn")
    with fresh_app(settings.dsn, "w5") as app:
        _latency_app(app, seen)
        counter = StateCounter(app)
        producer = spawn.Process(target=_produce, args=(app.dsn, app.schema, target, seconds))

        async def until() -> None:
            producer.start()
            while producer.is_alive():
                await asyncio.sleep(0.05)
            total = await asyncio.to_thread(count_all, app)
            deadline = time.monotonic() + seconds + 10  # a backlog past this is reported
            while (await asyncio.to_thread(counter) < total
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.05)
            enqueued.append(total)

        try:
            started = time.monotonic()
            run_worker(app, concurrency=concurrency, until=until, timeout=3 * seconds + 60)
            elapsed = time.monotonic() - started
        finally:
            counter.close()
            if producer.is_alive():
                producer.kill()
            if producer.pid is not None:
                producer.join()
    total = enqueued[0] if enqueued else len(seen)
    return {"target_jobs_per_s": round(target, 1),
            "enqueued_jobs_per_s": round(total / seconds, 1),
            "enqueued": total, "started": len(seen), "backlog_left": total - len(seen),
            "wall_seconds": round(elapsed, 2),
            **{f"{k}_ms": v for k, v in percentiles(seen).items()}}


def w5(settings: Settings, max_rate: float, concurrency: int) -> dict[str, Any]:
    """W5: a producer process enqueues at 50% and 90% of the W2 maximum (every 10 ms) for
    5 s while one in-process worker works; latency percentiles (ms) of handler start -
    enqueue time. The producer shares the 2 cores, so the worker may fall behind: jobs not
    started 15 s after the producer ended are reported as ``backlog_left``."""
    seconds = settings.seconds(5.0, 1.0)
    out: dict[str, Any] = {"w2_max_jobs_per_s": max_rate, "seconds": seconds,
                           "concurrency": concurrency, "by_load": {}}
    for share in (0.5, 0.9):
        target = max_rate * share
        settings.log(f"W5 continuous: {target:.0f} jobs/s for {seconds:.0f} s")
        out["by_load"][f"{round(share * 100)}%"] = _w5_once(settings, target, seconds,
                                                             concurrency)
    return out


def count_all(app: App) -> int:
    """Every job in the app's schema, whatever its state."""
    return sum(count_state(app, s) for s in ("available", "running", "succeeded"))


LATE_TASK = "bench.lateness"
RETRY_TASK = "bench.retried_once"


def _lateness_once(settings: Settings, jobs: int) -> tuple[list[float], list[float]]:
    delayed: list[float] = []
    retried: list[float] = []
    with fresh_app(settings.dsn, "w9") as app:

        @app.task(name=LATE_TASK, queue=QUEUE)
        async def late() -> None:
            """Records its start minus its due time (run_at), in ms."""
            job = current_job().job
            delayed.append((time.time() - job.run_at.timestamp()) * 1000)

        @app.task(name=RETRY_TASK, queue=QUEUE, max_attempts=2,
                  backoff=Backoff(base=0.05, cap=0.2))
        async def retried_once() -> None:
            """Fails its first attempt; records the retry's start minus its due time."""
            job = current_job().job
            if job.attempt == 1:
                raise RuntimeError("retry me")
            retried.append((time.time() - job.run_at.timestamp()) * 1000)

        rng = random.Random(9)

        async def feed() -> None:
            await asyncio.sleep(0.5)  # the worker is listening and idle
            for i in range(jobs):
                if i % 2:
                    await app.tasks[RETRY_TASK].enqueue_async()
                else:
                    await app.tasks[LATE_TASK].configure(
                        delay=rng.uniform(0.05, 1.5)).enqueue_async()
                await asyncio.sleep(0.02)
            while len(delayed) + len(retried) < jobs:
                await asyncio.sleep(0.01)

        with quiet_job_failures():  # half the jobs fail once on purpose: not news
            run_worker(app, concurrency=10, until=feed, timeout=30 + jobs * 0.1)
    return delayed, retried


def w9(settings: Settings) -> dict[str, Any]:
    """W9: how late delayed and retried jobs start, on an idle in-process worker with the
    default stage interval (1 s): half the jobs enqueued with a delay of 50 ms to 1.5 s,
    half failing once with a 50-200 ms backoff; 20 ms apart. Milliseconds from each job's due
    time (run_at) to its handler's start; the median of each percentile over the runs."""
    jobs = settings.n(200, minimum=20)
    settings.log(f"W9 lateness: {jobs} jobs, delayed or retried, to an idle worker")
    samples = [_lateness_once(settings, jobs) for _ in range(settings.runs)]
    out: dict[str, Any] = {"jobs": jobs}
    for index, kind in enumerate(("delayed", "retried")):
        runs = [percentiles(s[index]) for s in samples]
        out[kind] = {f"{key}_ms": median([r[key] for r in runs]) for key in runs[0]}
    return out
