"""``skipjack demo``: webhook delivery to a slow, flaky local receiver, then an audit.

A local HTTP receiver on 127.0.0.1 (random port) answers each POST after 1-5 ms and refuses
a share of them with 429 or 500. The demo enqueues deliveries, each with an idempotency key
(also sent as the ``Idempotency-Key`` header), while a worker delivers them and retries
failures with backoff and jitter. The receiver counts deliveries per key, so a duplicate is
visible. The demo uses its own schema, which it empties at the start.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from skipjack.app import App
from skipjack.context import current_job
from skipjack.retry import Backoff
from skipjack.runtime.worker import Worker

from .sql import DROP_SCHEMA, RUN_SUMMARY, render


class Receiver(ThreadingHTTPServer):
    """A webhook endpoint that is slow and fails on purpose; counts deliveries per key."""

    daemon_threads = True

    def __init__(self, fail_rate: float, seed: int | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _ReceiverHandler)
        self.fail_rate = fail_rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.delivered: Counter[str] = Counter()
        self.refused: Counter[int] = Counter()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"


class _ReceiverHandler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(self.server.rng.uniform(0.001, 0.005))
        with self.server.lock:
            fail = self.server.rng.random() < self.server.fail_rate
            status = self.server.rng.choice((429, 500)) if fail else 200
            if fail:
                self.server.refused[status] += 1
            else:
                self.server.delivered[self.headers.get("Idempotency-Key", "")] += 1
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


def _percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def run_demo(
    dsn: str | None,
    *,
    schema: str = "skipjack_demo",
    jobs: int = 5000,
    concurrency: int = 32,
    fail_rate: float = 0.1,
    progress: bool = True,
    timeout: float | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the webhook demo and return its summary (see the module docstring).

    Args:
        dsn: database URI, or None for the configured/embedded server.
        schema: the demo's own schema; dropped and re-created at the start.
        jobs: deliveries to enqueue.
        concurrency: the worker's concurrency.
        fail_rate: share of requests refused with 429/500 (0..0.9).
        progress: show a progress bar on the terminal (on ``console``, which log lines of the
            run then go through, above the bar).
        timeout: seconds to wait for the queue to drain (default: 60 + jobs / 20).

    Returns:
        A dict with enqueued, delivered, retried (jobs that needed more than one attempt),
        retries (failed attempts retried), discarded, duplicate_deliveries, lost,
        throughput_jobs_per_s and latency_ms (p50/p95/p99 of enqueue-to-start).
    """
    app = App(dsn, schema=schema)
    logging.getLogger("skipjack.cli").info("database: %s", app.db.where())
    with app.connect() as conn:
        conn.execute(render(DROP_SCHEMA, app.schema))
    app.migrate()
    receiver = Receiver(fail_rate)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    latencies: list[float] = []

    @app.task(name="demo.deliver_webhook", queue="webhooks", max_attempts=12,
              backoff=Backoff(base=0.05, cap=2.0))
    def deliver_webhook(url: str, event: dict[str, Any]) -> None:
        job = current_job().job
        if job.attempt == 1:
            latencies.append((job.attempted_at - job.created_at).total_seconds() * 1000)
        request = urllib.request.Request(
            url, data=str(event).encode(), method="POST",
            headers={"Idempotency-Key": job.idempotency_key or "", "Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(request, timeout=10):
            pass  # urlopen raises HTTPError for 429/500: the attempt fails and is retried

    run_id = uuid.uuid4().hex[:8]
    specs = [deliver_webhook.configure(idempotency_key=f"{run_id}-{i}").job(
        url=receiver.url, event={"id": i, "type": "order.paid", "amount_cents": 100 + i})
        for i in range(jobs)]
    worker = Worker(app, ["webhooks"], concurrency=concurrency, lease=10, poll_interval=1.0,
                    shutdown_grace=5)
    deadline = time.monotonic() + (timeout if timeout is not None else 60 + jobs / 20)

    async def main() -> float:
        running = asyncio.create_task(worker.run_async())
        started = time.monotonic()

        def enqueue_all() -> None:
            for i in range(0, len(specs), 250):
                app.enqueue_many(specs[i:i + 250])

        feeder = asyncio.create_task(asyncio.to_thread(enqueue_all))
        bar = Progress(TextColumn("delivering webhooks"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), disable=not progress, console=console)
        with bar, _logs_above(bar if progress else None):
            tid = bar.add_task("jobs", total=jobs)
            while time.monotonic() < deadline:
                done = await asyncio.to_thread(_finished, app)
                bar.update(tid, completed=done)
                if done >= jobs and feeder.done():
                    break
                await asyncio.sleep(0.2)
        await feeder
        worker.stop()
        await running
        return time.monotonic() - started

    elapsed = asyncio.run(main())
    receiver.shutdown()
    counts = {state: n for by_state in app.state_counts().values()
              for state, n in by_state.items()}
    with app.connect() as conn:
        retried, span = conn.execute(render(RUN_SUMMARY, app.schema)).fetchone() or (0, None)
    app.close()
    delivered = counts.get("succeeded", 0)
    discarded = counts.get("discarded", 0)
    return {
        "enqueued": jobs,
        "delivered": delivered,
        "retried": retried,
        "retries": worker.stats.retried,
        "discarded": discarded,
        "duplicate_deliveries": sum(n - 1 for n in receiver.delivered.values() if n > 1),
        "lost": jobs - delivered - discarded,
        "refused_by_receiver": {str(k): v for k, v in sorted(receiver.refused.items())},
        "elapsed_s": round(elapsed, 3),
        "throughput_jobs_per_s": round(jobs / span, 1) if span else None,
        "latency_ms": {f"p{p}": _round(_percentile(latencies, p)) for p in (50, 95, 99)},
        "latency_mean_ms": _round(statistics.fmean(latencies)) if latencies else None,
    }


@contextmanager
def _logs_above(bar: Progress | None) -> Iterator[None]:
    """While the bar shows, log lines are printed above it (rich redraws it) instead of
    through it."""
    if bar is None:
        yield
        return
    root = logging.getLogger()
    saved = root.handlers[:]
    handler = RichHandler(console=bar.console, show_path=False)
    root.handlers = [handler]
    try:
        yield
    finally:
        root.handlers = saved


def explain(summary: dict[str, Any]) -> Table:
    """The summary for people: each figure with one line saying what it counts."""
    latency = summary["latency_ms"]
    rows = [
        ("enqueued", summary["enqueued"], "webhook deliveries enqueued, in one burst"),
        ("delivered", summary["delivered"], "jobs that succeeded (the receiver answered 200)"),
        ("retried", summary["retried"], "of them, jobs that needed more than one attempt"),
        ("retries", summary["retries"], "failed attempts that were retried (a job can fail "
                                        "several times)"),
        ("discarded", summary["discarded"], "jobs that used all 12 attempts (the dead letter)"),
        ("duplicates", summary["duplicate_deliveries"],
         "deliveries the receiver saw twice for one idempotency key"),
        ("lost", summary["lost"], "enqueued - delivered - discarded: must be 0"),
        ("throughput", f"{summary['throughput_jobs_per_s']} jobs/s",
         "from the first start to the last finish"),
        ("latency p50/p95/p99",
         f"{latency['p50']} / {latency['p95']} / {latency['p99']} ms",
         "enqueue to first start: mostly waiting behind the burst (the jobs arrive faster "
         "than the worker delivers them); an idle worker starts a job in milliseconds "
         "(W3 in docs/performance.md)"),
    ]
    table = Table(title="webhook demo", show_header=True)
    for column in ("figure", "value", "what it counts"):
        table.add_column(column)
    for name, value, meaning in rows:
        table.add_row(name, str(value), meaning)
    return table


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _finished(app: App) -> int:
    counts = app.state_counts().get("webhooks", {})
    return int(counts.get("succeeded", 0) + counts.get("discarded", 0))
