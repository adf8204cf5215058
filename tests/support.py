"""Test helpers: the server under test, waiting on conditions, real worker processes."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

TESTS = Path(__file__).parent
T = TypeVar("T")


@dataclass
class Server:
    """A PostgreSQL server the suite runs against."""

    kind: str  # "embedded" or "local"
    dsn: str

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, **kwargs)

    def restart(self) -> None:
        """Restart the server with a fast shutdown (every session is cut)."""
        if self.kind == "embedded":
            from skipjack import embedded

            embedded.run_pg_ctl("restart")
        else:
            version = sorted(os.listdir("/etc/postgresql"))[-1]
            subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main",
                            "restart", "-m", "fast"], check=True, capture_output=True, timeout=120)
        wait_until(self._answers, timeout=60, what="server back after restart")

    def _answers(self) -> bool:
        try:
            self.connect(connect_timeout=2).close()
            return True
        except psycopg.OperationalError:
            return False


def wait_until(condition: Callable[[], T], timeout: float = 30, interval: float = 0.05,
               what: str = "condition") -> T:
    """Poll ``condition`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def query(dsn: str, statement: str, params: Any = None, schema: str | None = None) -> list[Any]:
    """Run one statement on a fresh connection; ``{schema}`` in it is the quoted schema."""
    text: Any = sql.SQL(statement).format(schema=sql.Identifier(schema)) if schema else statement
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(text, params)
        return cur.fetchall() if cur.description else []


def undo_claim(dsn: str, schema: str, job_id: int) -> None:
    """Put a claimed job back as a server crash would leave it had the claim's commit not
    reached the disk: runnable, never attempted, token 0."""
    query(dsn, "UPDATE {schema}.jobs SET state = 'available', attempt = 0, lease_version = 0, "
               "worker = NULL, lease_expires_at = NULL, attempted_at = NULL WHERE id = %s",
          [job_id], schema=schema)


def migration_locks(dsn: str, schema: str) -> int:
    """Advisory locks held on ``schema``'s migration key (other software may hold others)."""
    from skipjack.migrate import _lock_key

    key = _lock_key(schema)
    rows = query(dsn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
                      "classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 1",
                 [(key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF])
    return int(rows[0][0])


def states(dsn: str, schema: str) -> dict[str, int]:
    rows = query(dsn, "SELECT state, count(*) FROM {schema}.jobs GROUP BY state", schema=schema)
    return dict(rows)


def create_log_tables(dsn: str, schema: str) -> None:
    """exec_log: one row per handler start and finish; effects: unique per job."""
    query(dsn, """
        CREATE TABLE {schema}.exec_log (
            job_id bigint, attempt int, lease_version bigint, worker text, pid int,
            event text, at timestamptz DEFAULT clock_timestamp());
        CREATE TABLE {schema}.effects (job_id bigint PRIMARY KEY);
        CREATE TABLE {schema}.effect_rows (job_id bigint NOT NULL, pid int NOT NULL);
    """, schema=schema)


def effect_counts(dsn: str, schema: str) -> dict[int, int]:
    """Committed effects per job (effect_rows has no unique key: duplicates would show)."""
    return dict(query(dsn, "SELECT job_id, count(*) FROM {schema}.effect_rows GROUP BY job_id",
                      schema=schema))


def exec_counts(dsn: str, schema: str, event: str = "start") -> dict[int, int]:
    rows = query(dsn, "SELECT job_id, count(*) FROM {schema}.exec_log WHERE event = %s "
                      "GROUP BY job_id", [event], schema=schema)
    return dict(rows)


class WorkerProcess:
    """``python -m skipjack worker jobs_app:app`` in a real child process."""

    def __init__(self, dsn: str, schema: str, queues: list[str] | None = None,
                 *args: str, log: Path | None = None, env: dict[str, str] | None = None,
                 app: str = "jobs_app:app", options: tuple[str, ...] = (),
                 manage: Path | None = None, cwd: Path | None = None,
                 prefix: Sequence[str] = ()) -> None:
        """``manage``: a Django project's manage.py, to run ``manage.py skipjack worker``
        (its app from the project's settings) instead. ``prefix``: a command the worker's
        command line is given to, e.g. ``ip netns exec NAME`` to run it on a simulated host
        (it must exec the worker, so that ``pid`` is the worker's)."""
        if manage is None:
            cmd = [sys.executable, "-m", "skipjack", "--dsn", dsn, "--schema", schema,
                   *options, "worker", app]
        else:
            cmd = [sys.executable, str(manage), "skipjack", *options, "worker"]
        for q in queues or ["default"]:
            cmd += ["--queue", q]
        cmd += list(args)
        self.log_path = log
        out = open(log, "ab") if log else subprocess.DEVNULL
        self.application_name = f"skipjack-{schema}"  # tell this worker's sessions apart
        full_env = {**os.environ, "SKIPJACK_SCHEMA": schema, "SKIPJACK_DATABASE_URL": dsn,
                    "SKIPJACK_APPLICATION_NAME": self.application_name, "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        where = cwd or (manage.parent if manage else TESTS)
        self.proc = subprocess.Popen([*prefix, *cmd], cwd=where, env=full_env,
                                     stdout=out,
                                     stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.kill()


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(url: str, timeout: float = 10) -> tuple[int, str]:
    """(status, body) of a GET over real HTTP; an HTTP error status is returned, not raised,
    and a server that cannot be reached (yet) gives status 0 and the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except urllib.error.URLError as exc:
        return 0, str(exc.reason)


def kill_repeatedly(dsn: str, schema: str, ids: list[int],
                    start: Callable[[int], WorkerProcess], kills: int = 3) -> None:
    """Run workers made by ``start(n)`` over the jobs ``ids``, SIGKILLing each of the first
    ``kills`` once it has finished some jobs more (others are then mid-run), so that their
    jobs are rescued after their lease; the last one runs until every job succeeded."""
    def succeeded() -> int:
        return states(dsn, schema).get("succeeded", 0)

    for n in range(kills):
        before = succeeded()
        with start(n) as worker:
            wait_until(lambda b=before: succeeded() > b, timeout=60,  # type: ignore[misc]
                       what=f"worker {n} finished some jobs")
            worker.kill()
    with start(kills):
        wait_until(lambda: succeeded() == len(ids), timeout=120,
                   what="every job succeeded after the kills")


@contextmanager
def fresh_database(server: Server) -> Iterator[str]:
    """A new database on ``server`` for the block (its DSN), then dropped with every session
    still on it; a Django test database of it (test_<name>) too."""
    name = "db_" + secrets.token_hex(5)
    with server.connect() as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(server.dsn, dbname=name)
    finally:
        with server.connect() as conn:
            for db in (name, "test_" + name):
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(db)))
