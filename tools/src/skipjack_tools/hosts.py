"""Simulated worker hosts: Linux network namespaces, each joined to this one by a wire that
can add latency and can be cut (a network partition), and a private PostgreSQL server that
listens on this side of every wire.

Host ``i`` is the network namespace ``skipjack-h<i>``. Its only link is a point-to-point
pair of TUN devices: ``sjh<i>n`` inside the namespace (10.201.i.2) and ``sjh<i>`` here
(10.201.i.1, the address its workers reach the server at). Nothing else is touched: no
other interface, route or firewall rule, and no address outside 10.201.0.0/16.

The wire is a small process of its own (``python -m skipjack_tools.hosts wire N``) that holds
both TUN devices of every host and copies each packet from one to the other, after a delay
when one is set (the same on both directions, so 2 ms is 4 ms added to a round trip), or
drops it while its host is partitioned. A dropped packet is simply gone, as on a cut cable:
no RST, no ICMP error, no carrier change, so TCP on both ends only retransmits and the
software above it sees a connection that hangs. The kernel's ``netem`` qdisc would do the
same, but it is not built into every kernel (this project's machines lack it:
``CONFIG_NET_SCH_NETEM`` is not set), and a wire in user space behaves the same everywhere.
Its TUN devices exist only while it holds them: when it ends, even by SIGKILL, they vanish.
It ends when its standard input closes, so also when the process that started it dies.

Only one ``Network`` exists at a time on a machine: it holds a lock (``flock``) while it
lives, and whatever it finds of its own names on entering (namespaces, devices, a private
server's data directory) is the leftover of a run that was killed, and is removed first.
Needs root, ``ip`` (iproute2), ``/dev/net/tun``, and for ``PrivateServer`` the PostgreSQL
server binaries and a ``postgres`` system user; ``unavailable()`` says what is missing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

NETNS_PREFIX = "skipjack-h"  # host i: network namespace skipjack-h<i>
DEVICE_PREFIX = "sjh"  # host i: device sjh<i> here, sjh<i>n inside its namespace
MAX_HOSTS = 64
MTU = 1500
LOCK_TIMEOUT = 600.0  # seconds to wait for another Network on this machine to end
COMMAND_TIMEOUT = 30.0  # seconds for one `ip` command or one reply of the wire

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000


class HostsUnavailable(RuntimeError):
    """Simulated hosts cannot be made on this machine (the message says why)."""


def base_dir() -> Path:
    """Where the lock and the private server's files live (``$SKIPJACK_HOSTS_DIR``, else
    ``skipjack-hosts`` in the temporary directory)."""
    override = os.environ.get("SKIPJACK_HOSTS_DIR")
    return Path(override) if override else Path(tempfile.gettempdir()) / "skipjack-hosts"


def _run(*argv: str, check: bool = True, timeout: float = COMMAND_TIMEOUT
         ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise HostsUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here, or None when they can. Checks for Linux,
    root, ``ip``, ``/dev/net/tun``, and that a network namespace can be created (it makes
    one and removes it at once)."""
    if not sys.platform.startswith("linux"):
        return "simulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces and TUN devices)"
    if shutil.which("ip") is None:
        return "simulated hosts need `ip` (iproute2)"
    if not os.path.exists("/dev/net/tun"):
        return "simulated hosts need /dev/net/tun (TUN devices)"
    probe = f"{NETNS_PREFIX}probe{os.getpid()}"
    done = _run("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` is not allowed here: {done.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    """One simulated host: a network namespace with one link to this one.

    Attributes:
        index: its number, from 0.
        netns: the network namespace's name.
        address: its own address, inside the namespace.
        gateway: the address of this side of its link: where its workers reach the server.
    """

    index: int
    netns: str
    address: str
    gateway: str

    @property
    def device(self) -> str:
        """The TUN device on this side of its link."""
        return f"{DEVICE_PREFIX}{self.index}"

    @property
    def inner_device(self) -> str:
        """The TUN device inside its namespace."""
        return f"{DEVICE_PREFIX}{self.index}n"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace (``ip netns exec``; the program
        replaces ``ip``, so the process started has the program's pid)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host's namespace (``subprocess.Popen`` keywords)."""
        return subprocess.Popen(self.command(argv), **kwargs)


def _host(i: int) -> Host:
    return Host(i, f"{NETNS_PREFIX}{i}", f"10.201.{i}.2", f"10.201.{i}.1")


class Network:
    """``count`` simulated hosts for the ``with`` block, then removed (also when the block
    fails). Use ``set_delay`` for latency, ``partition`` and ``heal`` to cut a host off
    and to join it again.

    Args:
        count: hosts to make (1..64).
        delay: seconds added to each packet in each direction, on every host (0: none).

    Raises:
        HostsUnavailable (on entering): hosts cannot be made here, or another ``Network``
            held the machine for longer than ``LOCK_TIMEOUT`` seconds.
    """

    def __init__(self, count: int, *, delay: float = 0.0) -> None:
        if not 1 <= count <= MAX_HOSTS:
            raise ValueError(f"count: {count} is out of range 1..{MAX_HOSTS}")
        self.hosts = [_host(i) for i in range(count)]
        self.dir = base_dir()
        self._delay = delay
        self._lock: IO[bytes] | None = None
        self._wire: subprocess.Popen[bytes] | None = None
        self._delays = [0.0] * count

    def __enter__(self) -> Network:
        why = unavailable()
        if why:
            raise HostsUnavailable(why)
        self.dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        self._lock = _lock(self.dir / "lock")
        try:
            remove_leftovers(self.dir)
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _create(self) -> None:
        for host in self.hosts:
            _run("ip", "netns", "add", host.netns)
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
        self._wire = subprocess.Popen(
            [sys.executable, "-m", "skipjack_tools.hosts", "wire", str(len(self.hosts))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, start_new_session=True)
        self._reply()  # the devices exist
        for host in self.hosts:
            _run("ip", "link", "set", host.inner_device, "netns", host.netns)
            _run("ip", "-n", host.netns, "addr", "add", host.address, "peer", host.gateway,
                 "dev", host.inner_device)
            _run("ip", "-n", host.netns, "link", "set", host.inner_device, "mtu", str(MTU),
                 "up")
            _run("ip", "addr", "add", host.gateway, "peer", host.address, "dev", host.device)
            _run("ip", "link", "set", host.device, "mtu", str(MTU), "up")
        if self._delay:
            for host in self.hosts:
                self.set_delay(host, self._delay)

    def _tell(self, line: str) -> None:
        wire = self._wire
        if wire is None or wire.stdin is None:
            raise HostsUnavailable("the wire is not running")
        wire.stdin.write(line.encode() + b"\n")
        wire.stdin.flush()
        self._reply()

    def _reply(self) -> None:
        wire = self._wire
        assert wire is not None and wire.stdout is not None
        ready, _, _ = select.select([wire.stdout], [], [], COMMAND_TIMEOUT)
        line = wire.stdout.readline().decode().strip() if ready else "(no reply)"
        if line != "ok":
            raise HostsUnavailable(f"the wire failed: {line or 'it exited'}")

    def set_delay(self, host: Host, seconds: float) -> None:
        """Delay every packet to and from ``host`` by ``seconds`` (each way; 0: none)."""
        if not 0 <= seconds <= 10:
            raise ValueError(f"delay: {seconds} seconds is out of range 0..10")
        self._tell(f"delay {host.index} {seconds!r}")
        self._delays[host.index] = seconds

    def delay(self, host: Host) -> float:
        """The seconds each packet to and from ``host`` is delayed now (each way)."""
        return self._delays[host.index]

    def partition(self, host: Host) -> None:
        """Cut ``host`` off: from now on every packet to or from it is dropped silently
        (and those delayed on the wire are dropped too)."""
        self._tell(f"drop {host.index} 1")

    def heal(self, host: Host) -> None:
        """Join ``host`` again after ``partition``: its packets flow from now on."""
        self._tell(f"drop {host.index} 0")

    @property
    def wire_pid(self) -> int | None:
        """The wire process's pid (None before it started)."""
        return self._wire.pid if self._wire else None

    def close(self) -> None:
        """Remove everything made (idempotent): the processes left in the hosts'
        namespaces are killed, the wire ends (its devices vanish), the namespaces go."""
        if self._wire is not None:
            wire, self._wire = self._wire, None
            with contextlib.suppress(OSError):
                assert wire.stdin is not None
                wire.stdin.close()
            try:
                wire.wait(10)
            except subprocess.TimeoutExpired:
                wire.kill()
                wire.wait()
            if wire.stdout is not None:
                wire.stdout.close()
        if self._lock is not None:
            remove_leftovers(self.dir)
            self._lock.close()  # releases the flock
            self._lock = None


def _lock(path: Path) -> IO[bytes]:
    out = open(path, "wb")  # held open for the Network's life
    deadline = time.monotonic() + LOCK_TIMEOUT
    while True:
        try:
            fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return out
        except BlockingIOError:
            if time.monotonic() > deadline:
                out.close()
                raise HostsUnavailable(f"another run holds {path} (simulated hosts in use) "
                                       f"for more than {LOCK_TIMEOUT:.0f}s") from None
            time.sleep(0.2)


def remove_leftovers(directory: Path | None = None) -> None:
    """Remove what a run of ``Network`` killed before its clean-up left, by the names it
    uses: processes in namespaces ``skipjack-h<i>`` (SIGKILL, by pid), those namespaces
    (and ``unavailable``'s probe), devices ``sjh*``, and a private server in ``directory``
    (stopped, its files removed). Call it only while holding the lock (``Network`` does)."""
    directory = directory or base_dir()
    listed = _run("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    for name in names:
        if not re.fullmatch(re.escape(NETNS_PREFIX) + r"(probe)?\d+", name):
            continue
        pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        for pid in pids:
            _wait_gone(int(pid))
        _run("ip", "netns", "del", name, check=False)
    links = _run("ip", "-o", "link", "show", check=False).stdout
    for match in re.finditer(rf"^\d+: ({DEVICE_PREFIX}\d+n?)[@:]", links, re.MULTILINE):
        _run("ip", "link", "del", match.group(1), check=False)
    PrivateServer.remove_leftover(directory / "postgres")


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.02)


# --- the private server -------------------------------------------------------------------


def server_binaries() -> Path | None:
    """A directory with ``initdb``, ``pg_ctl`` and ``postgres``: ``$SKIPJACK_HOSTS_PG_BIN``,
    else the newest ``/usr/lib/postgresql/*/bin``, else ``pg_config --bindir``."""
    candidates: list[Path] = []
    override = os.environ.get("SKIPJACK_HOSTS_PG_BIN")
    if override:
        candidates.append(Path(override))
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                      key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    candidates += reversed(versions)
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        if out.returncode == 0:
            candidates.append(Path(out.stdout.strip()))
    for path in candidates:
        if all((path / name).is_file() for name in ("initdb", "pg_ctl", "postgres")):
            return path
    return None


SERVER_USER = "postgres"


class PrivateServer:
    """A PostgreSQL server of its own for the hosts of ``network``, for the ``with`` block:
    initdb's settings (autovacuum on, fsync on), listening on the ``gateway`` address of
    every host and on a Unix socket in its directory, trust authentication for those, run
    as the ``postgres`` system user (PostgreSQL refuses root). Stopped and its files
    removed afterwards.

    Args:
        network: the hosts (entered: its addresses must exist).
        settings: more ``postgresql.conf`` settings, name -> value (as written there).

    Raises:
        HostsUnavailable (on entering): no server binaries or no ``postgres`` user; or
            initdb or the start failed (the message has the server's log).
    """

    def __init__(self, network: Network, settings: dict[str, str] | None = None) -> None:
        self.network = network
        self.dir = network.dir / "postgres"
        self.settings = settings or {}
        self.port = 0
        self.version = ""
        self._bin: Path | None = None

    @property
    def dsn(self) -> str:
        """For this side: the Unix socket (nothing on a wire)."""
        return f"host={self.dir / 'socket'} port={self.port} user=postgres dbname=postgres"

    def dsn_for(self, host: Host) -> str:
        """For processes on ``host``: TCP to its gateway, over its wire."""
        return f"host={host.gateway} port={self.port} user=postgres dbname=postgres"

    def __enter__(self) -> PrivateServer:
        self._bin = server_binaries()
        if self._bin is None:
            raise HostsUnavailable("no PostgreSQL server binaries (initdb, pg_ctl, postgres); "
                                   "set SKIPJACK_HOSTS_PG_BIN")
        try:
            user = pwd.getpwnam(SERVER_USER)
        except KeyError:
            raise HostsUnavailable(f"no {SERVER_USER!r} system user to run PostgreSQL as"
                                   ) from None
        self.remove_leftover(self.dir)
        try:
            self._start(user)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _as_server_user(self, *argv: str, timeout: float = 120
                        ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["runuser", "-u", SERVER_USER, "--", *argv], capture_output=True,
                              text=True, timeout=timeout, cwd="/")
        if done.returncode != 0:
            log = self.dir / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise HostsUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()} "
                                   f"{done.stdout.strip()} {tail}")
        return done

    def _start(self, user: pwd.struct_passwd) -> None:
        assert self._bin is not None
        data = self.dir / "data"
        (self.dir / "socket").mkdir(parents=True)
        for path in (self.dir, self.dir / "socket"):
            os.chown(path, user.pw_uid, user.pw_gid)
        self._as_server_user(str(self._bin / "initdb"), "-D", str(data), "-U", "postgres",
                             "-A", "trust", "-E", "UTF8", "--no-instructions")
        self.port = _free_port([h.gateway for h in self.network.hosts])
        conf = {"listen_addresses": "'" + ",".join(h.gateway for h in self.network.hosts) + "'",
                "port": str(self.port),
                "unix_socket_directories": f"'{self.dir / 'socket'}'",
                **self.settings}
        with open(data / "postgresql.conf", "a") as out:
            out.write("\n# skipjack_tools.hosts\n")
            out.writelines(f"{k} = {v}\n" for k, v in conf.items())
        with open(data / "pg_hba.conf", "a") as out:
            out.write("host all all 10.201.0.0/16 trust\n")
        self._as_server_user(str(self._bin / "pg_ctl"), "-D", str(data), "-l",
                             str(self.dir / "server.log"), "-w", "-t", "60", "start")
        version = self._as_server_user(str(self._bin / "postgres"), "--version").stdout
        self.version = version.strip()

    def close(self) -> None:
        """Stop the server (fast shutdown) and remove its files (idempotent)."""
        self.remove_leftover(self.dir)

    @staticmethod
    def remove_leftover(directory: Path) -> None:
        """Stop a server whose data directory is ``directory``/data (immediate shutdown)
        and remove ``directory``; nothing there: nothing done."""
        data = directory / "data"
        pid_file = data / "postmaster.pid"
        if pid_file.exists():
            bin_dir = server_binaries()
            if bin_dir is not None:
                subprocess.run(["runuser", "-u", SERVER_USER, "--", str(bin_dir / "pg_ctl"),
                                "-D", str(data), "-m", "fast", "-w", "-t", "60", "stop"],
                               capture_output=True, timeout=120, cwd="/")
            with contextlib.suppress(OSError, ValueError, IndexError):
                pid = int(pid_file.read_text().split()[0])  # still there: it did not stop
                os.kill(pid, signal.SIGKILL)
                _wait_gone(pid)
        shutil.rmtree(directory, ignore_errors=True)


