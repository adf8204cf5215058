"""The psycopg connection beneath what a caller passes as ``conn=``: a psycopg connection
itself, an SQLAlchemy 2 ``Session``, ``Connection``, ``AsyncSession`` or ``AsyncConnection``
(on the psycopg driver), an SQLAlchemy ``scoped_session`` or ``async_scoped_session``
(Flask-SQLAlchemy's ``db.session`` is one: the session of the current scope is used), or a
Django database connection (``django.db.connection`` or ``connections[alias]``, on Django's
psycopg 3 backend).

A job enqueued through any of them belongs to that object's transaction: an SQLAlchemy
session or connection begins one if it had none (as a query would: commit it), and rolling
it back removes the job.
"""

from __future__ import annotations

from typing import Any, TypeVar

import psycopg
from psycopg.rows import tuple_row
from psycopg.types.json import JsonbLoader, JsonLoader

from .errors import ValidationError


def reading_cursor(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
    """A cursor on a caller's connection that reads rows as skipjack expects whatever that
    connection was set up with: tuples, and json/jsonb as Python values (Django's
    connection, for one, leaves them as text)."""
    cur = conn.cursor(row_factory=tuple_row)
    cur.adapters.register_loader("jsonb", JsonbLoader)
    cur.adapters.register_loader("json", JsonLoader)
    return cur


def _wrong(conn: object, detail: str) -> ValidationError:
    return ValidationError("conn", f"{type(conn).__module__}.{type(conn).__qualname__} "
                                   f"{detail}")


def _of_sqlalchemy(conn: object) -> bool:
    """Whether ``conn`` is an SQLAlchemy object, or one of a subclass of SQLAlchemy's (a
    ``Session`` subclass of the application's, say), without importing SQLAlchemy."""
    return any(c.__module__.startswith("sqlalchemy.") for c in type(conn).__mro__)


def _sqlalchemy_hint(conn: object, *, sync: bool) -> str:
    """What to pass instead of an SQLAlchemy object that is not one ``conn=`` accepts."""
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.ext.asyncio import (
        AsyncConnection,
        AsyncEngine,
        AsyncSession,
        async_scoped_session,
        async_sessionmaker,
    )
    from sqlalchemy.orm import Session, scoped_session, sessionmaker
    if isinstance(conn, (Engine, AsyncEngine)):
        kinds = "an AsyncSession or AsyncConnection" if isinstance(conn, AsyncEngine) else \
            "a Session or Connection"
        return (f": an engine is in no transaction; pass {kinds} of it, in the transaction "
                f"the job belongs to")
    if isinstance(conn, (sessionmaker, async_sessionmaker)):
        return ": pass a session it made, in the transaction the job belongs to"
    if sync and isinstance(conn, (AsyncSession, AsyncConnection, async_scoped_session)):
        return ": it is async, use the async enqueue (enqueue_async)"
    if not sync and isinstance(conn, (Session, Connection, scoped_session)):
        return ": it is sync, use the sync enqueue (enqueue, or enqueue_on for a task)"
    return ""


_C = TypeVar("_C", psycopg.Connection[Any], psycopg.AsyncConnection[Any])


def _on_psycopg(conn: object, raw: object, kind: type[_C]) -> _C:
    if not isinstance(raw, kind):
        raise _wrong(conn, f"runs on {type(raw).__module__}.{type(raw).__qualname__}; "
                           f"skipjack joins transactions of psycopg 3 connections only "
                           f"(SQLAlchemy: a postgresql+psycopg:// URL; Django: "
                           f"django.db.backends.postgresql with psycopg 3 installed)")
    return raw


def sync_connection(conn: object) -> psycopg.Connection[Any]:
    """The psycopg connection whose transaction ``conn`` is in (see the module's doc).

    Raises:
        ValidationError: ``conn`` is none of the accepted kinds, is async, or is not on
            psycopg 3.
    """
    if isinstance(conn, psycopg.Connection):
        return conn
    if _of_sqlalchemy(conn):
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session, scoped_session
        if isinstance(conn, scoped_session):
            conn = conn()  # the session of the current scope (as conn.add() would use)
        if isinstance(conn, Session):
            conn = conn.connection()  # begins the session's transaction if it had none
        if isinstance(conn, Connection):
            if not conn.in_transaction():
                conn.begin()  # as a query would (autobegin): its commit() then commits
            return _on_psycopg(conn, conn.connection.driver_connection, psycopg.Connection)
        raise _wrong(conn, "is not an SQLAlchemy Session, scoped_session or Connection"
                           + _sqlalchemy_hint(conn, sync=True))
    if type(conn).__module__.startswith(("django.db.backends.",
                                         "django.utils.connection")):  # or its proxy
        conn.ensure_connection()  # type: ignore[attr-defined]
        return _on_psycopg(conn, conn.connection, psycopg.Connection)  # type: ignore[attr-defined]
    if isinstance(conn, psycopg.AsyncConnection):
        raise _wrong(conn, "is async: use the async enqueue (enqueue_async)")
    flask = (" (Flask-SQLAlchemy: conn=db.session)"
             if type(conn).__module__.startswith("flask_sqlalchemy.") else "")
    raise _wrong(conn, "is not a connection skipjack can enqueue on: give a psycopg "
                       "Connection, an SQLAlchemy Session, scoped_session or Connection"
                       f"{flask}, or a Django connection")


async def async_connection(conn: object) -> psycopg.AsyncConnection[Any]:
    """The psycopg async connection whose transaction ``conn`` is in: a psycopg
    ``AsyncConnection``, or an SQLAlchemy ``AsyncSession``, ``async_scoped_session`` (its
    current session) or ``AsyncConnection``.

    Raises:
        ValidationError: ``conn`` is none of these, or is not on psycopg 3.
    """
    if isinstance(conn, psycopg.AsyncConnection):
        return conn
    if _of_sqlalchemy(conn):
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session
        if isinstance(conn, async_scoped_session):
            conn = conn()  # the session of the current scope
        if isinstance(conn, AsyncSession):
            conn = await conn.connection()
        if isinstance(conn, AsyncConnection):
            if not conn.in_transaction():
                await conn.begin()
            raw = await conn.get_raw_connection()
            return _on_psycopg(conn, raw.driver_connection, psycopg.AsyncConnection)
        raise _wrong(conn, "is not an SQLAlchemy AsyncSession, async_scoped_session or "
                           "AsyncConnection" + _sqlalchemy_hint(conn, sync=False))
    if isinstance(conn, psycopg.Connection):
        raise _wrong(conn, "is sync: use the sync enqueue (enqueue, or enqueue_on for a "
                           "task)")
    raise _wrong(conn, "is not a connection skipjack can enqueue on: give a psycopg "
                       "AsyncConnection, or an SQLAlchemy AsyncSession, async_scoped_session "
                       "or AsyncConnection")
