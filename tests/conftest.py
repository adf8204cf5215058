"""Fixtures: every test runs against real PostgreSQL servers, each in a fresh schema.

Servers: the embedded PostgreSQL 18 always, and the server at $SKIPJACK_TEST_LOCAL_DSN
(default postgresql://postgres@127.0.0.1:5432/postgres) when it answers, so two major versions
are tested. Set SKIPJACK_TEST_SERVERS=embedded (or =local) to run against one only.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from skipjack import App

from support import Server

LOCAL_DSN = os.environ.get("SKIPJACK_TEST_LOCAL_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
WANTED = os.environ.get("SKIPJACK_TEST_SERVERS", "embedded,local").split(",")


def _local_available() -> bool:
    try:
        psycopg.connect(LOCAL_DSN, connect_timeout=3).close()
        return True
    except psycopg.Error:
        return False


# A test's server, as its id names it: "test_x[embedded]", "test_y[local-rescued]".
SERVER_IN_ID = re.compile(r"[\[-](embedded|local)[\]-]")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``-n 2``, as scripts/test.sh runs), give each server one process.

    Tests of a server restart it, change its settings or fill its notification queue, so two
    tests of one server never run at once; the two servers' tests run side by side, and the
    tests of neither go wherever a process is free.
    """
    from xdist.scheduler import LoadScopeScheduling

    class OneProcessPerServer(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            found = SERVER_IN_ID.search(nodeid)
            return found.group(1) if found else nodeid

    return OneProcessPerServer(config, log)


# The most of each log file a failed test's report shows (its last lines).
LOG_TAIL = 200


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report ends with the logs in its ``tmp_path`` (the ``*.log`` files its
    worker processes wrote), so that a failure seen only in CI can still be read."""
    report: pytest.TestReport = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and isinstance(tmp, Path) and tmp.is_dir():
        for path in sorted(tmp.rglob("*.log")):
            lines = path.read_text(errors="replace").splitlines()
            report.sections.append((f"{path.relative_to(tmp)} (last {LOG_TAIL} lines)",
                                    "\n".join(lines[-LOG_TAIL:])))
    return report


def pytest_report_header(config: pytest.Config) -> str:
    local = "available" if _local_available() else "NOT reachable (skipped)"
    return f"skipjack servers: {WANTED}; local {LOCAL_DSN}: {local}"


@pytest.fixture(scope="session", params=["embedded", "local"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Server:
    kind = request.param
    if kind not in WANTED:
        pytest.skip(f"{kind} server not selected by SKIPJACK_TEST_SERVERS")
    if kind == "local":
        if not _local_available():
            pytest.skip(f"no PostgreSQL at {LOCAL_DSN}")
        return Server("local", LOCAL_DSN)
    os.environ.setdefault("SKIPJACK_EMBEDDED_DIR",
                          str(Path.home() / ".cache" / "skipjack-tests" / "postgres18"))
    from skipjack import embedded

    return Server("embedded", embedded.dsn())


@pytest.fixture
def schema(server: Server) -> Iterator[str]:
    name = "t_" + secrets.token_hex(6)
    yield name
    with server.connect() as conn:
        conn.execute(psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
            psycopg.sql.Identifier(name)))


@pytest.fixture
def app(server: Server, schema: str) -> Iterator[App]:
    app = App(server.dsn, schema=schema)
    app.migrate()
    yield app
    app.close()
