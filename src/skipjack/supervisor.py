"""``skipjack worker --processes N``: one process that runs N worker processes of the same
command line, restarts one that dies, forwards SIGTERM and SIGINT to all of them, and serves
one metrics endpoint for all of them.

Each worker process is a plain ``skipjack worker`` (the same arguments, without
``--processes``; a ``--name`` gets the process's number appended); they share nothing but
the database, as workers on several hosts do. A process that dies is started again after
1 s, doubling to 30 s while processes keep dying within 10 s of their start. A process whose
first start fails before it serves (exit status 1 or more: a module that does not import, a
setting, a database that cannot be reached) stops the supervisor with that status, as one
``skipjack worker`` would exit; a later start that fails is retried like any death. On
SIGTERM or SIGINT the supervisor sends SIGTERM to every worker (each then stops gracefully:
its running jobs get ``--grace``), waits for them, and exits 0, or 1 when a worker did not
stop cleanly; a second signal is forwarded too (a worker then exits at once).

Each worker process holds one end of a socket pair whose other end only the supervisor
holds: when the supervisor ends, however it ends (SIGKILL included), the worker reads the
end of the stream and stops gracefully, so no worker outlives its supervisor; the worker
sends one byte the other way once it serves (``follow_supervisor``).

With ``--metrics-port``, each worker serves its metrics on a port of its own on 127.0.0.1,
and the supervisor serves, on the port asked for, all of them merged, each series labelled
with ``process`` (0..N-1). With ``--health-port``, likewise for ``/livez`` and ``/readyz``
(``skipjack.runtime.health``): the supervisor answers 200 when every worker process
answers 200, else 503, with each process's answer in a JSON body. A process being started
again after it died counts as live (the supervisor is restarting it) but not ready.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

log = logging.getLogger("skipjack.supervisor")

RESTART_BASE = 1.0  # seconds before a dead worker is started again...
RESTART_CAP = 30.0  # ...doubling up to this while workers die young
YOUNG = 10.0  # seconds: a worker that dies sooner than this after its start died young
STOP_MARGIN = 15.0  # seconds past the workers' grace before the stragglers are SIGKILLed
# Seconds the merged pages wait for a worker process's answer (asked all at once): within
# the 1 s a Kubernetes probe waits by default, and Prometheus's 10 s scrape timeout.
HEALTH_TIMEOUT = 0.8
METRICS_TIMEOUT = 3.0
# Seconds a process may take to start serving and still count as live (/livez)
START_GRACE = 60.0
# The worker's end of its socket pair with the supervisor (a file descriptor number)
SUPERVISOR_FD = "SKIPJACK_SUPERVISOR_FD"
# Open files the supervisor needs besides one per worker process (its servers, pipes of a
# process being started, the interpreter's own)
OWN_FILES = 64


def child_argv(argv: Sequence[str], drop: Sequence[str]) -> list[str]:
    """``argv`` without the options ``drop`` (``--name value`` and ``--name=value``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def command_line() -> list[str]:
    """How to run this program again (``skipjack``, ``python -m skipjack`` or Django's
    ``manage.py``), without its arguments."""
    program = sys.argv[0]
    if program.endswith("__main__.py"):
        return [sys.executable, "-m", "skipjack"]
    return [sys.executable, program]


@dataclass
class Child:
    """One worker process and what the supervisor knows of it."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restart_at: float = 0.0
    delay: float = RESTART_BASE
    metrics_port: int | None = None
    health_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    starts: int = 0
    ready: bool = False  # this start has served (its byte came through the link)
    link: socket.socket | None = None  # the supervisor's end of the socket pair

    def close_link(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def poll_ready(self) -> bool:
        """Whether this start has served, reading the link without waiting."""
        if not self.ready and self.link is not None:
            try:
                self.ready = bool(self.link.recv(1))
            except BlockingIOError:
                pass
        return self.ready


class Supervisor:
    """Runs ``count`` copies of ``argv`` (see the module's doc).

    Args:
        argv: the worker's full command line (program included), without ``--processes``
            or ``--metrics-port``.
        count: worker processes, 1..1,024.
        grace: the workers' shutdown grace, in seconds (how long a stop may take).
        name: the workers' ``--name``, or "" for each its own default; process i is named
            ``<name>-<i>``.
        metrics: (host, port) of the merged metrics endpoint, or None.
        health: (host, port) of the merged ``/livez`` and ``/readyz``, or None.
    """

    def __init__(self, argv: list[str], count: int, *, grace: float, name: str = "",
                 metrics: tuple[str, int] | None = None,
                 health: tuple[str, int] | None = None) -> None:
        self.argv = argv
        self.grace = grace
        self.name = name
        self.children = [Child(i) for i in range(count)]
        self.stopping = threading.Event()
        self._signals = 0
        self._metrics = metrics
        self._health = health
        self._servers: list[http.server.ThreadingHTTPServer] = []
        _allow_open_files(count + OWN_FILES)

    def _pick_ports(self, child: Child) -> None:
        """Free ports on 127.0.0.1 for ``child``'s endpoints, none another process has (a
        port freed since its last start may have been taken)."""
        taken = {p for c in self.children if c is not child
                 for p in (c.metrics_port, c.health_port) if p is not None}
        if self._metrics is not None:
            child.metrics_port = _free_port(taken)
            taken.add(child.metrics_port)
            child.env.update({"SKIPJACK_WORKER_METRICS_PORT": str(child.metrics_port),
                              "SKIPJACK_METRICS_PORT": str(child.metrics_port),
                              "SKIPJACK_WORKER_METRICS_HOST": "127.0.0.1",
                              "SKIPJACK_METRICS_HOST": "127.0.0.1"})
        if self._health is not None:
            child.health_port = _free_port(taken)
            child.env.update({"SKIPJACK_HEALTH_PORT": str(child.health_port),
                              "SKIPJACK_HEALTH_HOST": "127.0.0.1"})

    def _start(self, child: Child) -> None:
        self._pick_ports(child)
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        env = {**os.environ, **child.env, "SKIPJACK_WORKER_PROCESS": str(child.index),
               SUPERVISOR_FD: str(theirs.fileno())}
        argv = [*self.argv, "--name", f"{self.name}-{child.index}"] if self.name else self.argv
        try:
            child.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                          pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        child.link, child.ready = ours, False
        child.starts += 1
        child.started = time.monotonic()
        log.info("worker process %d started (pid %d)", child.index, child.proc.pid)
        if self.stopping.is_set():  # a stop signal came while it was being started
            child.proc.send_signal(signal.SIGTERM)

    def _signal(self, sig: int, _frame: object) -> None:
        self._signals += 1
        self.stopping.set()
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Run until stopped by SIGTERM or SIGINT; returns the exit status: 0; 1 when a
        worker process did not stop cleanly; or the status of a worker process whose first
        start failed (2: a usage or settings error, as ``skipjack worker`` itself exits
        with)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signal)
        if self._metrics is not None:
            self._serve(*self._metrics, {"/metrics": self._metrics_page}, "metrics")
        if self._health is not None:
            self._serve(*self._health, {"/livez": lambda: self._health_page("/livez"),
                                        "/readyz": lambda: self._health_page("/readyz")},
                        "health")
        for child in self.children:
            if self.stopping.is_set():
                break
            self._start(child)
        while not self.stopping.is_set():
            now = time.monotonic()
            for child in self.children:
                if child.proc is not None:
                    child.poll_ready()
                if child.proc is not None and child.proc.poll() is not None:
                    code = child.proc.returncode
                    served = child.poll_ready()
                    child.close_link()
                    if code > 0 and child.starts == 1 and not served:
                        # as one `skipjack worker` would exit: no restart helps
                        log.error("worker process %d failed to start (status %d); stopping",
                                  child.index, code)
                        self._signal(signal.SIGTERM, None)
                        self._wait_for_all()
                        return code
                    young = now - child.started < YOUNG
                    if not young:
                        child.delay = RESTART_BASE
                    child.restart_at = now + child.delay
                    log.warning("worker process %d (pid %d) ended with status %s; starting it "
                                "again in %.0fs", child.index, child.proc.pid, code,
                                child.delay)
                    if young:
                        child.delay = min(RESTART_CAP, child.delay * 2)
                    child.proc = None
                if child.proc is None and now >= child.restart_at \
                        and not self.stopping.is_set():
                    self._start(child)
            self.stopping.wait(0.2)
        return 0 if self._wait_for_all() else 1

    def _wait_for_all(self) -> bool:
        """Wait for every worker to stop (killing those still running past the grace and
        STOP_MARGIN); whether each exited with status 0."""
        for server in self._servers:
            server.shutdown()
        self._servers = []
        deadline = time.monotonic() + self.grace + STOP_MARGIN
        clean = True
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker process %d did not stop in time: killed", child.index)
                child.proc.kill()
                child.proc.wait(30)
            # -SIGTERM: the stop reached a process still starting, before its handlers
            clean = clean and child.proc.returncode in (0, -signal.SIGTERM)
            child.close_link()
        log.info("every worker process stopped")
        return clean

    # --- metrics and health ---------------------------------------------------------

    def _serve(self, host: str, port: int,
               pages: dict[str, Callable[[], tuple[int, str, bytes]]], what: str) -> None:
        """Serve ``pages`` (path -> (status, content type, body)) on ``host:port``.

        Raises:
            ConfigError: the address cannot be listened on.
        """
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                page = pages.get(self.path.split("?")[0])
                if page is None:
                    self.send_error(404)
                    return
                status, content_type, body = page()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        try:
            server = http.server.ThreadingHTTPServer((host, port), Handler)
        except OSError:
            raise ConfigError(f"cannot listen on {host}:{port} for {what}: the port is in use, "
                              "or the address is not this host's") from None
        self._servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True,
                         name=f"skipjack-supervisor-{what}").start()
        log.info("%s of every worker process at http://%s:%d%s", what, host, port,
                 " and ".join(pages))

    def _metrics_page(self) -> tuple[int, str, bytes]:
        return (200, "text/plain; version=0.0.4; charset=utf-8",
                self.metrics_text().encode())

    def _health_page(self, path: str) -> tuple[int, str, bytes]:
        """``path`` (/livez or /readyz) of every worker process, asked all at once: 200 if
        all answer 200 within HEALTH_TIMEOUT. For /livez, a process that does not answer
        while the supervisor starts it (dead and not yet started again, or started less than
        START_GRACE seconds ago and not yet serving) counts as live."""
        answers: dict[str, Any] = {}
        ok = True
        replies = _all(self.children, lambda child: _get(
            f"http://127.0.0.1:{child.health_port}{path}", HEALTH_TIMEOUT))
        now = time.monotonic()
        for child, (status, body) in zip(self.children, replies, strict=True):
            proc = child.proc
            starting = proc is None or proc.poll() is not None or (
                not child.ready and now - child.started < START_GRACE)
            if status == 0 and starting and path == "/livez":
                status, body = 200, {"starting": True}  # the supervisor's own doing
            answers[str(child.index)] = {"status": status, **body}
            ok = ok and status == 200
        return (200 if ok else 503, "application/json",
                json.dumps({"ok": ok, "processes": answers}).encode())

    def metrics_text(self) -> str:
        """Every worker's metrics, merged, each series labelled ``process``; a worker that
        does not answer within METRICS_TIMEOUT (starting, restarting, stopped) is left out
        of this scrape. The workers are asked all at once."""
        def scrape(child: Child) -> str | None:
            try:
                url = f"http://127.0.0.1:{child.metrics_port}/metrics"
                with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT) as response:
                    text: str = response.read().decode()
                    return text
            except OSError:
                return None

        asked = [c for c in self.children if c.metrics_port is not None]
        return merge_metrics({child.index: text
                              for child, text in zip(asked, _all(asked, scrape), strict=True)
                              if text is not None})


def _all(children: Sequence[Child], ask: Callable[[Child], Any]) -> list[Any]:
    """``ask(child)`` for every child, each in a thread of its own; the answers in order."""
    if not children:
        return []
    with ThreadPoolExecutor(len(children), thread_name_prefix="skipjack-supervisor-ask") as ex:
        return list(ex.map(ask, children))


def _get(url: str, timeout: float) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a worker's health page; (0, the reason) when it does not
    answer within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, _json_object(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _json_object(exc.read())
    except OSError as exc:
        return 0, {"error": str(exc)}


def follow_supervisor(started: threading.Event, stop: Callable[[], None]) -> None:
    """In a worker process a ``Supervisor`` started (``$SKIPJACK_SUPERVISOR_FD`` set; else
    nothing): call ``stop`` (a graceful stop, thread-safe) once the supervisor has ended,
    whatever ended it, and tell it when the worker serves (``started`` set). Threads of
    their own do both."""
    fd = os.environ.pop(SUPERVISOR_FD, "")
    if not fd:
        return
    link = socket.socket(fileno=int(fd))

    def watch() -> None:
        try:
            while link.recv(64):  # the supervisor sends nothing: this returns at the end
                pass
        except OSError:  # ECONNRESET: it ended before reading what this process sent
            pass
        log.warning("the supervisor has ended: stopping")
        stop()

    def announce() -> None:
        started.wait()
        with contextlib.suppress(OSError):  # the supervisor has ended: watch() stops
            link.send(b"r")

    threading.Thread(target=watch, daemon=True, name="skipjack-supervisor-watch").start()
    threading.Thread(target=announce, daemon=True, name="skipjack-supervisor-ready").start()


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def merge_metrics(texts: dict[int, str]) -> str:
    """Prometheus text exposition of several processes merged into one, each sample with a
    ``process`` label (its key in ``texts``); families of one name become one family.

    Raises:
        ModuleNotFoundError: prometheus_client is not installed.
    """
    from prometheus_client.exposition import generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import Collector, CollectorRegistry
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                         family.type, family.unit)
            for s in family.samples:
                merged.samples.append(Sample(s.name, {**s.labels, "process": str(index)},
                                             s.value, s.timestamp, s.exemplar))

    class Merged(Collector):
        def collect(self) -> Any:
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry).decode()


def _free_port(taken: set[int]) -> int:
    """A port on 127.0.0.1 free now and not in ``taken``."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in taken:
            return port


def _allow_open_files(needed: int) -> None:
    """Raise this process's soft limit of open files to ``needed`` (up to its hard limit).

    Raises:
        ConfigError: the hard limit is lower (``ulimit -n``).
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigError(f"--processes: {needed - OWN_FILES} processes need about {needed} "
                          f"open files in the supervisor; its limit is {hard} (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
