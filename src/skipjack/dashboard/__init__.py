"""skipjack's web dashboard: an ASGI application to see and steer the queue (extra
``skipjack[dashboard]``: Starlette, Jinja2, uvicorn).

``skipjack dashboard [MODULE:APP]`` serves it (see ``serve``); an application mounts
``create_app``'s result in its own Starlette, FastAPI or Django ASGI application
(docs/dashboard.md shows each). Pages: overview, jobs (filters, keyset pagination, job
detail), queues, cron, workers, and enqueue by hand; actions: retry, cancel, discard (a
selection or everything matching a filter), pause and resume, queue limits, run a cron
schedule now, enqueue.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

from starlette.types import ASGIApp

from ..app import App
from ..errors import ConfigError
from .pages import Pages, starlette_app
from .security import LOOPBACK_HOSTS, Credentials, Guard

__all__ = ["Credentials", "create_app", "listen", "serve"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8700


def create_app(app: App, *, read_only: bool = False, credentials: Credentials | None = None,
               allowed_hosts: Sequence[str] | None = None, secret: bytes | None = None,
               title: str = "skipjack") -> ASGIApp:
    """The dashboard of ``app`` as an ASGI application.

    Args:
        app: the skipjack App whose queue it shows (its tasks and cron schedules are the
            ones "enqueue" and "run now" offer).
        read_only: refuse every action (pages only).
        credentials: required of every request (None: none; then serve it only on a
            loopback address, or behind the host application's own authentication).
        allowed_hosts: the only host names a request's ``Host`` header may give (None: any);
            ``serve`` sets the loopback names when it serves without credentials.
        secret: the key of the CSRF tokens (random per process when None; give one shared
            by every process when several serve the same dashboard behind a balancer).
        title: the name in the page titles.

    Mounted under a path (``Mount("/skipjack", create_app(app))``), every link and form
    stays under it.
    """
    pages = Pages(app, read_only=read_only, title=title)
    return Guard(starlette_app(pages), credentials=credentials, allowed_hosts=allowed_hosts,
                 secret=secret)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host`` (an IPv4 or IPv6 address, or a name) and ``port``
    (0: any free one).

    Raises:
        OSError: the address cannot be bound (in use, not this machine's).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, reuse_port=False)


def serve(app: App, sock: socket.socket, *, read_only: bool = False,
          credentials: Credentials | None = None, log_level: str = "warning") -> None:
    """Serve the dashboard with uvicorn on ``sock`` (from ``listen``) until SIGINT or
    SIGTERM.

    Args:
        sock: the listening socket; anything but a loopback address needs ``credentials``.
        read_only: see ``create_app``.
        credentials: see ``Credentials`` (``Credentials.from_env`` reads them from
            the environment).
        log_level: uvicorn's log level.

    Raises:
        ConfigError: a non-loopback address without credentials (nothing is served).
    """
    import uvicorn

    host = sock.getsockname()[0]
    if credentials is None and not is_loopback(host):
        raise ConfigError(f"--host {host}: the dashboard listens beyond this machine only "
                          "with credentials; set SKIPJACK_DASHBOARD_TOKEN, or "
                          "SKIPJACK_DASHBOARD_USER and SKIPJACK_DASHBOARD_PASSWORD")
    asgi = create_app(app, read_only=read_only, credentials=credentials,
                      allowed_hosts=(*LOOPBACK_HOSTS, host) if credentials is None else None)
    config = uvicorn.Config(asgi, log_level=log_level, access_log=False, server_header=False,
                            lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])
