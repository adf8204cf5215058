"""The FastAPI and Flask examples (examples/) against a real server: an order and its job
in one transaction, run by the worker of FastAPI's lifespan or by a worker process."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from skipjack import App

from support import TESTS, Server, WorkerProcess, free_port, fresh_database, http_get, wait_until

EXAMPLES = TESTS.parent / "examples"


@pytest.fixture
def database(server: Server) -> Iterator[str]:
    with fresh_database(server) as dsn:
        yield dsn


def post(url: str) -> dict[str, int]:
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_fastapi_runs_its_jobs_in_its_own_process(database: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "uvicorn.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "fastapi_app:api", "--port", str(port)],
            cwd=EXAMPLES, env={**os.environ, "SKIPJACK_DATABASE_URL": database,
                               "SKIPJACK_SCHEMA": "shop_jobs", "PYTHONUNBUFFERED": "1"},
            stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_get(base + "/docs")[0] == 200, timeout=60,
                   what="uvicorn serves the app")
        created = post(f"{base}/orders?item=book")
        status, body = http_get(f"{base}/jobs/{created['job']}", timeout=30)
        assert status == 200, body
        assert json.loads(body)["result"] == f"order {created['order']} shipped"
        assert http_get(f"{base}/jobs/999999")[0] == 404
        status, body = http_get(f"{base}/orders/{created['order']}")
        assert json.loads(body) == {"order": created["order"], "item": "book", "shipped": True}
        server.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once its shutdown is done
        assert server.wait(60) in (0, -signal.SIGTERM)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
    text = log.read_text()
    assert "Application shutdown complete" in text and "Traceback" not in text, text


def test_flask_enqueues_in_the_request_transaction(database: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKIPJACK_DATABASE_URL", database)
    monkeypatch.setenv("SKIPJACK_SCHEMA", "shop_jobs")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    sys.modules.pop("flask_app", None)
    example = importlib.import_module("flask_app")
    try:
        client = example.create_app().test_client()
        created = client.post("/orders?item=lamp").get_json()
        assert client.get(f"/orders/{created['order']}").get_json()["shipped"] is False
        with WorkerProcess(database, "shop_jobs", ["default"], "--poll-interval", "0.5",
                           app="flask_app:jobs", log=tmp_path / "worker.log",
                           cwd=EXAMPLES):
            assert example.jobs.job_handle(created["job"]).result(timeout=60) == (
                f"order {created['order']} shipped")
        assert client.get(f"/orders/{created['order']}").get_json()["shipped"] is True
    finally:
        example.jobs.close()
        example.pool.close()
        sys.modules.pop("flask_app", None)


def test_the_lifespan_helper_runs_a_worker_while_the_app_runs(app: App) -> None:
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from skipjack.contrib.starlette import lifespan

    @app.task(name="greet")
    def greet(name: str) -> str:
        return f"hello {name}"

    with TestClient(Starlette(lifespan=lifespan(app, concurrency=2, poll_interval=0.1))):
        assert greet.enqueue(name="ada").result(timeout=60) == "hello ada"
    # after the lifespan ended, no worker of this process is registered any more
    assert app.workers() == []
    app.tasks["greet"].enqueue(name="bob")
    assert app.stats()["queues"]["default"] == {"available": 1}
