"""skipjack worker --processes N with real processes: N workers run the jobs, one that is
SIGKILLed is started again, one metrics endpoint serves all of them (scraped over HTTP), and
SIGTERM stops them all gracefully."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from skipjack import App
from skipjack.supervisor import child_argv

from support import (
    TESTS,
    WorkerProcess,
    create_log_tables,
    free_port,
    http_get,
    query,
    states,
    wait_until,
)

pytest.importorskip("prometheus_client")


def worker_command(app: App, *args: str) -> list[str]:
    """``skipjack worker`` on ``app``'s database and schema, with ``args`` after it."""
    return [sys.executable, "-m", "skipjack", "--dsn", app.dsn, "--schema", app.schema,
            "worker", *args]


def live_children(supervisor: WorkerProcess) -> list[psutil.Process]:
    """The supervisor's worker processes that are running (not zombies)."""
    return [c for c in psutil.Process(supervisor.pid).children()
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_child_argv_drops_the_supervisor_s_options() -> None:
    assert child_argv(["worker", "a:b", "--processes", "4", "--metrics-port=9", "-c", "2"],
                      ["--processes", "--metrics-port"]) == ["worker", "a:b", "-c", "2"]


def test_processes_run_restart_share_one_metrics_endpoint_and_stop(app: App,
                                                                    tmp_path: Path) -> None:
    create_log_tables(app.dsn, app.schema)
    app.task(name="sleep")(lambda **kw: None)
    port, health = free_port(), free_port()
    with WorkerProcess(
            app.dsn, app.schema, None, "--processes", "2",
            "--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--health-port",
            str(health), "--health-host", "127.0.0.1", "--lease", "2s", "--heartbeat", "300ms",
            "--poll-interval", "500ms", log=tmp_path / "supervisor.log") as supervisor:
        wait_until(lambda: len(live_children(supervisor)) == 2 and len(app.workers()) == 2,
                   timeout=60, what="two worker processes registered")
        # one health endpoint for both: ready once each process is
        def ready() -> dict[str, Any]:
            status, body = http_get(f"http://127.0.0.1:{health}/readyz")
            return json.loads(body) if status == 200 else {}

        answer = wait_until(ready, timeout=60, what="both processes ready on one endpoint")
        assert answer["ok"] and set(answer["processes"]) == {"0", "1"}
        assert all(p["status"] == 200 for p in answer["processes"].values())
        assert http_get(f"http://127.0.0.1:{health}/livez")[0] == 200
        ids = app.enqueue_many([app.tasks["sleep"].job(seconds=0.01) for _ in range(40)])
        wait_until(lambda: states(app.dsn, app.schema) == {"succeeded": len(ids)}, timeout=60)

        def scraped() -> str:
            status, body = http_get(f"http://127.0.0.1:{port}/metrics")
            return body if status == 200 else ""

        wait_until(lambda: 'process="0"' in scraped() and 'process="1"' in scraped(),
                   timeout=60, what="both processes' metrics on one endpoint")
        body = scraped()
        assert "skipjack_jobs_started_total" in body and body.count("# TYPE skipjack_jobs_") \
            == len({line.split()[2] for line in body.splitlines()
                    if line.startswith("# TYPE skipjack_jobs_")})  # one family per name

        victim = live_children(supervisor)[0]
        victim.kill()
        wait_until(lambda: len(pids := {c.pid for c in live_children(supervisor)}) == 2
                   and victim.pid not in pids, timeout=60, what="the dead one restarted")
        more = app.enqueue_many([app.tasks["sleep"].job() for _ in range(10)])
        wait_until(lambda: states(app.dsn, app.schema).get("succeeded") == len(ids) + len(more),
                   timeout=60)

        pids = [c.pid for c in live_children(supervisor)]
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(60) == 0
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status()
                       != psutil.STATUS_ZOMBIE for p in pids)
        # the log names the endpoints asked for, not the processes' own
        text = (tmp_path / "supervisor.log").read_text()
        assert f"metrics of every worker process at http://127.0.0.1:{port}/metrics" in text
        assert f"at http://127.0.0.1:{health}/livez and /readyz" in text
        assert "metrics at http" not in text, text
        assert "stopped: claimed" in text