def _free_port(addresses: Sequence[str]) -> int:
    """A TCP port free on every one of ``addresses`` (the OS picks one on the first)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((addresses[0], 0))
            port: int = s.getsockname()[1]
        try:
            with contextlib.ExitStack() as stack:
                for address in addresses[1:]:
                    s2 = stack.enter_context(socket.socket())
                    s2.bind((address, port))
            return port
        except OSError:
            continue
    raise HostsUnavailable(f"no TCP port free on all of {', '.join(addresses)}")


@contextlib.contextmanager
def hosts_with_server(count: int, *, delay: float = 0.0,
                      settings: dict[str, str] | None = None
                      ) -> Iterator[tuple[Network, PrivateServer]]:
    """``count`` hosts and a private server on their network, for the ``with`` block.

    Raises:
        HostsUnavailable: see ``Network`` and ``PrivateServer``.
    """
    with Network(count, delay=delay) as network, PrivateServer(network, settings) as server:
        yield network, server


# --- the wire (its own process) -----------------------------------------------------------


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class _Wire:
    """Copies packets between the two TUN devices of each host (see the module's doc)."""

    def __init__(self, count: int) -> None:
        self.peer: dict[int, int] = {}  # fd -> the fd its packets are written to
        self.host: dict[int, int] = {}  # fd -> host index
        for i in range(count):
            outer, inner = _open_tun(f"{DEVICE_PREFIX}{i}"), _open_tun(f"{DEVICE_PREFIX}{i}n")
            self.peer[outer], self.peer[inner] = inner, outer
            self.host[outer] = self.host[inner] = i
        self.delay = [0.0] * count
        self.dropped = [False] * count
        self.queued: dict[int, deque[tuple[float, bytes]]] = {fd: deque() for fd in self.peer}
        self.commands = b""

    def command(self, line: str) -> None:
        word, index, value = line.split()
        i = int(index)
        if word == "delay":
            self.delay[i] = float(value)
        elif word == "drop":
            self.dropped[i] = value == "1"
            if self.dropped[i]:
                for fd, host in self.host.items():
                    if host == i:
                        self.queued[self.peer[fd]].clear()
        else:
            raise ValueError(line)

    def read_commands(self) -> bool:
        """Apply the commands on stdin; False at its end."""
        chunk = os.read(0, 4096)
        if not chunk:
            return False
        self.commands += chunk
        while b"\n" in self.commands:
            line, self.commands = self.commands.split(b"\n", 1)
            try:
                self.command(line.decode())
                reply = "ok"
            except (ValueError, IndexError) as exc:
                reply = f"bad command {line!r}: {exc}"
            os.write(1, reply.encode() + b"\n")
        return True

    def receive(self, fd: int, now: float) -> None:
        i, out = self.host[fd], self.peer[fd]
        for _ in range(256):  # then give the other devices a turn
            try:
                packet = os.read(fd, 65536)
            except BlockingIOError:
                return
            if self.dropped[i]:
                continue
            if self.delay[i] == 0 and not self.queued[out]:
                _write(out, packet)
            else:
                self.queued[out].append((now + self.delay[i], packet))

    def send_due(self, now: float) -> float | None:
        """Write the packets due by ``now``; seconds until the next is due (None: none)."""
        soonest: float | None = None
        for out, queue in self.queued.items():
            while queue and queue[0][0] <= now:
                _write(out, queue.popleft()[1])
            if queue:
                wait = queue[0][0] - now
                soonest = wait if soonest is None else min(soonest, wait)
        return soonest

    def run(self) -> None:
        os.write(1, b"ok\n")
        devices = list(self.peer)
        timeout: float | None = None
        while True:
            readable, _, _ = select.select([0, *devices], [], [], timeout)
            now = time.monotonic()
            for fd in readable:
                if fd == 0:
                    if not self.read_commands():
                        return
                else:
                    self.receive(fd, now)
            timeout = self.send_due(time.monotonic())


def _write(fd: int, packet: bytes) -> None:
    try:
        os.write(fd, packet)
    except OSError as exc:  # the device is down or its queue full: lost, as on a wire
        if exc.errno not in (errno.EAGAIN, errno.EIO, errno.EINVAL, errno.ENOBUFS):
            raise


def _main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == "wire":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # ends with its stdin, not with a ^C
        try:
            wire = _Wire(int(argv[1]))
        except OSError as exc:
            os.write(1, f"cannot create the TUN devices: {exc}\n".encode())
            return 1
        wire.run()
        return 0
    sys.stderr.write("usage: python -m skipjack_tools.hosts wire COUNT\n")
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
