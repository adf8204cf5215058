"""Database plumbing shared by every part of skipjack: where the database is, how to connect,
the schema's statements, and how to tell a lost connection from a refused statement.

``Database`` is the small handle that components receive instead of the whole
``skipjack.App``: a DSN (resolved on first use), a schema and its statements, and
connection factories with skipjack's connection options.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.abc import Buffer
from psycopg.adapt import Loader

from . import embedded
from .sql import Queries

log = logging.getLogger("skipjack.db")

# Keepalives let an idle TCP connection that silently died (no RST) fail within about 25 s;
# tcp_user_timeout does the same for one with unacknowledged data in flight.
CONNECT_KWARGS: dict[str, Any] = {
    "connect_timeout": 10,
    "tcp_user_timeout": 30_000,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "application_name": os.environ.get("SKIPJACK_APPLICATION_NAME", "skipjack"),
    # text and JSON in UTF-8 whatever the database's encoding: psycopg reads JSON as UTF-8
    # (a LATIN1 database's "é" could not be read back), and statements are sent as UTF-8;
    # the server converts, and refuses a character its encoding lacks
    "client_encoding": "UTF8",
}
# Those of CONNECT_KWARGS that a DSN may set itself: its own value is then kept (a shorter
# tcp_user_timeout, say, to notice a network partition sooner).
DSN_MAY_SET = ("connect_timeout", "tcp_user_timeout", "keepalives", "keepalives_idle",
               "keepalives_interval", "keepalives_count")


_DECODER = json.JSONDecoder()


class JsonTextLoader(Loader):
    """Reads ``json`` values sent as text (UTF-8: see ``CONNECT_KWARGS``). psycopg's own
    loader hands bytes to ``json.loads``, which first works out their encoding: twice the
    time of this one for a small object (1.5 against 0.8 us)."""

    def load(self, data: Buffer) -> Any:
        return _DECODER.decode(str(data, "utf-8"))


class JsonbTextLoader(Loader):
    """Reads ``jsonb`` values sent as text, once per claimed job for its args. PostgreSQL
    writes a jsonb value's text itself, with no whitespace before or after the document, so
    ``JSONDecoder.raw_decode`` reads it without ``decode``'s two whitespace scans: 1.1
    against 1.95 us a small object, fetched 500 at a time (``json`` values keep the
    whitespace they were written with, and go through ``JsonTextLoader``)."""

    def load(self, data: Buffer) -> Any:
        return _DECODER.raw_decode(str(data, "utf-8"))[0]


def use_json_text_loader(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]
                         ) -> None:
    """Read the JSON that ``conn`` fetches with ``JsonTextLoader`` and
    ``JsonbTextLoader``."""
    conn.adapters.register_loader("json", JsonTextLoader)
    conn.adapters.register_loader("jsonb", JsonbTextLoader)


def without_dsn_settings(dsn: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` less the ``DSN_MAY_SET`` options that ``dsn`` sets itself (keyword
    arguments would override the DSN's values); all of them if ``dsn`` cannot be parsed."""
    try:
        given = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return kwargs
    return {k: v for k, v in kwargs.items() if k not in DSN_MAY_SET or k not in given}


def resolve_dsn(dsn: str | None = None) -> str:
    """The DSN to use: ``dsn`` if given, else ``$SKIPJACK_DATABASE_URL``, else
    ``$DATABASE_URL``, else the embedded server (started on demand)."""
    return (dsn or os.environ.get("SKIPJACK_DATABASE_URL") or os.environ.get("DATABASE_URL")
            or embedded.dsn())


def server_of(dsn: str | None) -> str:
    """The database ``dsn`` names, for people (``safe_dsn``); for None, the one
    ``resolve_dsn`` would use: $SKIPJACK_DATABASE_URL, $DATABASE_URL, else the embedded
    server (named by its data directory, not started)."""
    given = dsn or os.environ.get("SKIPJACK_DATABASE_URL") or os.environ.get("DATABASE_URL")
    return safe_dsn(given) if given else f"the embedded server at {embedded.data_dir()}"


