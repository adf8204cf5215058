"""A throwaway high-availability PostgreSQL cluster: one etcd member and two Patroni nodes.

Used by the failover test (``tests/test_failover.py``) and by hand
(``python -m skipjack_tools.ha`` starts one, prints its DSN and runs until interrupted).
It runs Debian's packages (``patroni``, ``etcd-server``, ``etcd-client`` and PostgreSQL 15,
see :func:`pg_bin`); PostgreSQL runs as the ``postgres`` user, so starting it needs root.
Everything lives in one temporary directory (data directories, configuration, logs) that
:meth:`HACluster.close` removes after killing every process started in it.

Patroni runs with ``synchronous_mode: true``: a commit with ``synchronous_commit`` on waits
until the synchronous standby has flushed its WAL, and Patroni promotes only that standby.
``ttl``, ``loop_wait`` and ``retry_timeout`` are a few seconds, so that a primary that dies
is replaced within seconds (its leader key expires after at most ``ttl``).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg

T = TypeVar("T")

PG_VERSION = "15"
PATRONI = "patroni"
ETCD = "etcd"
OS_USER = "postgres"
SCOPE = "skipjack-ha"

# Patroni's timing (seconds): a leader key lives ``TTL`` s unless renewed, every ``LOOP_WAIT``
# s; a DCS or PostgreSQL call is retried for ``RETRY_TIMEOUT`` s. Patroni wants
# loop_wait + 2 * retry_timeout <= ttl.
TTL = 6
LOOP_WAIT = 1
RETRY_TIMEOUT = 2

_PATRONI_CONFIG = """\
scope: {scope}
name: {name}
log:
  level: INFO
restapi:
  listen: 127.0.0.1:{api_port}
  connect_address: 127.0.0.1:{api_port}
etcd3:
  hosts: 127.0.0.1:{etcd_port}
bootstrap:
  dcs:
    ttl: {ttl}
    loop_wait: {loop_wait}
    retry_timeout: {retry_timeout}
    maximum_lag_on_failover: 1048576
    synchronous_mode: true
    postgresql:
      use_pg_rewind: false
      use_slots: true
      parameters:
        wal_level: replica
        hot_standby: "on"
        max_wal_senders: 5
        max_replication_slots: 5
        wal_keep_size: 64MB
        max_connections: 100
        shared_buffers: 32MB
  initdb:
    - encoding: UTF8
    - locale: C.UTF-8
    - auth: trust
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:{pg_port}
  connect_address: 127.0.0.1:{pg_port}
  data_dir: {data_dir}
  bin_dir: {bin_dir}
  pgpass: {node_dir}/pgpass
  authentication:
    superuser:
      username: postgres
      password: postgres
    replication:
      username: replicator
      password: replicator
  parameters:
    unix_socket_directories: {node_dir}
    logging_collector: "off"
    log_min_messages: warning
tags:
  nofailover: false
  noloadbalance: false
  clonefrom: false
  nosync: false
