"""Seeing what the queue does: metrics scraped over HTTP, traces across processes, hooks that
fail, JSON logs, the live worker registry and health checks, all against real PostgreSQL and
real worker processes."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from skipjack import App, Attempt, Backoff, EnqueueCall, Hook, Job
from skipjack.logs import JsonFormatter, parse_levels
from skipjack.metrics import MetricsHook
from skipjack.runtime.worker import Worker
from skipjack.tracing import TracingHook

import support
from support import TESTS, WorkerProcess, free_port, http_get, states, wait_until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    status, body = http_get(url)
    assert status == 200, body
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def enqueue_workload(app: App) -> dict[str, list[int]]:
    """45 jobs that succeed, 5 that fail once then succeed, 2 that go to the dead letter."""
    ids: dict[str, list[int]] = {}
    for task, n in (("ok", 45), ("flaky", 5), ("doomed", 2)):
        t = app.task(name=task, max_attempts=1 if task == "doomed" else 25)(lambda **kw: None)
        ids[task] = app.enqueue_many([t.job() for _ in range(n)])
    return ids


@contextmanager
def observed_worker(app: App, tmp_path: Path, *args: str, options: tuple[str, ...] = (),
                    env: dict[str, str] | None = None) -> Iterator[WorkerProcess]:
    log = tmp_path / f"worker-{len(list(tmp_path.glob('worker-*')))}.log"
    with WorkerProcess(app.dsn, app.schema, None, "--stage-interval", "0.05",
                       "--poll-interval", "0.2", *args, log=log, env=env,
                       app="observed_app:app", options=options) as worker:
        yield worker


def test_worker_metrics_count_a_known_workload(app: App, tmp_path: Path) -> None:
    """A worker's /metrics, scraped over HTTP after 50 succeeded, 5 retried and 2 discarded
    attempts: every counter has its value, and the histograms counted every attempt."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with observed_worker(app, tmp_path, "--metrics-port", str(port),
                         "--metrics-host", "127.0.0.1") as worker:
        wait_until(lambda: http_get(url)[0] == 200 if worker.proc.poll() is None else
                   pytest.fail(worker.log()), timeout=60, what="the metrics endpoint")
        enqueue_workload(app)
        wait_until(lambda: states(app.dsn, app.schema) == {"succeeded": 50, "discarded": 2},
                   timeout=120, what="the workload done")

        def settled() -> Samples | None:
            samples = scrape(url)
            done = sum(value(samples, "skipjack_jobs_total", queue="default", task=t,
                             outcome=o) for t in ("ok", "flaky", "doomed")
                       for o in ("succeeded", "retried", "discarded"))
            return samples if done == 57 else None

        samples = wait_until(settled, timeout=30, what="every outcome counted")
    jobs = "skipjack_jobs_total"
    assert value(samples, jobs, queue="default", task="ok", outcome="succeeded") == 45
    assert value(samples, jobs, queue="default", task="flaky", outcome="succeeded") == 5
    assert value(samples, jobs, queue="default", task="flaky", outcome="retried") == 5
    assert value(samples, jobs, queue="default", task="doomed", outcome="discarded") == 2
    assert value(samples, "skipjack_job_failures_total", queue="default", task="flaky",
                 error="ValueError") == 5
    assert value(samples, "skipjack_job_failures_total", queue="default", task="doomed",
                 error="RuntimeError") == 2
    started = {t: value(samples, "skipjack_jobs_started_total", queue="default", task=t)
               for t in ("ok", "flaky", "doomed")}
    assert started == {"ok": 45, "flaky": 10, "doomed": 2}
    for task, n in started.items():
        for histogram in ("skipjack_job_run_seconds", "skipjack_job_start_latency_seconds"):
            assert value(samples, histogram + "_count", queue="default", task=task) == n
            assert value(samples, histogram + "_bucket", queue="default", task=task,
                         le="+Inf") == n
    gauges = {name for name, _ in samples if name.startswith("skipjack_worker_")}
    assert {"skipjack_worker_running", "skipjack_worker_buffered",
            "skipjack_worker_outcomes_pending", "skipjack_worker_concurrency"} <= gauges
    assert not any("job_id" in dict(labels) for _, labels in samples)