def safe_dsn(dsn: str) -> str:
    """The DSN without its password, for logs (``<dsn>`` when it cannot be parsed)."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<dsn>"
    info.pop("password", None)
    return " ".join(f"{k}={v}" for k, v in info.items())


def connection_lost(exc: BaseException) -> bool:
    """Did the database connection itself fail (as opposed to a statement it refused)?

    Timeouts, lock waits refused and program limits (such as "too many notifications in the
    NOTIFY queue") are refused statements on a connection that still works."""
    return isinstance(exc, psycopg.OperationalError) and not isinstance(
        exc, psycopg.errors.QueryCanceled | psycopg.errors.LockNotAvailable
        | psycopg.errors.ProgramLimitExceeded)


async def close_quietly(conn: psycopg.AsyncConnection[Any] | None) -> None:
    """Close a connection that may already be broken, never raising."""
    if conn is not None:
        try:
            await conn.close()
        except Exception:  # closing a broken connection must not mask the real error
            log.debug("close failed", exc_info=True)


class ReconnectDelay:
    """Capped exponential delays (seconds) between attempts to reach the database.

    Delays double from ``base`` up to ``cap``, each with +-25% jitter so that many workers do
    not reconnect in lockstep after a server restart. A worker never gives up: it keeps trying
    at the cap (so it logs about once per ``cap`` seconds per component while the database is
    away). Call ``next`` for each wait and ``reset`` after a success.

    Args:
        base: seconds, the first delay (before jitter).
        cap: seconds, the largest delay (before jitter).
    """

    def __init__(self, base: float = 0.05, cap: float = 5.0) -> None:
        self.base = base
        self.cap = cap
        self._failures = 0

    def peek(self) -> float:
        """The un-jittered delay the next call to ``next`` is centred on."""
        return min(self.cap, self.base * 2.0 ** min(self._failures, 32))

    def next(self) -> float:
        """The delay before the next attempt; each call doubles the following one."""
        delay = self.peek() * random.uniform(0.75, 1.25)
        self._failures += 1
        return delay

    def reset(self) -> int:
        """Forget past failures (call after a successful connection or statement); returns
        how many there were (non-zero: the caller just recovered, and may say so)."""
        failures, self._failures = self._failures, 0
        return failures


class Database:
    """Where an app's jobs live: a DSN, a schema and its statements, and connections.

    Args:
        dsn: a libpq connection string or URI, or a callable returning one (called on first
            use); None resolves it on first use with ``resolve_dsn`` (which may start
            the embedded server).
        schema: the schema of skipjack's tables (validated by the caller).
        prepare: let psycopg prepare statements it runs often; False for a
            transaction-mode pooler that cannot keep prepared statements.
    """

    def __init__(self, dsn: str | Callable[[], str] | None, schema: str, *,
                 prepare: bool = True) -> None:
        self._dsn = dsn if isinstance(dsn, str) and dsn.strip() else None  # "": not given
        self._resolve = dsn if callable(dsn) else resolve_dsn
        self._lock = threading.Lock()
        self.schema = schema
        self.queries = Queries(schema)
        self._connect_kwargs: dict[str, Any] = {**CONNECT_KWARGS, "autocommit": True}
        if not prepare:
            self._connect_kwargs["prepare_threshold"] = None

    @property
    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of every connection (and pool): skipjack's options, less the
        timeouts and keepalives the DSN sets itself (see ``DSN_MAY_SET``)."""
        return without_dsn_settings(self.dsn, self._connect_kwargs)

    @property
    def dsn(self) -> str:
        """The resolved connection string (starts the embedded server when it is the one)."""
        with self._lock:
            if self._dsn is None:
                self._dsn = self._resolve()
            return self._dsn

    @dsn.setter
    def dsn(self, value: str) -> None:
        with self._lock:
            self._dsn = value

    def where(self) -> str:
        """Which database, for people: ``host=... port=... dbname=...`` (no password) and
        the schema, or the embedded server and its data directory."""
        if self._dsn is None and self._resolve is not resolve_dsn:
            return f"{safe_dsn(self.dsn)}, schema {self.schema}"
        return f"{server_of(self._dsn)}, schema {self.schema}"

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """A new sync connection (autocommit unless ``kwargs`` say otherwise).

        Raises:
            psycopg.OperationalError: the database cannot be reached.
        """
        conn = psycopg.connect(self.dsn, **{**self.connect_kwargs, **kwargs})
        use_json_text_loader(conn)
        return conn

    async def connect_async(self, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
        """A new async connection (autocommit unless ``kwargs`` say otherwise).

        Raises:
            psycopg.OperationalError: the database cannot be reached.
        """
        conn = await psycopg.AsyncConnection.connect(self.dsn,
                                                     **{**self.connect_kwargs, **kwargs})
        use_json_text_loader(conn)
        return conn