"""


class HAError(RuntimeError):
    """The cluster could not be started, or did not reach the state waited for in time."""


def pg_bin() -> Path:
    """PostgreSQL's programs: ``$SKIPJACK_HA_PG_BIN`` if set, else Debian's PostgreSQL 15,
    else the newest major version Debian has installed (a path that may not exist)."""
    given = os.environ.get("SKIPJACK_HA_PG_BIN")
    if given:
        return Path(given)
    root = Path("/usr/lib/postgresql")
    preferred = root / PG_VERSION / "bin"
    if (preferred / "postgres").exists() or not root.is_dir():
        return preferred
    majors = sorted((p for p in root.iterdir() if p.name.isdigit()
                     and (p / "bin" / "postgres").exists()), key=lambda p: int(p.name))
    return majors[-1] / "bin" if majors else preferred


def unavailable() -> str | None:
    """Why a cluster cannot be started on this machine (None: it can).

    Needs root (PostgreSQL runs as the ``postgres`` user), Patroni, etcd and PostgreSQL's
    programs (see :func:`pg_bin`; Debian: ``apt-get install patroni etcd-server etcd-client
    postgresql``).
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root: PostgreSQL runs as the postgres user, which only root can start"
    missing = [name for name in (PATRONI, ETCD) if shutil.which(name) is None]
    if not (pg_bin() / "postgres").exists():
        missing.append(f"PostgreSQL ({pg_bin()})")
    try:
        pwd.getpwnam(OS_USER)
    except KeyError:
        missing.append(f"the {OS_USER} user")
    if missing:
        return ("not installed: " + ", ".join(missing)
                + " (Debian: apt-get install patroni etcd-server etcd-client postgresql)")
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(condition: Callable[[], T | None], timeout: float, what: str,
             interval: float = 0.1) -> T:
    """Poll ``condition`` until it returns a truthy value, and return that value.

    Args:
        condition: called every ``interval`` seconds; exceptions propagate.
        timeout: seconds before giving up.
        what: what is waited for, for the error message.
        interval: seconds between calls.

    Raises:
        HAError: ``condition`` gave no truthy value within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise HAError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def _processes_under(directory: Path) -> list[int]:
    """Pids of the live processes whose working directory is ``directory`` or below it.

    PostgreSQL's processes all run in their data directory, Patroni and etcd in the
    directory they were started in: this finds every process of a node, whatever started
    it, including a postmaster that Patroni re-started or that outlived its Patroni.
    """
    root = str(directory.resolve())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:  # gone, a zombie, or a kernel thread
            continue
        if cwd == root or cwd.startswith(root + os.sep):
            found.append(int(entry.name))
    return found


def kill_all_under(directory: Path, timeout: float = 30) -> list[int]:
    """Stop every process running in ``directory`` at once, as a machine crash would: each
    is SIGSTOPped (until no new one appears, so none can fork or write any further), then
    all are SIGKILLed. Returns their pids.

    Raises:
        HAError: some were still alive after ``timeout`` seconds.
    """
    stopped: set[int] = set()
    while True:
        new = [pid for pid in _processes_under(directory) if pid not in stopped]
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
            stopped.add(pid)
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: not _processes_under(directory) or None, timeout,
             f"the processes in {directory} to die")
    return sorted(stopped)


def _http_json(url: str, timeout: float = 2) -> Any:
    """The JSON body of a GET (an HTTP error status still gives its body), or None when
    nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


