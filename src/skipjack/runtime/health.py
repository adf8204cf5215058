"""Health endpoints of a worker for probes such as Kubernetes' (``skipjack worker
--health-port``), served by the standard library's HTTP server from a daemon thread.

- ``GET /livez``: 200 while the worker's event loop answers within ``timeout`` seconds (also
  before it started); 503 when it does not (a handler that blocks the loop, a deadlock): the
  process should be restarted.
- ``GET /readyz``: 200 while the worker serves (started, not stopping), its database answers
  and the schema is the version this code needs; 503 otherwise. Either way the body is a JSON
  object saying which (``serving``, ``database``, ``schema``, ``listening``: whether
  notifications reach it, or it only polls, which is still ready).

A probe never touches the worker's own connections: ``/readyz`` keeps one connection of its
own, opened again after a failure, with ``timeout`` as its connect and statement timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg

from ..errors import SchemaVersionError
from ..migrate import check_schema
from .worker import Worker

log = logging.getLogger("skipjack.worker")

PROBE_TIMEOUT = 5.0  # seconds


class HealthServer(ThreadingHTTPServer):
    """Serves ``/livez`` and ``/readyz`` for ``worker`` (see ``skipjack.runtime.health``).

    Args:
        worker: the worker to report on.
        host, port: where to listen (port 0: any free one; see ``server_port``).
        timeout: seconds the loop and the database get to answer a probe.

    Raises:
        OSError: the port cannot be bound.
    """

    daemon_threads = True

    def __init__(self, worker: Worker, host: str, port: int,
                 timeout: float = PROBE_TIMEOUT) -> None:
        if ":" in host:  # an IPv6 address such as "::"
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self.worker = worker
        self.probe_timeout = timeout
        self._conn: psycopg.Connection[Any] | None = None
        self._db_lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, name="skipjack-health",
                                        daemon=True)

    def start(self) -> HealthServer:
        """Serve from a daemon thread; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the probe's connection."""
        self.shutdown()
        self.server_close()
        with self._db_lock:
            if self._conn is not None:
                self._conn.close()

    def live(self) -> tuple[bool, dict[str, Any]]:
        """Whether the worker's event loop answers (True before it runs)."""
        loop = self.worker.status()["loop"]
        if loop is None:
            return True, {"loop": "not started"}
        if loop.is_closed():
            return False, {"loop": "closed"}
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(self.probe_timeout)
        except TimeoutError:
            return False, {"loop": f"no answer within {self.probe_timeout:g}s"}
        except RuntimeError as exc:  # closed meanwhile
            return False, {"loop": str(exc)}
        return True, {"loop": "answers"}

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Whether the worker serves, its database answers and its schema is current."""
        status = self.worker.status()
        body: dict[str, Any] = {"serving": status["serving"],
                                "listening": status["listening"]}
        app = self.worker.app
        timeout = self.probe_timeout
        if not self._db_lock.acquire(timeout=timeout):  # a probe before this one still waits
            body.update(database=f"no answer within {timeout:g}s", schema="unknown")
            return False, body
        try:
            try:
                if self._conn is None or self._conn.closed:
                    # the client gives up too (tcp_user_timeout): a server that stopped
                    # answering must not hold the probe past its timeout
                    self._conn = app.db.connect(
                        connect_timeout=max(1, int(timeout)),
                        tcp_user_timeout=int(timeout * 1000),
                        options=f"-c statement_timeout={int(timeout * 1000)}")
                check_schema(self._conn, app.schema)
                body.update(database="reachable", schema="current")
            except SchemaVersionError as exc:
                body.update(database="reachable", schema=str(exc))
            except psycopg.Error as exc:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                body.update(database=f"unreachable: {str(exc).strip()}", schema="unknown")
        finally:
            self._db_lock.release()
        ready = status["serving"] and body["schema"] == "current"
        return ready, body


class _Handler(BaseHTTPRequestHandler):
    server: HealthServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/livez":
            ok, body = self.server.live()
        elif path == "/readyz":
            ok, body = self.server.ready()
        else:
            self._send(404, {"error": "not found: GET /livez or /readyz"})
            return
        self._send(200 if ok else 503, {"ok": ok, **body})

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("health: " + format, *args)


def serve_health(worker: Worker, port: int, host: str = "0.0.0.0",
                 timeout: float = PROBE_TIMEOUT) -> HealthServer:
    """Serve ``/livez`` and ``/readyz`` for ``worker`` on ``host:port`` from a daemon
    thread (see ``HealthServer``); returns the running server.

    Raises:
        OSError: the port cannot be bound.
    """
    return HealthServer(worker, host, port, timeout).start()
