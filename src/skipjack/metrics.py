"""Prometheus metrics (the optional extra ``skipjack[prometheus]``, which installs
``prometheus_client``).

Two sources, each served over HTTP for Prometheus to scrape:

- a worker's own counters, histograms and gauges: ``MetricsHook`` (a
  ``skipjack.hooks.Hook``, so enqueues of a web process are counted too) and
  ``serve_worker`` (``skipjack worker --metrics-port``);
- the queue as the database holds it, whichever workers run: ``QueueCollector``
  (``skipjack metrics --port``).

Worker metrics (``queue`` and ``task`` labels; ``outcome`` is one of succeeded, retried,
discarded, cancelled, snoozed, released, lost, stale: see ``skipjack.hooks.Attempt``):

=========================================  ================================================
``skipjack_jobs_enqueued_total``           jobs created by enqueue calls of this process
                                           (an idempotency key that matched an existing
                                           job creates none)
``skipjack_jobs_started_total``            attempts whose handler started (counted as
                                           each ends)
``skipjack_jobs_total{outcome}``           attempts by what became of them
``skipjack_job_failures_total{error}``     attempts whose handler raised (``error``: the
                                           exception's class name), retried or discarded
``skipjack_job_start_latency_seconds``     histogram: from when the job became runnable
                                           (its enqueue, or its ``run_at``) to its claim,
                                           on the database clock
``skipjack_job_run_seconds``               histogram: how long handlers ran
``skipjack_worker_running``                jobs running now (``worker`` label)
``skipjack_worker_buffered``               jobs claimed ahead, waiting for a slot
``skipjack_worker_outcomes_pending``       outcomes waiting to be written
``skipjack_worker_concurrency``            the worker's slots
``skipjack_worker_pool_connections``       connections of the handlers' pools (``pool``:
                                           sync or async; ``status``: open or idle)
``skipjack_worker_rescued_total``          jobs with an expired lease (their worker
                                           crashed or was cut off) that this worker's
                                           rescuer returned to their queue
=========================================  ================================================

Queue metrics (see ``QueueCollector``): ``skipjack_queue_jobs{queue,state}`` for
scheduled, available, running and discarded (the dead letter) jobs,
``skipjack_queue_oldest_runnable_seconds{queue}``, ``skipjack_queue_paused{queue}``,
``skipjack_queue_concurrency_limit{queue}``, ``skipjack_queue_rate_limit{queue}`` (starts
per ``skipjack_queue_rate_period_seconds``), ``skipjack_workers`` (live workers) and
``skipjack_jobs_estimated_rows`` (the whole table, history included, as the planner
estimates it). No label holds a job id or any other unbounded value.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Iterator
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import psycopg

try:
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector
except ModuleNotFoundError as missing:  # pragma: no cover - depends on the installation
    missing.msg += (": skipjack.metrics needs prometheus_client "
                    "(pip install 'skipjack[prometheus]')")
    raise

from .hooks import Attempt, EnqueueCall, Hook

if TYPE_CHECKING:
    from .admin import Admin
    from .runtime.worker import Worker

# Bucket bounds, in seconds: from a millisecond (a claim right after an enqueue, a no-op
# handler) to an hour (a backlog, a long export).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

# The seconds QueueCollector keeps a summary before it reads the database again, and between
# two warnings that it cannot.
QUEUE_CACHE_SECONDS = 10.0
FAILURE_LOG_EVERY = 60.0

log = logging.getLogger("skipjack.metrics")


class _Series:
    """The counts of one (queue, task) pair."""

    __slots__ = ("ended", "latency", "latency_sum", "run", "run_sum", "started")

    def __init__(self) -> None:
        self.started = 0
        self.ended: dict[str, int] = {}
        # a count per bucket (not cumulative), the last for +Inf
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.run = [0] * (len(LATENCY_BUCKETS) + 1)
        self.run_sum = 0.0


class _Metrics(Collector):
    """The worker metrics of one registry, kept in plain Python objects and turned into
    samples at each scrape: counting an attempt costs one lock and a few increments, not
    prometheus_client's locks per sample (its Histogram.observe alone took microseconds)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.enqueued: dict[tuple[str, str], int] = {}
        self.series: dict[tuple[str, str], _Series] = {}
        self.failures: dict[tuple[str, str, str], int] = {}
        self.workers = _WorkerCollector()

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            enqueued, failures = dict(self.enqueued), dict(self.failures)
            series = {key: (s.started, dict(s.ended), list(s.latency), s.latency_sum,
                            list(s.run), s.run_sum) for key, s in self.series.items()}
        started = {key: v[0] for key, v in series.items()}
        ended = {(*key, outcome): n for key, v in series.items() for outcome, n in v[1].items()}
        for name, text, labels, values in (
                ("skipjack_jobs_enqueued", "Jobs created by enqueue calls.",
                 ["queue", "task"], enqueued),
                ("skipjack_jobs_started", "Attempts whose handler started (counted as they "
                 "end).", ["queue", "task"], started),
                ("skipjack_jobs", "Attempts by what became of them.",
                 ["queue", "task", "outcome"], ended),
                ("skipjack_job_failures", "Attempts whose handler raised, by exception class.",
                 ["queue", "task", "error"], failures)):
            family = CounterMetricFamily(name, text, labels=labels)
            for key, n in sorted(values.items()):
                family.add_metric(list(key), n)
            yield family
        latency = {key: (v[2], v[3]) for key, v in series.items() if v[0]}
        run = {key: (v[4], v[5]) for key, v in series.items() if v[0]}
        for name, text, histograms in (
                ("skipjack_job_start_latency_seconds",
                 "From when a job became runnable to its claim.", latency),
                ("skipjack_job_run_seconds", "How long handlers ran.", run)):
            histogram = HistogramMetricFamily(name, text, labels=["queue", "task"])
            for key, (counts, total_sum) in sorted(histograms.items()):
                total, cumulative = 0, []
                for bound, n in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
                    total += n
                    cumulative.append((_le(bound), total))
                histogram.add_metric(list(key), cumulative, total_sum)
            yield histogram
        yield from self.workers.collect()