@dataclass
class Node:
    """One Patroni node and its PostgreSQL."""

    name: str
    pg_port: int
    api_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def log_path(self) -> Path:
        """Patroni's log, with PostgreSQL's (Patroni passes its stderr on)."""
        return self.directory / "patroni.log"

    @property
    def dsn(self) -> str:
        """This node alone, whatever its role."""
        return (f"host=127.0.0.1 port={self.pg_port} user=postgres dbname=postgres "
                f"connect_timeout=2")

    def log(self) -> str:
        """Patroni's and PostgreSQL's log so far ("" before the node started)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def is_primary(self) -> bool:
        """Whether this node answers and accepts writes (False while it is unreachable)."""
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        except psycopg.Error:
            return False
        return row is not None and not row[0]

    def patroni_cluster(self) -> dict[str, Any] | None:
        """Patroni's view of the cluster (``GET /cluster`` of this node's REST API)."""
        body = _http_json(f"http://127.0.0.1:{self.api_port}/cluster")
        return body if isinstance(body, dict) else None


class HACluster:
    """etcd and two Patroni nodes in a temporary directory; use as a context manager (or
    call :meth:`start` and, always, :meth:`close`).

    Args:
        base: the directory in which to make the temporary one (default: the system's).
        keep_logs: a directory to copy each process's log into on :meth:`close` (for a
            failed test to show), or None.
    """

    def __init__(self, base: Path | None = None, keep_logs: Path | None = None) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="skipjack-ha-", dir=base))
        self.directory.chmod(0o755)  # the postgres user must reach its nodes' directories
        self.keep_logs = keep_logs
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.nodes = [Node(name, free_port(), free_port(), self.directory / name)
                      for name in ("node1", "node2")]

    @property
    def dsn(self) -> str:
        """Both nodes, the writable one chosen at each connection (libpq tries the hosts in
        turn and keeps the first that accepts writes)."""
        ports = ",".join(str(n.pg_port) for n in self.nodes)
        return (f"host={','.join('127.0.0.1' for _ in self.nodes)} port={ports} "
                f"user=postgres dbname=postgres target_session_attrs=read-write")

    def node(self, name: str) -> Node:
        """The node called ``name``.

        Raises:
            KeyError: no such node.
        """
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def __enter__(self) -> HACluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float = 120) -> None:
        """Start etcd, then both Patroni nodes, and wait until one is the primary with the
        other streaming to it as its synchronous standby.

        Args:
            timeout: seconds for the whole start.

        Raises:
            HAError: the cluster was not ready in time (the logs are in :attr:`directory`).
        """
        deadline = time.monotonic() + timeout
        self._start_etcd()
        wait_for(lambda: (_http_json(f"http://127.0.0.1:{self.etcd_port}/health") or {})
                 .get("health") == "true", max(1, deadline - time.monotonic()), "etcd")
        postgres = pwd.getpwnam(OS_USER)
        for node in self.nodes:
            self._start_patroni(node, postgres.pw_uid, postgres.pw_gid)
        self.wait_ready(max(1, deadline - time.monotonic()))

    def _start_etcd(self) -> None:
        data = self.directory / "etcd"
        data.mkdir(mode=0o700)
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        with open(self.directory / "etcd.log", "wb") as out:
            self.etcd = subprocess.Popen(
                [ETCD, "--name", "ha", "--data-dir", str(data), "--listen-client-urls", client,
                 "--advertise-client-urls", client, "--listen-peer-urls", peer,
                 "--initial-advertise-peer-urls", peer, "--initial-cluster", f"ha={peer}",
                 "--initial-cluster-state", "new"],
                cwd=self.directory, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def _start_patroni(self, node: Node, uid: int, gid: int) -> None:
        node.directory.mkdir(mode=0o700)
        os.chown(node.directory, uid, gid)
        config = node.directory / "patroni.yml"
        config.write_text(_PATRONI_CONFIG.format(
            scope=SCOPE, name=node.name, api_port=node.api_port, etcd_port=self.etcd_port,
            ttl=TTL, loop_wait=LOOP_WAIT, retry_timeout=RETRY_TIMEOUT, pg_port=node.pg_port,
            data_dir=node.data_dir, bin_dir=pg_bin(), node_dir=node.directory))
        os.chown(config, uid, gid)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(node.directory),
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
        with open(node.log_path, "wb") as out:
            node.process = subprocess.Popen(
                [PATRONI, str(config)], cwd=node.directory, env=env, user=uid, group=gid,
                extra_groups=[], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def primary(self) -> Node | None:
        """The node that accepts writes now, if one does."""
        for node in self.nodes:
            if node.is_primary():
                return node
        return None

    def sync_standby(self, primary: Node) -> Node | None:
        """The node that streams to ``primary`` as its synchronous standby, as both
        PostgreSQL (``pg_stat_replication``) and Patroni (its ``/sync`` key) say; None if
        there is none (yet)."""
        try:
            with psycopg.connect(primary.dsn, autocommit=True) as conn:
                rows = conn.execute("SELECT application_name FROM pg_stat_replication "
                                    "WHERE state = 'streaming' AND sync_state = 'sync'"
                                    ).fetchall()
        except psycopg.Error:
            return None
        streaming = {r[0] for r in rows}
        view = primary.patroni_cluster() or {}
        for member in view.get("members", []):
            if member.get("role") == "sync_standby" and member.get("name") in streaming:
                return self.node(member["name"])
        return None

    def wait_ready(self, timeout: float = 60) -> tuple[Node, Node]:
        """Wait until a primary has a streaming synchronous standby; returns both.

        Raises:
            HAError: not within ``timeout`` seconds, or a Patroni process exited.
        """
        def ready() -> tuple[Node, Node] | None:
            for node in self.nodes:
                if node.process is not None and node.process.poll() is not None:
                    raise HAError(f"patroni on {node.name} exited with status "
                                  f"{node.process.returncode}:\n{node.log()[-3000:]}")
            primary = self.primary()
            standby = self.sync_standby(primary) if primary else None
            return (primary, standby) if primary and standby else None

        return wait_for(ready, timeout, "a primary with a synchronous standby", interval=0.2)

    def crash(self, node: Node) -> list[int]:
        """Kill ``node`` as a machine crash would: its Patroni and every PostgreSQL process,
        stopped at once and then SIGKILLed (nothing restarts its PostgreSQL, and its leader
        key, if it held it, expires after at most ``TTL`` seconds). Returns the pids.

        Raises:
            HAError: a process survived.
        """
        pids = kill_all_under(node.directory)
        if node.process is not None:
            node.process.wait(10)
        return pids

    def stall_replication(self, primary: Node, timeout: float = 10) -> list[int]:
        """SIGSTOP the WAL senders of ``primary`` (pids returned), so that nothing more of
        its WAL reaches the standby: a commit that waits for the synchronous standby then
        hangs, one with ``synchronous_commit = off`` commits locally only. :meth:`crash`
        of the primary ends the stall (or SIGCONT the pids).

        Raises:
            HAError: it has no WAL sender, or one did not stop within ``timeout`` seconds.
        """
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            pids = [int(r[0]) for r in conn.execute(
                "SELECT pid FROM pg_stat_replication").fetchall()]
        if not pids:
            raise HAError(f"{primary.name} has no WAL sender")
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

        def stopped() -> bool:
            for pid in pids:
                stat = Path(f"/proc/{pid}/stat").read_text()
                if stat[stat.rindex(")") + 2] not in "Tt":  # the state follows the name
                    return False
            return True

        wait_for(stopped, timeout, "the WAL senders to stop", interval=0.01)
        return pids

    def wait_primary(self, node: Node, timeout: float = 60) -> float:
        """Wait until ``node`` accepts writes; returns the seconds waited.

        Raises:
            HAError: it did not within ``timeout`` seconds.
        """
        started = time.monotonic()
        wait_for(node.is_primary, timeout, f"{node.name} to be promoted")
        return time.monotonic() - started

    def logs(self) -> dict[str, str]:
        """Each process's log so far: etcd's and each node's (Patroni with PostgreSQL)."""
        found = {n.name: n.log() for n in self.nodes}
        try:
            found["etcd"] = (self.directory / "etcd.log").read_text(errors="replace")
        except FileNotFoundError:
            found["etcd"] = ""
        return found

    def close(self) -> None:
        """Kill every process of the cluster and remove its directory (logs copied to
        ``keep_logs`` first, if given); safe to call more than once."""
        if not self.directory.exists():
            return
        try:
            kill_all_under(self.directory)
            for proc in [self.etcd, *(n.process for n in self.nodes)]:
                if proc is not None:
                    proc.wait(10)
            if self.keep_logs is not None:
                self.keep_logs.mkdir(parents=True, exist_ok=True)
                for name, text in self.logs().items():
                    (self.keep_logs / f"{name}.log").write_text(text)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


