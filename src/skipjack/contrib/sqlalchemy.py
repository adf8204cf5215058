"""SQLAlchemy 2 (extra ``skipjack[sqlalchemy]``; the ``postgresql+psycopg`` driver).

Enqueue in a session's transaction by passing it as ``conn``: ``Session``, ``Connection``,
``AsyncSession`` and ``AsyncConnection`` are accepted, and ``scoped_session`` and
``async_scoped_session`` (their current session; see ``skipjack.connections``)::

    with Session(engine) as session, session.begin():
        session.add(Order(id=7))
        app.enqueue(ship.job(order_id=7), conn=session)   # committed with the order

ORM writes of a ``transaction="complete"`` handler commit with its fenced completion, exactly
once, when the app takes those transactions from the engine (for ``async def`` handlers:
``complete_transaction_async=async_job_transactions(async_engine)`` and
``async_session``)::

    app = skipjack.App(dsn, complete_transaction=job_transactions(engine))

    @app.task(transaction="complete")
    def ship(order_id: int) -> None:
        with session() as s:
            s.get(Order, order_id).shipped = True
            s.commit()       # releases the session's savepoint; the job's transaction commits
                             # when the completion is written
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg

try:
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
    from sqlalchemy.orm import Session
except ModuleNotFoundError as missing:  # pragma: no cover - depends on the installation
    missing.msg += (": skipjack.contrib.sqlalchemy needs SQLAlchemy "
                    "(pip install 'skipjack[sqlalchemy]')")
    raise

from ..app import AsyncTransactionSource, TransactionSource
from ..connections import async_connection, sync_connection

_connection: contextvars.ContextVar[Connection] = contextvars.ContextVar(
    "skipjack_sqlalchemy_connection")
_async_connection: contextvars.ContextVar[AsyncConnection] = contextvars.ContextVar(
    "skipjack_sqlalchemy_async_connection")


def job_transactions(engine: Engine) -> TransactionSource:
    """A ``complete_transaction`` for ``skipjack.App``: each sync
    ``transaction="complete"`` handler runs in a transaction of a connection from ``engine``'s
    pool, which ``session`` joins.

    Args:
        engine: a sync engine on the ``postgresql+psycopg`` driver, to the app's database.

    Raises:
        ValidationError: (when a job runs) the engine is not on psycopg 3.
    """

    @contextmanager
    def transaction() -> Iterator[psycopg.Connection[Any]]:
        with engine.connect() as connection, connection.begin():
            token = _connection.set(connection)
            try:
                yield sync_connection(connection)
            finally:
                _connection.reset(token)

    return transaction


def session(**kwargs: Any) -> Session:
    """A new ``Session`` in the running job's transaction (a ``transaction="complete"``
    handler of an app built with ``job_transactions``). Its ``commit()`` releases a
    savepoint and its ``rollback()`` rolls back to it: the job's transaction itself commits
    with the fenced completion, or rolls back if the handler raises or the completion is
    stale. Close it (``with session() as s:``) before the handler returns.

    Args:
        kwargs: further ``Session`` arguments (not ``bind``).

    Raises:
        LookupError: not in such a handler.
    """
    connection = _connection.get(None)
    if connection is None:
        raise LookupError("skipjack.contrib.sqlalchemy.session() is for transaction="
                          "'complete' handlers of an App(complete_transaction="
                          "job_transactions(engine))")
    return Session(bind=connection, join_transaction_mode="create_savepoint", **kwargs)


def async_job_transactions(engine: AsyncEngine) -> AsyncTransactionSource:
    """A ``complete_transaction_async`` for ``skipjack.App``: each ``async def``
    ``transaction="complete"`` handler runs in a transaction of a connection from
    ``engine``'s pool, which ``async_session`` joins.

    Args:
        engine: an async engine on the ``postgresql+psycopg`` driver, to the app's database.
    """

    @asynccontextmanager
    async def transaction() -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        async with engine.connect() as connection, connection.begin():
            token = _async_connection.set(connection)
            try:
                yield await async_connection(connection)
            finally:
                _async_connection.reset(token)

    return transaction


def async_session(**kwargs: Any) -> AsyncSession:
    """``session`` for ``async def`` handlers of an app built with
    ``async_job_transactions``: an ``AsyncSession`` in the job's transaction.

    Raises:
        LookupError: not in such a handler.
    """
    connection = _async_connection.get(None)
    if connection is None:
        raise LookupError("skipjack.contrib.sqlalchemy.async_session() is for async "
                          "transaction='complete' handlers of an App(complete_transaction_"
                          "async=async_job_transactions(engine))")
    return AsyncSession(bind=connection, join_transaction_mode="create_savepoint", **kwargs)
