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

from support import TESTS, create_log_tables, free_port, http_get, states, wait_until

pytest.importorskip("prometheus_client")


def test_child_argv_drops_the_supervisor_s_options() -> None:
    assert child_argv(["worker", "a:b", "--processes", "4", "--metrics-port=9", "-c", "2"],
                      ["--processes", "--metrics-port"]) == ["worker", "a:b", "-c", "2"]


def test_processes_run_restart_share_one_metrics_endpoint_and_stop(app: App,
                                                                    tmp_path: Path) -> None:
    create_log_tables(app.dsn, app.schema)
    app.task(name="sleep")(lambda **kw: None)
    port, health = free_port(), free_port()
    log = open(tmp_path / "supervisor.log", "wb")
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "skipjack", "--dsn", app.dsn, "--schema", app.schema, "worker",
         "jobs_app:app", "--processes", "2", "--metrics-port", str(port), "--metrics-host",
         "127.0.0.1", "--health-port", str(health), "--health-host", "127.0.0.1",
         "--lease", "2s", "--heartbeat", "300ms", "--poll-interval", "500ms"],
        cwd=TESTS, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "SKIPJACK_SCHEMA": app.schema,
             "SKIPJACK_DATABASE_URL": app.dsn})
    try:
        def children() -> list[psutil.Process]:
            return [c for c in psutil.Process(supervisor.pid).children()
                    if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

        wait_until(lambda: len(children()) == 2 and len(app.workers()) == 2, timeout=60,
                   what="two worker processes registered")
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

        victim = children()[0]
        victim.kill()
        wait_until(lambda: len(children()) == 2 and victim.pid not in
                   {c.pid for c in children()}, timeout=60, what="the dead one restarted")
        more = app.enqueue_many([app.tasks["sleep"].job() for _ in range(10)])
        wait_until(lambda: states(app.dsn, app.schema).get("succeeded") == len(ids) + len(more),
                   timeout=60)

        pids = [c.pid for c in children()]
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(60) == 0
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status()
                       != psutil.STATUS_ZOMBIE for p in pids)
        # the log names the endpoints asked for, not the processes' own
        text = (tmp_path / "supervisor.log").read_text()
        assert f"metrics of every worker process at http://127.0.0.1:{port}/metrics" in text
        assert f"at http://127.0.0.1:{health}/livez and /readyz" in text
        assert "metrics at http" not in text, text
        assert "stopped: claimed" in text
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait(30)
        log.close()


def test_a_worker_that_cannot_start_stops_the_supervisor(app: App) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "skipjack", "--dsn", app.dsn, "--schema", app.schema, "worker",
         "jobs_app:app", "--processes", "2", "--lease", "1s"],  # too short for the heartbeat
        cwd=TESTS, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "refused to start" in done.stderr
