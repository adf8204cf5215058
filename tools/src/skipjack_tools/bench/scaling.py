"""W10: many worker processes against one server. 1, 2, 4 and 8 worker processes at
concurrency 50 drain one backlog of no-op jobs; for each count: throughput, the claim
latency a client sees meanwhile, and what the server's active sessions waited on.

The claim latency comes from a probe: one more connection, in a process of its own, that
claims one job every 10 ms with skipjack's own claim statement (and completes it), timing
each claim. The wait events are sampled from ``pg_stat_activity`` every 20 ms (LWLock and
MultiXact waits are the ones to watch: contention on the claim's index and on row locks).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import Counter
from multiprocessing.synchronize import Event as ProcessEvent
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


READY = "ready"  # what the probe's process sends once its connection is open


def _probe_main(dsn: str, schema: str, every: float, stop: ProcessEvent, out: Any) -> None:
    """The probe's process: until ``stop``, claim one job every ``every`` seconds with
    skipjack's own claim statement and complete it; sends READY through ``out`` once its
    connection is open, then, at the end, the (``time.monotonic()`` reading, the claim's
    round trip in ms) pairs."""
    app = App(dsn, schema=schema)
    q = app.queries
    params = claim_params("bench", 1, lease=30.0, worker="probe")
    seen: list[tuple[float, float]] = []
    try:
        with connect(dsn) as conn:
            out.send(READY)
            while not stop.wait(every):
                t0 = time.monotonic()
                rows = conn.execute(q.CLAIM, params).fetchall()
                seen.append((t0, (time.monotonic() - t0) * 1000))
                if rows:
                    conn.execute(q.record_outcomes(len(rows)), outcome_params(
                        [Outcome(r[0], r[7], r[1], "complete") for r in rows]),
                        prepare=q.prepare_outcomes(len(rows)))
    finally:
        out.send(seen)
        app.close()


class ClaimProbe:
    """A claim probe (one job claimed and completed every ``every`` seconds, each claim
    timed) in a process of its own, from entering the ``with`` block (which returns once
    the probe's connection is open) to :meth:`stop` (leaving the block ends a probe that
    is still running).

    In a thread of the bench's process, a claim's round trip could also hold the time the
    thread waited for Python's GIL while the bench's other threads ran (an enqueuer
    building thousands of jobs a second): up to the interpreter's 5 ms switch interval,
    the bench's cost, not the server's. ``every`` is in seconds."""

    def __init__(self, app: App, every: float = 0.01) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._results, sender = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_probe_main, name="skipjack-bench-claim-probe", daemon=True,
            args=(app.dsn, app.schema, every, self._stop, sender))

    def __enter__(self) -> ClaimProbe:
        self._process.start()
        if self._receive() != READY:
            self._process.kill()
            raise RuntimeError("the claim probe's process sent no word that it was ready")
        return self

    def _receive(self, timeout: float = 60.0) -> Any:
        """The probe process's next message; RuntimeError if it ends or sends none within
        ``timeout`` seconds (the process is then killed)."""
        deadline = time.monotonic() + timeout
        while not self._results.poll(0.5):
            if not self._process.is_alive() or time.monotonic() > deadline:
                self._process.kill()
                raise RuntimeError(f"the claim probe's process ended or fell silent "
                                   f"(exit code {self._process.exitcode})")
        return self._results.recv()

    def __exit__(self, *exc: object) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10.0)

    def stop(self, since: float = 0.0) -> list[tuple[float, float]]:
        """Stop the probe; returns its (seconds since ``since``, claim in ms) pairs.

        ``since`` is a ``time.monotonic()`` reading of this process (the clock is the
        system's, the same in the probe's process). Raises RuntimeError when the probe's
        process ended without its results."""
        self._stop.set()
        seen = [(at - since, ms) for at, ms in self._receive()]
        self._process.join(10.0)
        if self._process.exitcode != 0:
            raise RuntimeError(f"the claim probe's process failed (exit code "
                               f"{self._process.exitcode}); its error is printed above")
        return seen


def _sample_waits(app: App, stop: threading.Event, waits: Counter[str]) -> None:
    with connect(app.dsn) as conn:
        while not stop.wait(0.02):
            for kind, event, n in conn.execute(WAITS).fetchall():
                waits[f"{kind}:{event}"] += n


def _once(settings: Settings, jobs: int, processes: int) -> dict[str, Any]:
    with fresh_app(settings.dsn, "w10") as app:
        noop = register(app)["noop"]
        waits: Counter[str] = Counter()
        stop = threading.Event()
        workers = WorkerProcesses(app, processes, "--concurrency", str(CONCURRENCY))
        counter = StateCounter(app)
        try:
            workers.wait_listening()
            sampler = threading.Thread(target=_sample_waits, args=(app, stop, waits))
            with ClaimProbe(app) as probe:
                sampler.start()
                app.enqueue_many(noop.job(i=i) for i in range(jobs))
                wait_for(lambda: counter() >= jobs, 120 + jobs / 200, what="W10 jobs")
                stop.set()
                sampler.join()
                claims = probe.stop()
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
