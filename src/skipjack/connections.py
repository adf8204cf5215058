"""The psycopg connection beneath what a caller passes as ``conn=``: a psycopg connection
itself, an SQLAlchemy 2 ``Session``, ``Connection``, ``AsyncSession`` or ``AsyncConnection``
(on the psycopg driver), or a Django database connection (``django.db.connection`` or
``connections[alias]``, on Django's psycopg 3 backend).

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
    module = type(conn).__module__
    if module.startswith("sqlalchemy."):
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session
        if isinstance(conn, Session):
            conn = conn.connection()  # begins the session's transaction if it had none
        if isinstance(conn, Connection):
            if not conn.in_transaction():
                conn.begin()  # as a query would (autobegin): its commit() then commits
            return _on_psycopg(conn, conn.connection.driver_connection, psycopg.Connection)
        raise _wrong(conn, "is not an SQLAlchemy Session or Connection (an async one? use "
                           "the async enqueue)")
    if module.startswith(("django.db.backends.", "django.utils.connection")):  # or its proxy
        conn.ensure_connection()  # type: ignore[attr-defined]
        return _on_psycopg(conn, conn.connection, psycopg.Connection)  # type: ignore[attr-defined]
    if isinstance(conn, psycopg.AsyncConnection):
        raise _wrong(conn, "is async: use the async enqueue (enqueue_async)")
    raise _wrong(conn, "is not a connection skipjack can enqueue on: give a psycopg "
                       "Connection, an SQLAlchemy Session or Connection, or a Django "
                       "connection")


async def async_connection(conn: object) -> psycopg.AsyncConnection[Any]:
    """The psycopg async connection whose transaction ``conn`` is in: a psycopg
    ``AsyncConnection``, or an SQLAlchemy ``AsyncSession`` or ``AsyncConnection``.

    Raises:
        ValidationError: ``conn`` is none of these, or is not on psycopg 3.
    """
    if isinstance(conn, psycopg.AsyncConnection):
        return conn
    if type(conn).__module__.startswith("sqlalchemy."):
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
        if isinstance(conn, AsyncSession):
            conn = await conn.connection()
        if isinstance(conn, AsyncConnection):
            if not conn.in_transaction():
                await conn.begin()
            raw = await conn.get_raw_connection()
            return _on_psycopg(conn, raw.driver_connection, psycopg.AsyncConnection)
        raise _wrong(conn, "is not an SQLAlchemy AsyncSession or AsyncConnection (a sync "
                           "one? use the sync enqueue)")
    if isinstance(conn, psycopg.Connection):
        raise _wrong(conn, "is sync: use the sync enqueue (enqueue)")
    raise _wrong(conn, "is not a connection skipjack can enqueue on: give a psycopg "
                       "AsyncConnection, or an SQLAlchemy AsyncSession or AsyncConnection")