def test_a_worker_that_cannot_start_stops_the_supervisor(app: App) -> None:
    done = subprocess.run(  # a lease too short for the heartbeat
        worker_command(app, "jobs_app:app", "--processes", "2", "--lease", "1s"), cwd=TESTS,
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "failed to start (status 2)" in done.stderr


def test_a_failed_restart_is_retried_and_no_worker_outlives_its_supervisor(
        app: App, tmp_path: Path) -> None:
    marker = tmp_path / "fail-imports"
    env = {**os.environ, "SKIPJACK_SCHEMA": app.schema, "SKIPJACK_DATABASE_URL": app.dsn,
           "FLAKY_APP_MARKER": str(marker)}
    args = ["--processes", "2", "--name", "box",
            "--health-port", str(health := free_port()), "--health-host", "127.0.0.1"]
    # a first start that fails stops the supervisor with the worker's status, as one
    # `skipjack worker` would exit
    marker.touch()
    done = subprocess.run(worker_command(app, "flaky_app:app", *args), cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr  # the module raised as it was imported
    assert "failed to start (status 2)" in done.stderr
    marker.unlink()

    with WorkerProcess(app.dsn, app.schema, None, *args, app="flaky_app:app",
                       log=tmp_path / "supervisor.log", env=env) as supervisor:
        def names() -> set[str]:
            return {w["name"] for w in app.workers()}

        wait_until(lambda: names() == {"box-0", "box-1"}, timeout=60,
                   what="two workers, each with its own name")
        # a later start that fails (here: the import; as well a database that cannot be
        # reached) is retried, and the other process serves on
        marker.touch()
        victim, other = live_children(supervisor)
        victim.kill()
        wait_until(lambda: "ended with status 2; starting it again" in
                   (tmp_path / "supervisor.log").read_text(), timeout=60,
                   what="the restart failed and is retried")
        assert supervisor.proc.poll() is None and other.is_running()
        # while the supervisor starts it again, the process counts as live, not ready
        status, body = http_get(f"http://127.0.0.1:{health}/livez")
        assert status == 200, body
        assert http_get(f"http://127.0.0.1:{health}/readyz")[0] == 503
        marker.unlink()
        wait_until(lambda: len(pids := {c.pid for c in live_children(supervisor)}) == 2
                   and pids <= {w["pid"] for w in app.workers()}, timeout=90,
                   what="the process started again once it can import, and serving")
        assert http_get(f"http://127.0.0.1:{health}/readyz")[0] == 200

        # the supervisor killed outright: its workers notice and stop, gracefully
        pids = [c.pid for c in live_children(supervisor)]
        supervisor.kill()
        wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                   != psutil.STATUS_ZOMBIE for p in pids),
                   timeout=60, what="no worker outlives its supervisor")
        text = (tmp_path / "supervisor.log").read_text()
        assert text.count("the supervisor has ended: stopping") == 2, text
        assert text.count("stopped: claimed") == 2, text
        assert app.workers() == []  # each removed its registry row as it stopped


def test_running_jobs_finish_when_the_supervisor_dies_while_its_workers_drain(
        app: App, tmp_path: Path) -> None:
    create_log_tables(app.dsn, app.schema)
    app.task(name="sleep")(lambda **kw: None)
    log_path = tmp_path / "supervisor.log"
    with WorkerProcess(app.dsn, app.schema, None, "--processes", "2", "--concurrency", "2",
                       "--grace", "60s", "--heartbeat", "300ms", log=log_path) as supervisor:
        wait_until(lambda: len(app.workers()) == 2, timeout=60, what="two workers")
        ids = app.enqueue_many([app.tasks["sleep"].job(seconds=3) for _ in range(4)])
        # started, not only claimed: a claimed job not yet started is released by a stop
        wait_until(lambda: query(app.dsn, "SELECT count(*) FROM {schema}.exec_log WHERE "
                                 "event = 'start'", schema=app.schema) == [(4,)], timeout=60,
                   what="four jobs started")
        pids = [c.pid for c in live_children(supervisor)]
        supervisor.signal(signal.SIGTERM)
        wait_until(lambda: log_path.read_text().count("SIGTERM: stopping") == 2, timeout=60,
                   what="both workers stopping")
        # then the supervisor is killed (a process manager's stop timeout): the workers go
        # on draining, and do not take its end for a second signal
        supervisor.kill()
        wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                   != psutil.STATUS_ZOMBIE for p in pids),
                   timeout=90, what="the workers stopped")
        assert states(app.dsn, app.schema) == {"succeeded": len(ids)}
        text = log_path.read_text()
        assert "exiting now" not in text, text
        assert text.count("the supervisor has ended: stopping") == 2, text


def test_a_stop_while_processes_start_reaches_every_one(app: App, tmp_path: Path) -> None:
    log_path = tmp_path / "supervisor.log"
    with WorkerProcess(app.dsn, app.schema, None, "--processes", "6", "--heartbeat", "300ms",
                       log=log_path) as supervisor:
        wait_until(lambda: "worker process 0 started" in log_path.read_text(), timeout=60,
                   what="the first process started")
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(90) == 0, log_path.read_text()
        text = log_path.read_text()
        assert "did not stop in time" not in text, text
        assert app.workers() == []


def test_more_processes_than_the_open_file_limit_allows_are_refused(app: App) -> None:
    import resource

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    done = subprocess.run(
        worker_command(app, "jobs_app:app", "--processes", "100"),
        cwd=TESTS, capture_output=True, text=True, timeout=120, preexec_fn=low_limit)
    assert done.returncode == 2
    assert "--processes: 100 processes need about 164 open files" in done.stderr
    assert "ulimit -Hn" in done.stderr and "started" not in done.stderr


def test_a_name_too_long_with_the_process_number_is_refused(app: App) -> None:
    done = subprocess.run(
        worker_command(app, "jobs_app:app", "--processes", "12", "--name", "w" * 253),
        cwd=TESTS, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--name" in done.stderr and "256 bytes with the process number appended" \
        in done.stderr and "at most 255" in done.stderr