def test_enqueue_metrics_count_created_jobs_only(app: App) -> None:
    """The enqueue counter of a web process counts jobs created, not the ones whose
    idempotency key matched an existing job, and nothing of a refused call."""
    registry = CollectorRegistry()
    app.add_hook(MetricsHook(registry))
    t = app.task(name="ok")(lambda **kw: None)
    app.enqueue_many([t.job(), t.job(), t.configure(idempotency_key="k").job()])
    app.enqueue(t.configure(idempotency_key="k").job())  # the same job again: none created
    app.enqueue_many(t.configure(queue="other").job() for _ in range(3))
    with pytest.raises(Exception, match="JobSpec"):
        app.enqueue_many([t.job(), "not a job"])  # type: ignore[list-item]
    get = registry.get_sample_value
    assert get("skipjack_jobs_enqueued_total", {"queue": "default", "task": "ok"}) == 3
    assert get("skipjack_jobs_enqueued_total", {"queue": "other", "task": "ok"}) == 3


def test_queue_metrics_come_from_the_database(app: App, tmp_path: Path) -> None:
    """`skipjack metrics --port` serves the depth per queue and state, the dead letter,
    paused queues and limits, read from the database."""
    t = app.task(name="ok")(lambda **kw: None)
    app.enqueue_many([t.configure(queue="a").job() for _ in range(3)])
    app.enqueue(t.configure(queue="a", delay=3600).job())
    [dead] = app.enqueue_many([t.configure(queue="b").job()])
    app.discard([dead])
    app.pause_queue("a")
    app.set_queue_limits("b", concurrency=4, rate=10, period=60.0)
    port = free_port()
    cmd = [sys.executable, "-m", "skipjack", "--dsn", app.dsn, "--schema", app.schema,
           "metrics", "--port", str(port), "--host", "127.0.0.1", "--cache", "0s"]
    proc = subprocess.Popen(cmd, cwd=TESTS, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}/metrics"

        def answered() -> bool:
            if proc.poll() is not None:
                pytest.fail(proc.stderr.read().decode() if proc.stderr else "exited")
            try:
                return http_get(url)[0] == 200
            except OSError:
                return False

        wait_until(answered, timeout=60, what="the metrics command")
        samples = scrape(url)
        assert value(samples, "skipjack_up") == 1
        depth = "skipjack_queue_jobs"
        assert value(samples, depth, queue="a", state="available") == 3
        assert value(samples, depth, queue="a", state="scheduled") == 1
        assert value(samples, depth, queue="b", state="discarded") == 1
        assert value(samples, depth, queue="b", state="available") == 0
        assert value(samples, "skipjack_queue_paused", queue="a") == 1
        assert value(samples, "skipjack_queue_concurrency_limit", queue="b") == 4
        assert value(samples, "skipjack_queue_rate_limit", queue="b") == 10
        assert value(samples, "skipjack_queue_rate_period_seconds", queue="b") == 60
        assert value(samples, "skipjack_queue_oldest_runnable_seconds", queue="a") >= 0
        assert value(samples, "skipjack_workers") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_an_enqueue_and_its_run_are_one_trace_across_processes(app: App,
                                                               tmp_path: Path) -> None:
    """The enqueue span (this process, the SDK's in-memory exporter) and the run span (a
    worker process) share a trace: the run is the enqueue's child and links to it; a
    failure is recorded on its run span."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app.add_hook(TracingHook(provider))
    ok = app.task(name="ok")(lambda **kw: None)
    doomed = app.task(name="doomed", max_attempts=1)(lambda **kw: None)
    ok_id = app.enqueue(ok.job(n=1))
    doomed_id = app.enqueue(doomed.job())
    sent = {span.attributes["messaging.message.id"]: span for span in exporter.get_finished_spans()}
    assert set(sent) == {str(ok_id), str(doomed_id)}
    assert all(span.name == "send default" and span.kind.name == "PRODUCER"
               for span in sent.values())
    spans_file = tmp_path / "spans.jsonl"
    with observed_worker(app, tmp_path, env={"OBSERVED_SPANS": str(spans_file)}):
        def runs() -> dict[str, dict[str, Any]] | None:
            if not spans_file.exists():
                return None
            found = [json.loads(line) for line in spans_file.read_text().splitlines()]
            by_id = {s["attributes"]["messaging.message.id"]: s for s in found
                     if s["kind"] == "CONSUMER"}
            return by_id if len(by_id) == 2 else None

        run = wait_until(runs, timeout=60, what="two run spans")
        # a run span ends with its handler, just before the outcome is written
        wait_until(lambda: (app.get_job(ok_id) or {})["state"] == "succeeded", timeout=30,
                   what="the job recorded")
    for job_id, span in sent.items():
        ctx = span.get_span_context()
        assert run[job_id]["trace_id"] == f"{ctx.trace_id:032x}"
        assert run[job_id]["parent_id"] == f"{ctx.span_id:016x}"
        assert run[job_id]["links"] == [f"{ctx.span_id:016x}"]
        assert run[job_id]["name"] == "process default"
        assert run[job_id]["attributes"]["messaging.destination.name"] == "default"
        assert run[job_id]["attributes"]["messaging.operation.type"] == "process"
    assert run[str(ok_id)]["status"] == "UNSET" and run[str(ok_id)]["events"] == []
    assert run[str(doomed_id)]["status"] == "ERROR"
    assert run[str(doomed_id)]["events"] == ["exception"]


class Raising(Hook):
    """Raises in every method, and from the context managers it returns."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.calls = 0

    def _fail(self) -> Any:
        self.calls += 1
        if self.where == "call":
            raise RuntimeError("the hook fails")
        return _RaisingContext(self.where)

    def enqueue(self, call: EnqueueCall) -> Any:
        return self._fail()

    def run(self, job: Job) -> Any:
        return self._fail()

    def ended(self, attempt: Attempt) -> None:
        self.calls += 1
        raise RuntimeError("the hook fails")


