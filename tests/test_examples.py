"""The FastAPI and Flask examples (examples/) against a real server: an order and its job
in one transaction, run by the worker of FastAPI's lifespan or by a worker process. The
guides show these examples whole, and what they print; the SQLAlchemy guide's files are run
as a reader would copy them, from an empty directory."""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest
from psycopg.conninfo import conninfo_to_dict

from skipjack import App

from support import (
    TESTS,
    Server,
    WorkerProcess,
    free_port,
    fresh_database,
    http_get,
    query,
    wait_until,
)

EXAMPLES = TESTS.parent / "examples"
GUIDES = TESTS.parent / "docs" / "guides"


@pytest.fixture
def database(server: Server) -> Iterator[str]:
    with fresh_database(server) as dsn:
        yield dsn


def post(url: str) -> str:
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30) as r:
        body: str = r.read().decode()
        return body


def python_blocks(guide: str) -> list[str]:
    """The text of each ```python block of a guide."""
    return re.findall(r"^```python\n(.*?)^```", (GUIDES / guide).read_text(), re.M | re.S)


def shown_outputs(guide: str) -> dict[str, str]:
    """What a guide shows its curl commands printing, by request: ``{"POST /orders?item=book":
    '{"order":1,"job":1}', "GET /jobs/1": ...}``."""
    shown: dict[str, str] = {}
    for m in re.finditer(r"^curl (-X POST )?'?localhost:\d+(\S+?)'?\s+# (.+)$",
                         (GUIDES / guide).read_text(), re.M):
        request = ("POST " if m[1] else "GET ") + m[2]
        assert shown.setdefault(request, m[3].strip()) == m[3].strip(), request
    return shown


def as_url(conninfo: str) -> str:
    """The ``postgresql://`` URL of a connection string, the form the guides' code expects."""
    params = {k: str(v) for k, v in conninfo_to_dict(conninfo).items()}
    netloc = quote(params.pop("user", ""), safe="")
    if "password" in params:
        netloc += ":" + quote(params.pop("password"), safe="")
    netloc += "@" if netloc else ""
    if not params.get("host", "/").startswith("/"):  # a host name; a socket directory stays
        netloc += params.pop("host") + (":" + params.pop("port") if "port" in params else "")
    dbname = quote(params.pop("dbname", ""), safe="")
    return f"postgresql://{netloc}/{dbname}" + (f"?{urlencode(params)}" if params else "")


def test_the_guides_show_the_examples_whole() -> None:
    for guide, example in [("fastapi.md", "fastapi_app.py"), ("flask.md", "flask_app.py")]:
        assert (EXAMPLES / example).read_text() in python_blocks(guide), (
            f"docs/guides/{guide} no longer shows examples/{example} as it is")


def test_the_sqlalchemy_guide_works_verbatim_from_an_empty_project(database: str,
                                                                  tmp_path: Path) -> None:
    url = as_url(database)
    env = {**os.environ, "SKIPJACK_DATABASE_URL": url, "PYTHONUNBUFFERED": "1"}
    env.pop("SKIPJACK_SCHEMA", None)  # the guide's: the default schema

    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    run("skipjack", "migrate")
    (tmp_path / "shop").mkdir()
    files = []
    for block in python_blocks("sqlalchemy.md"):
        name = block.splitlines()[0].removeprefix("# ")
        if name.startswith("shop/"):
            (tmp_path / name).write_text(block)
            files.append(name)
    assert files == ["shop/jobs.py", "shop/checkout.py"]
    shown = re.search(r"^python -m shop.checkout\s+# (.+)$",
                      (GUIDES / "sqlalchemy.md").read_text(), re.M)
    assert shown is not None
    assert run("shop.checkout").strip() == shown[1]  # order 1: job 1 enqueued
    app = App(url)
    try:
        with WorkerProcess(url, "skipjack", ["default"], app="shop.jobs:app",
                           log=tmp_path / "worker.log", cwd=tmp_path) as worker:
            assert app.job_handle(1).result(timeout=60) is None
            # the line is written just after the outcome the result was read from
            wait_until(lambda: "job 1 succeeded: shop.jobs.record_payment" in worker.log(),
                       what="the worker's line for the job")
    finally:
        app.close()
    assert query(url, "SELECT o.id, o.paid, p.order_id FROM orders o "
                      "JOIN payments p ON p.order_id = o.id") == [(1, True, 1)]


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
        shown = shown_outputs("fastapi.md")  # a fresh database: order 1, job 1
        created = post(f"{base}/orders?item=book")
        assert created == shown["POST /orders?item=book"] == '{"order":1,"job":1}'
        status, body = http_get(f"{base}/jobs/1", timeout=30)
        assert status == 200, body
        assert body == shown["GET /jobs/1"]
        assert json.loads(body) == {"job": 1, "result": "order 1 shipped"}
        assert http_get(f"{base}/jobs/999999")[0] == 404
        status, body = http_get(f"{base}/orders/1")
        assert body == shown["GET /orders/1"]
        assert json.loads(body) == {"order": 1, "item": "book", "shipped": True}
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
        shown = shown_outputs("flask.md")  # a fresh database: order 1, job 1
        posted = client.post("/orders?item=lamp")
        assert posted.get_data(as_text=True).strip() == shown["POST /orders?item=lamp"]
        created = posted.get_json()
        assert created == {"order": 1, "job": 1}
        assert client.get("/orders/1").get_json()["shipped"] is False
        with WorkerProcess(database, "shop_jobs", ["default"], "--poll-interval", "0.5",
                           app="flask_app:jobs", log=tmp_path / "worker.log",
                           cwd=EXAMPLES):
            assert example.jobs.job_handle(1).result(timeout=60) == "order 1 shipped"
        shipped = client.get("/orders/1")
        assert shipped.get_data(as_text=True).strip() == shown["GET /orders/1"]
        assert shipped.get_json() == {"order": 1, "item": "lamp", "shipped": True}
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