def _le(bound: float) -> str:
    """A bucket's ``le`` label as Prometheus writes it: 0.25, 1.0, +Inf."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, _Metrics] = \
    weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _metrics(registry: CollectorRegistry) -> _Metrics:
    with _LOCK:
        found = _BY_REGISTRY.get(registry)
        if found is None:
            found = _BY_REGISTRY[registry] = _Metrics()
            registry.register(found)
        return found


class MetricsHook(Hook):
    """Counts enqueues and attempts into Prometheus metrics (see ``skipjack.metrics``).

    Every count of an attempt is taken as it ends (in ``ended``), on the worker's event
    loop: ``skipjack_jobs_started_total`` and the start latency count an attempt once its
    handler has returned or raised (the ``skipjack_worker_running`` gauge shows the ones
    still running).

    Args:
        registry: where the metrics are registered (default: prometheus_client's global
            ``REGISTRY``, which ``start_http_server`` serves). Several hooks on one registry
            share its metrics.
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self._m = _metrics(registry)

    def enqueue(self, call: EnqueueCall) -> AbstractContextManager[object]:
        return _CountEnqueued(self._m, call)

    def ended(self, attempt: Attempt) -> None:
        m, job = self._m, attempt.job
        key = (job.queue, job.task)
        with m.lock:
            series = m.series.get(key)
            if series is None:
                series = m.series[key] = _Series()
            series.ended[attempt.outcome] = series.ended.get(attempt.outcome, 0) + 1
            duration = attempt.duration
            if duration is None:
                return
            series.started += 1
            wait = (job.attempted_at - max(job.run_at, job.created_at)).total_seconds()
            if wait < 0.0:
                wait = 0.0
            series.latency[bisect_left(LATENCY_BUCKETS, wait)] += 1
            series.latency_sum += wait
            series.run[bisect_left(LATENCY_BUCKETS, duration)] += 1
            series.run_sum += duration
            if attempt.error is not None and attempt.outcome in ("retried", "discarded"):
                failure = (job.queue, job.task, type(attempt.error).__name__)
                m.failures[failure] = m.failures.get(failure, 0) + 1

    def watch(self, worker: Worker) -> None:
        """Serve ``worker``'s gauges (running, buffered, outcomes pending, pools) with these
        metrics, for as long as the worker object lives."""
        self._m.workers.add(worker)