class _RaisingContext:
    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self) -> None:
        if self.where == "enter":
            raise RuntimeError("the hook fails on enter")

    def __exit__(self, *exc: object) -> bool:
        if self.where == "exit":
            raise RuntimeError("the hook fails on exit")
        return True  # would swallow the handler's exception: ignored


@pytest.mark.parametrize("where", ["call", "enter", "exit"])
def test_a_hook_that_raises_everywhere_loses_no_job_or_outcome(
        app: App, where: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every method of a hook raises (or the context it returns does, on enter or exit, or
    it tries to swallow the handler's exception): every job still runs, its outcome is
    recorded as without the hook, in every transaction mode, sync and async."""
    hook = Raising(where)
    app.add_hook(hook)

    async def async_ok() -> None:
        return None

    def fails() -> None:
        raise ValueError("the handler fails")

    tasks = [app.task(name="sync_ok")(lambda: None), app.task(name="async_ok")(async_ok),
             app.task(name="complete_ok", transaction="complete")(lambda: None),
             app.task(name="claim_ok", transaction="claim")(lambda: None),
             app.task(name="fails", max_attempts=2, backoff=Backoff(base=0.01, cap=0.02))(fails)]
    ids = {t.name: app.enqueue_many([t.job() for _ in range(5)]) for t in tasks}
    worker = Worker(app, ["default"], concurrency=4, poll_interval=0.2, stage_interval=0.05)
    thread = threading.Thread(target=lambda: asyncio.run(worker.run_async()))
    with caplog.at_level(logging.ERROR, logger="skipjack.hooks"):
        thread.start()
        try:
            wait_until(lambda: states(app.dsn, app.schema) == {"succeeded": 20,
                                                               "discarded": 5},
                       timeout=120, what="every job finished")
        finally:
            worker.stop()
            thread.join(30)
    assert not thread.is_alive()
    for job_id in ids["fails"]:
        job = app.get_job(job_id) or {}
        assert job["attempt"] == 2 and len(job["errors"]) == 2
        assert job["errors"][-1]["error"] == "ValueError: the handler fails"
    assert worker.stats.succeeded == 20 and worker.stats.discarded == 5
    assert worker.stats.retried == 5
    assert hook.calls >= 5 + 30 + 30  # enqueues, runs, ends
    assert "hook Raising." in caplog.text and "going on without it" in caplog.text


def test_json_logs_parse_and_name_the_failing_task(app: App, tmp_path: Path) -> None:
    """--log-format json: every line parses as JSON; a failed job's line names its task,
    queue, attempt and exception; a success line carries its duration. With
    skipjack.jobs=WARNING ($SKIPJACK_LOG_LEVEL, or the worker's own --log-level) the success
    lines go, the failures stay."""
    ok = app.task(name="ok")(lambda **kw: None)
    doomed = app.task(name="doomed", max_attempts=1)(lambda **kw: None)
    for env, options, args in (
            ({}, ("--log-format", "json"), ()),
            ({"SKIPJACK_LOG_LEVEL": "INFO,skipjack.jobs=WARNING"}, ("--log-format", "json"), ()),
            ({"quiet": "1"}, (), ("--log-format", "json", "--log-level", "skipjack.jobs=WARNING"))):
        [ok_id, doomed_id] = app.enqueue_many([ok.job(n=1), doomed.job()])
        with observed_worker(app, tmp_path, *args, options=options, env=env) as worker:
            wait_until(lambda: states(app.dsn, app.schema).get("running", 0) == 0
                       and (app.get_job(doomed_id) or {}).get("state") == "discarded"  # noqa: B023
                       and (app.get_job(ok_id) or {}).get("state") == "succeeded",  # noqa: B023
                       timeout=60, what="both jobs done")
            marker = f'"job_id": {doomed_id}'
            wait_until(lambda: marker in worker.log(), timeout=30,  # noqa: B023
                       what="the failure logged")
            worker.signal(signal.SIGTERM)
            assert worker.wait(60) == 0
        lines = [json.loads(line) for line in worker.log().splitlines() if line.strip()]
        assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
        failed = [line for line in lines if line.get("job_id") == doomed_id]
        assert len(failed) == 1
        assert failed[0]["task"] == "doomed" and failed[0]["queue"] == "default"
        assert failed[0]["outcome"] == "discarded" and failed[0]["level"] == "ERROR"
        assert failed[0]["error_type"] == "RuntimeError"
        assert failed[0]["error"] == "always fails"
        assert (failed[0]["attempt"], failed[0]["max_attempts"]) == (1, 1)
        assert "doomed" in failed[0]["message"] and "RuntimeError" in failed[0]["message"]
        succeeded = [line for line in lines if line.get("job_id") == ok_id]
        if env:
            assert succeeded == []
        else:
            assert len(succeeded) == 1 and succeeded[0]["outcome"] == "succeeded"
            assert succeeded[0]["duration"] >= 0 and succeeded[0]["level"] == "INFO"
        assert any(line["logger"] == "skipjack.worker" and "stopped" in line["message"]
                   for line in lines)


def test_json_formatter_and_level_parsing() -> None:
    record = logging.LogRecord("skipjack.jobs", logging.WARNING, "", 0, "job %s: %s", (7, "x"),
                               None)
    record.task = "t"
    record.when = object()  # not JSON: written as its str
    out = json.loads(JsonFormatter().format(record))
    assert out["message"] == "job 7: x" and out["task"] == "t" and out["level"] == "WARNING"
    assert isinstance(out["when"], str)
    assert parse_levels(["debug", "skipjack.jobs=warning,skipjack.worker=ERROR"]) == (
        logging.DEBUG, {"skipjack.jobs": logging.WARNING, "skipjack.worker": logging.ERROR})
    with pytest.raises(ValueError, match="'LOUD' is not a level"):
        parse_levels(["skipjack.jobs=LOUD"])


def test_a_line_another_console_handler_writes_is_not_written_twice(tmp_path: Path) -> None:
    # as under manage.py skipjack worker with DEBUG = True: Django's console handler on the
    # django logger, and the command's handler on the root; a file handler still gets both
    script = tmp_path / "twice.py"
    script.write_text(
        "import logging, sys\n"
        "from skipjack.logs import configure\n"
        "configure(stream=sys.stdout)\n"
        "logging.getLogger('django').addHandler(logging.StreamHandler(sys.stderr))\n"
        "quiet = logging.StreamHandler(sys.stderr)\n"
        "quiet.setLevel(logging.ERROR)\n"
        "logging.getLogger('chatty').addHandler(quiet)\n"
        f"logging.getLogger('filed').addHandler(logging.FileHandler({str(tmp_path / 'f.log')!r}))\n"
        "logging.getLogger('django.tasks').warning('django line')\n"
        "logging.getLogger('chatty.sub').warning('below the console handler level')\n"
        "logging.getLogger('filed').warning('filed line')\n"
        "logging.getLogger('skipjack.worker').warning('own line')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stderr.splitlines() == ["django line"]
    assert [line.split(" ", 3)[-1] for line in out.stdout.splitlines()] == [
        "chatty.sub: below the console handler level", "filed: filed line",
        "skipjack.worker: own line"]
    assert (tmp_path / "f.log").read_text() == "filed line\n"


def _workers_if(app: App, n: int) -> list[dict[str, Any]] | None:
    rows = _workers(app)
    return rows if len(rows) == n else None


def _workers(app: App) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "skipjack", "--dsn", app.dsn, "--schema",
                          app.schema, "workers", "--json"], capture_output=True, text=True,
                         timeout=60, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_workers_lists_live_workers_and_a_killed_one_ages_out(app: App,
                                                              tmp_path: Path) -> None:
    """`skipjack workers` shows two live worker processes; after one is SIGKILLed (it
    cannot say goodbye) its row expires and the other worker removes it; a worker that
    stops cleanly removes its own row."""
    with observed_worker(app, tmp_path, "--lease", "1", "-q", "default", "-q", "other",
                         "--name", "first") as first, \
            observed_worker(app, tmp_path, "--lease", "1", "--name", "second") as second:
        rows = wait_until(lambda: _workers_if(app, 2), timeout=60, what="two live workers")
        by_name = {r["name"]: r for r in rows}
        assert by_name["first"]["pid"] == first.pid and by_name["second"]["pid"] == second.pid
        assert by_name["first"]["queues"] == ["default", "other"]
        assert by_name["first"]["concurrency"] == 10 and by_name["first"]["version"]
        first.kill()
        wait_until(lambda: [r["name"] for r in _workers(app)] == ["second"], timeout=60,
                   what="the killed worker aged out")
        wait_until(lambda: support.query(app.dsn, "SELECT name FROM {schema}.workers",
                                 schema=app.schema) == [("second",)], timeout=60,
                   what="its row removed")
        second.signal(signal.SIGTERM)
        assert second.wait(60) == 0
    assert _workers(app) == []


def test_health_checks_answer_for_probes(app: App, tmp_path: Path) -> None:
    """/readyz: 200 once the worker serves with its database and schema; /livez: 200 while
    the event loop answers, 503 while a handler blocks it."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with observed_worker(app, tmp_path, "--health-port", str(port),
                         "--health-host", "127.0.0.1") as worker:
        def ready() -> dict[str, Any] | None:
            if worker.proc.poll() is not None:
                pytest.fail(worker.log())
            try:
                status, body = http_get(base + "/readyz")
            except OSError:
                return None
            return json.loads(body) if status == 200 else None

        body = wait_until(ready, timeout=60, what="ready")
        assert body["database"] == "reachable" and body["schema"] == "current"
        assert body["serving"] is True
        assert wait_until(lambda: json.loads(http_get(base + "/readyz")[1])["listening"],
                          timeout=30, what="listening")
        status, body_text = http_get(base + "/livez")
        assert status == 200 and json.loads(body_text)["ok"] is True
        assert http_get(base + "/nope")[0] == 404
        block = app.task(name="block_loop")(lambda **kw: None)
        app.enqueue(block.job(seconds=12.0))
        def failing() -> tuple[int, str] | None:
            answer = http_get(base + "/livez", timeout=30)
            return answer if answer[0] == 503 else None

        status, body_text = wait_until(failing, timeout=60,
                                       what="livez failing while the loop is blocked")
        assert "no answer" in json.loads(body_text)["loop"]
        wait_until(lambda: http_get(base + "/livez", timeout=30)[0] == 200, timeout=60,
                   what="livez again once the loop is free")


def test_two_workers_given_one_name_are_told_and_keep_a_row(app: App, tmp_path: Path) -> None:
    """Two live workers with the same --name: they say so, and when one stops cleanly the
    other's row stays (or comes back at its next refresh)."""
    with observed_worker(app, tmp_path, "--lease", "1", "--name", "twin") as a, \
            observed_worker(app, tmp_path, "--lease", "1", "--name", "twin") as b:
        wait_until(lambda: "has this worker's name 'twin'" in a.log() + b.log(), timeout=60,
                   what="the warning")
        a.signal(signal.SIGTERM)
        assert a.wait(60) == 0
        wait_until(lambda: [r["pid"] for r in _workers(app)] == [b.pid], timeout=60,
                   what="the other worker's row")


def test_a_port_in_use_is_a_clear_error(app: App, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for option in ("--metrics-port", "--health-port"):
            host = option.replace("port", "host")
            with observed_worker(app, tmp_path, option, str(port), host, "127.0.0.1") as worker:
                assert worker.wait(60) == 2  # a settings error, as the CLI's others
            assert f"error: cannot listen on 127.0.0.1:{port}" in worker.log()
            assert "Traceback" not in worker.log()


def test_workers_shows_names_as_text(app: App) -> None:
    """A worker's name, host or queue with rich markup in it is shown as it is."""
    support.query(app.dsn, "INSERT INTO {schema}.workers (name, host, pid, version, queues, "
                  "concurrency, expires_at) VALUES ('evil[/]', '[bold]h', 1, 'v', "
                  "ARRAY['q[/b]'], 1, now() + interval '1 hour')", schema=app.schema)
    out = subprocess.run([sys.executable, "-m", "skipjack", "--dsn", app.dsn, "--schema",
                          app.schema, "workers"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "evil[/]" in out.stdout and "[bold]h" in out.stdout and "q[/b]" in out.stdout


def test_a_run_span_is_made_whatever_the_stored_metadata(app: App) -> None:
    """Metadata that is no trace context (an array, a number, a non-text value) gives a run
    span of its own trace; the job runs as ever."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    t = app.task(name="ok")(lambda **kw: None)
    ids = app.enqueue_many([t.job() for _ in range(4)])
    for job_id, value in zip(ids, ['[1, 2]', '42', '{"traceparent": 5}', '{"traceparent": "x"}'],
                             strict=True):
        support.query(app.dsn, "UPDATE {schema}.jobs SET metadata = %s::jsonb WHERE id = %s",
                      [value, job_id], schema=app.schema)
    app.add_hook(TracingHook(provider))
    worker = Worker(app, ["default"], concurrency=2, poll_interval=0.2)
    thread = threading.Thread(target=lambda: asyncio.run(worker.run_async()))
    thread.start()
    try:
        wait_until(lambda: states(app.dsn, app.schema) == {"succeeded": 4}, timeout=60,
                   what="the jobs done")
    finally:
        worker.stop()
        thread.join(30)
    spans = [s for s in exporter.get_finished_spans() if s.kind.name == "CONSUMER"]
    assert sorted(s.attributes["messaging.message.id"] for s in spans) == sorted(map(str, ids))
    assert all(s.parent is None for s in spans)