@contextmanager
def ha_cluster(base: Path | None = None, keep_logs: Path | None = None,
               timeout: float = 120) -> Iterator[HACluster]:
    """A started :class:`HACluster` for the block, closed (every process killed, its
    directory removed) however the block ends.

    Args:
        base: the directory in which to make the cluster's (default: the system's temp).
        keep_logs: where to copy the logs on close, or None.
        timeout: seconds for the start.

    Raises:
        HAError: this machine cannot run one (see :func:`unavailable`), or it was not ready
            within ``timeout`` seconds.
    """
    reason = unavailable()
    if reason:
        raise HAError(reason)
    cluster = HACluster(base, keep_logs)
    try:
        cluster.start(timeout)
        yield cluster
    finally:
        cluster.close()


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    """Start a cluster, print its DSN and nodes, and run until SIGINT (Ctrl-C) or SIGTERM,
    then tear it down."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop)
    try:
        with ha_cluster() as cluster:
            primary, standby = cluster.wait_ready()
            print(f"DSN: {cluster.dsn}")
            print(f"primary {primary.name} ({primary.dsn}), sync standby {standby.name} "
                  f"({standby.dsn}); files in {cluster.directory}", flush=True)
            while True:
                signal.pause()
    except HAError as exc:
        sys.exit(f"skipjack_tools.ha: {exc}")


if __name__ == "__main__":
    main()