class _CountEnqueued:
    """Counts the jobs a successful enqueue call created, by queue and task."""

    def __init__(self, m: _Metrics, call: EnqueueCall) -> None:
        self._m = m
        self._call = call

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        call = self._call
        if exc is not None or call.ids is None:
            return
        counts: dict[tuple[str, str], int] = {}
        for spec, job_id in zip(call.jobs, call.ids, strict=False):
            if job_id in call.inserted:
                key = (spec.queue, spec.task)
                counts[key] = counts.get(key, 0) + 1
        with self._m.lock:
            for key, n in counts.items():
                self._m.enqueued[key] = self._m.enqueued.get(key, 0) + n


class _WorkerCollector(Collector):
    """The gauges of the workers being watched, read at each scrape."""

    def __init__(self) -> None:
        super().__init__()
        self._workers: dict[int, weakref.ref[Worker]] = {}  # (a Worker is not hashable)

    def add(self, worker: Worker) -> None:
        self._workers[id(worker)] = weakref.ref(worker)

    def _alive(self) -> list[Worker]:
        alive = []
        for key, ref in list(self._workers.items()):
            worker = ref()
            if worker is None:
                self._workers.pop(key, None)
            else:
                alive.append(worker)
        return alive

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families = {
            name: GaugeMetricFamily(f"skipjack_worker_{name}", text, labels=["worker"])
            for name, text in (("running", "Jobs running now."),
                               ("buffered", "Jobs claimed ahead, waiting for a slot."),
                               ("outcomes_pending", "Outcomes waiting to be written."),
                               ("concurrency", "The worker's slots."),
                               ("prefetch", "Jobs the worker claims ahead of free slots "
                                            "now (adaptive unless set)."))}
        rescued = CounterMetricFamily("skipjack_worker_rescued",
                                      "Jobs whose lease had expired (a worker crashed or was "
                                      "cut off) that this worker's rescuer returned.",
                                      labels=["worker"])
        pools = GaugeMetricFamily("skipjack_worker_pool_connections",
                                  "Connections of the handlers' pools.",
                                  labels=["worker", "pool", "status"])
        for worker in self._alive():
            gauges = worker.gauges()
            for name, family in families.items():
                family.add_metric([worker.name], gauges[name])
            for (pool, status), value in worker.pool_gauges().items():
                pools.add_metric([worker.name, pool, status], value)
            rescued.add_metric([worker.name], worker.stats.rescued)
        yield from families.values()
        yield pools
        yield rescued


def serve_worker(worker: Worker, port: int, host: str = "0.0.0.0",
                 registry: CollectorRegistry = REGISTRY) -> Any:
    """Count ``worker``'s app's enqueues and attempts (adding a ``MetricsHook`` unless
    the app has one on ``registry``), and serve them with the worker's gauges at
    ``http://host:port/metrics`` from a daemon thread.

    Args:
        worker: the worker (its ``app`` gets the hook).
        port: TCP port, 1..65535 (0: any free one, see the returned server).
        host: address to listen on (default every interface, for Prometheus to reach).
        registry: the registry to serve.

    Returns:
        The HTTP server (``server.server_port`` is the port; ``server.shutdown()`` stops it).

    Raises:
        OSError: the port cannot be bound.
    """
    hook = next((h for h in worker.app.hooks
                 if isinstance(h, MetricsHook) and h.registry is registry), None)
    if hook is None:
        hook = MetricsHook(registry)
        worker.app.add_hook(hook)
    hook.watch(worker)
    server, _thread = start_http_server(port, host, registry=registry)
    return server


