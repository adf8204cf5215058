"""``skipjack worker --processes N``: one process that runs N worker processes of the same
command line, restarts one that dies, forwards SIGTERM and SIGINT to all of them, and serves
one metrics endpoint for all of them.

Each worker process is a plain ``skipjack worker`` (the same arguments, without
``--processes``); they share nothing but the database, as workers on several hosts do. A
process that dies is started again after 1 s, doubling to 30 s while processes keep dying
within 10 s of their start. On SIGTERM or SIGINT the supervisor sends SIGTERM to every
worker (each then stops gracefully: its running jobs get ``--grace``), waits for them, and
exits 0; a second signal is forwarded too (a worker then exits at once).

With ``--metrics-port``, each worker serves its metrics on a port of its own on 127.0.0.1,
and the supervisor serves, on the port asked for, all of them merged, each series labelled
with ``process`` (0..N-1). With ``--health-port``, likewise for ``/livez`` and ``/readyz``
(``skipjack.runtime.health``): the supervisor answers 200 when every worker process
answers 200, else 503, with each process's answer in a JSON body. A process being started
again after it died counts as live (the supervisor is restarting it) but not ready.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

log = logging.getLogger("skipjack.supervisor")

RESTART_BASE = 1.0  # seconds before a dead worker is started again...
RESTART_CAP = 30.0  # ...doubling up to this while workers die young
YOUNG = 10.0  # seconds: a worker that dies sooner than this after its start died young
STOP_MARGIN = 15.0  # seconds past the workers' grace before the stragglers are SIGKILLed


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


class Supervisor:
    """Runs ``count`` copies of ``argv`` (see the module's doc).

    Args:
        argv: the worker's full command line (program included), without ``--processes``
            or ``--metrics-port``.
        count: worker processes, 1..1,024.
        grace: the workers' shutdown grace, in seconds (how long a stop may take).
        metrics: (host, port) of the merged metrics endpoint, or None.
        health: (host, port) of the merged ``/livez`` and ``/readyz``, or None.
    """

    def __init__(self, argv: list[str], count: int, *, grace: float,
                 metrics: tuple[str, int] | None = None,
                 health: tuple[str, int] | None = None) -> None:
        self.argv = argv
        self.grace = grace
        self.children = [Child(i) for i in range(count)]
        self.stopping = threading.Event()
        self._signals = 0
        self._metrics = metrics
        self._health = health
        self._servers: list[http.server.ThreadingHTTPServer] = []
        for child in self.children:
            if metrics is not None:
                child.metrics_port = _free_port()
                child.env.update({"SKIPJACK_WORKER_METRICS_PORT": str(child.metrics_port),
                                  "SKIPJACK_METRICS_PORT": str(child.metrics_port),
                                  "SKIPJACK_WORKER_METRICS_HOST": "127.0.0.1",
                                  "SKIPJACK_METRICS_HOST": "127.0.0.1"})
            if health is not None:
                child.health_port = _free_port()
                child.env.update({"SKIPJACK_HEALTH_PORT": str(child.health_port),
                                  "SKIPJACK_HEALTH_HOST": "127.0.0.1"})

    def _start(self, child: Child) -> None:
        env = {**os.environ, **child.env, "SKIPJACK_WORKER_PROCESS": str(child.index)}
        child.proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL)
        child.started = time.monotonic()
        log.info("worker process %d started (pid %d)", child.index, child.proc.pid)

    def _signal(self, sig: int, _frame: object) -> None:
        self._signals += 1
        self.stopping.set()
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Run until stopped by SIGTERM or SIGINT; returns the exit status: 0, or 2 when a
        worker process refused to start (a usage or settings error, as ``skipjack worker``
        itself exits with)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signal)
        if self._metrics is not None:
            self._serve(*self._metrics, {"/metrics": self._metrics_page}, "metrics")
        if self._health is not None:
            self._serve(*self._health, {"/livez": lambda: self._health_page("/livez"),
                                        "/readyz": lambda: self._health_page("/readyz")},
                        "health")
        for child in self.children:
            self._start(child)
        while not self.stopping.is_set():
            now = time.monotonic()
            for child in self.children:
                if child.proc is not None and child.proc.poll() is not None:
                    code = child.proc.returncode
                    young = now - child.started < YOUNG
                    if code == 2 and young:  # a usage or settings error: no restart helps
                        log.error("worker process %d refused to start (status 2); stopping",
                                  child.index)
                        self._signal(signal.SIGTERM, None)
                        self._wait_for_all()
                        return 2
                    child.delay = min(RESTART_CAP, child.delay * 2) if young else RESTART_BASE
                    child.restart_at = now + (child.delay if young else RESTART_BASE)
                    log.warning("worker process %d (pid %d) ended with status %s; starting it "
                                "again in %.0fs", child.index, child.proc.pid, code,
                                child.restart_at - now)
                    child.proc = None
                if child.proc is None and now >= child.restart_at \
                        and not self.stopping.is_set():
                    self._start(child)
            self.stopping.wait(0.2)
        self._wait_for_all()
        return 0

    def _wait_for_all(self) -> None:
        for server in self._servers:
            server.shutdown()
        self._servers = []
        deadline = time.monotonic() + self.grace + STOP_MARGIN
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker process %d did not stop in time: killed", child.index)
                child.proc.kill()
                child.proc.wait(30)
        log.info("every worker process stopped")

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
        """``path`` (/livez or /readyz) of every worker process: 200 if all answer 200."""
        answers: dict[str, Any] = {}
        ok = True
        for child in self.children:
            status, body = _get(f"http://127.0.0.1:{child.health_port}{path}")
            if status == 0 and child.proc is None and path == "/livez":
                status, body = 200, {"restarting": True}  # the supervisor's own doing
            answers[str(child.index)] = {"status": status, **body}
            ok = ok and status == 200
        return (200 if ok else 503, "application/json",
                json.dumps({"ok": ok, "processes": answers}).encode())

    def metrics_text(self) -> str:
        """Every worker's metrics, merged, each series labelled ``process``; a worker that
        does not answer (starting, restarting) is left out of this scrape."""
        texts = {}
        for child in self.children:
            if child.metrics_port is None:
                continue
            try:
                url = f"http://127.0.0.1:{child.metrics_port}/metrics"
                with urllib.request.urlopen(url, timeout=5) as response:
                    texts[child.index] = response.read().decode()
            except OSError:
                continue
        return merge_metrics(texts)


def _get(url: str) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a worker's health page; (0, the reason) when it does not
    answer within 5 s."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, _json_object(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _json_object(exc.read())
    except OSError as exc:
        return 0, {"error": str(exc)}


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