class QueueCollector(Collector):
    """Queue-level gauges read from the database (see ``skipjack.metrics``), through
    ``skipjack.admin.Admin.queue_summary``: every count comes from the partial index of
    its state, so a scrape costs in proportion to the waiting, running and discarded jobs,
    never to the succeeded history. A summary is kept ``cache_seconds`` and shared by the
    scrapes in that time; scrapes never read the database more often.

    Args:
        app: the application (an ``skipjack.App``) whose database is read.
        cache_seconds: seconds a summary is reused (>= 0).

    If the database cannot be read, the scrape reports ``skipjack_up 0`` and no other
    gauge (and 1 with them when it can).
    """

    def __init__(self, app: Admin, cache_seconds: float = QUEUE_CACHE_SECONDS) -> None:
        self._app = app
        self._cache_seconds = cache_seconds
        self._lock = threading.Lock()
        self._summary: dict[str, Any] | None = None
        self._read_at = float("-inf")
        self._failing = False
        self._logged_at = float("-inf")

    def _read(self) -> dict[str, Any] | None:
        with self._lock:
            now = time.monotonic()
            if self._summary is None or now - self._read_at >= self._cache_seconds:
                try:
                    self._summary = self._app.queue_summary()
                    if self._failing:
                        log.info("the database can be read again")
                    self._failing = False
                except psycopg.Error as exc:
                    self._summary = None
                    if not self._failing or now - self._logged_at >= FAILURE_LOG_EVERY:
                        log.warning("cannot read the queue's state from the database: %s "
                                    "(skipjack_up is 0)", str(exc).strip())
                        self._logged_at = now
                    self._failing = True
                self._read_at = now
            return self._summary

    def collect(self) -> Iterator[GaugeMetricFamily]:
        summary = self._read()
        up = GaugeMetricFamily("skipjack_up", "Whether the database could be read.")
        up.add_metric([], 0 if summary is None else 1)
        yield up
        if summary is None:
            return
        depth = GaugeMetricFamily("skipjack_queue_jobs", "Jobs per queue and state "
                                  "(scheduled, available, running, discarded).",
                                  labels=["queue", "state"])
        for queue, states in sorted(summary["depth"].items()):
            for state in ("scheduled", "available", "running", "discarded"):
                depth.add_metric([queue, state], states.get(state, 0))
        yield depth
        oldest = GaugeMetricFamily("skipjack_queue_oldest_runnable_seconds",
                                   "Age of the oldest runnable job per queue.",
                                   labels=["queue"])
        for queue, age in sorted(summary["oldest_runnable_seconds"].items()):
            oldest.add_metric([queue], max(float(age), 0.0))
        yield oldest
        paused = GaugeMetricFamily("skipjack_queue_paused", "1 for a paused queue.",
                                   labels=["queue"])
        concurrency = GaugeMetricFamily("skipjack_queue_concurrency_limit",
                                        "A queue's concurrency limit.", labels=["queue"])
        rate = GaugeMetricFamily("skipjack_queue_rate_limit",
                                 "A queue's rate limit: jobs claimed per period.", labels=["queue"])
        period = GaugeMetricFamily("skipjack_queue_rate_period_seconds",
                                   "The period of a queue's rate limit.", labels=["queue"])
        for row in summary["queues"]:
            paused.add_metric([row["name"]], 1 if row["paused"] else 0)
            if row["concurrency_limit"] is not None:
                concurrency.add_metric([row["name"]], row["concurrency_limit"])
            if row["rate_limit"] is not None:
                rate.add_metric([row["name"]], row["rate_limit"])
                period.add_metric([row["name"]], row["rate_period"])
        yield from (paused, concurrency, rate, period)
        workers = GaugeMetricFamily("skipjack_workers", "Live workers in the registry.")
        workers.add_metric([], summary["workers"])
        yield workers
        rows = GaugeMetricFamily("skipjack_jobs_estimated_rows",
                                 "The jobs table's rows as the planner estimates them.")
        rows.add_metric([], summary["estimated_rows"])
        yield rows


def serve_queue(app: Admin, port: int, host: str = "0.0.0.0",
                cache_seconds: float = QUEUE_CACHE_SECONDS) -> Any:
    """Serve ``QueueCollector`` gauges of ``app`` at ``http://host:port/metrics`` from a
    daemon thread, on a registry of their own; returns the HTTP server (see
    ``serve_worker``).

    Raises:
        OSError: the port cannot be bound.
    """
    registry = CollectorRegistry()
    registry.register(QueueCollector(app, cache_seconds))
    server, _thread = start_http_server(port, host, registry=registry)
    return server
