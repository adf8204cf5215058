"""The app's own connection pools: psycopg_pool's, with the connection returned last kept
aside for the next caller.

One enqueue at a time through a plain ``psycopg_pool.ConnectionPool`` alternates between two
connections: the pool opens a second one when a caller finds none idle (the first caller,
while the pool's first connection is still being opened), and it hands out the connection
that has been idle the longest. Each call then runs on a connection, and a server backend,
that sat out the call before; on one connection the same loop takes about 15% less time and
client CPU (docs/performance.md, "One enqueue per call"). These pools keep the connection
returned last in a slot and give it to the next caller; a caller that finds the slot taken
(a concurrent one) gets one of the pool's connections, as before.

Every ``SLOT_SECONDS`` the returned connection goes back through the pool instead, which then
applies its own rules to it (``max_lifetime``, ``max_idle``) and hands out its oldest idle
connection next. A connection returned inside a transaction, or broken, always goes through
the pool (which rolls it back, or replaces it).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, ConnectionPool

SLOT_SECONDS = 60.0

Conn = psycopg.Connection[Any]
AsyncConn = psycopg.AsyncConnection[Any]


def _idle(conn: Conn | AsyncConn) -> bool:
    """Whether a returned connection may go straight to the next caller: open and outside
    any transaction."""
    return conn.pgconn.transaction_status == TransactionStatus.IDLE


class _Slot:
    """The slot of one pool: the connection returned last, and when the next connection
    returned goes back through the pool instead (time.monotonic() seconds)."""

    def __init__(self) -> None:
        self.conn: Any = None
        self.closing = False
        self.through_pool_at = time.monotonic() + SLOT_SECONDS

    def take(self) -> Any:
        conn, self.conn = self.conn, None
        return conn

    def keep(self, conn: Conn | AsyncConn) -> bool:
        """Put ``conn`` in the slot if it is empty and the connection is idle; returns
        whether it did (else the caller returns it to the pool)."""
        if self.conn is not None or self.closing or not _idle(conn):
            return False
        now = time.monotonic()
        if now >= self.through_pool_at:
            self.through_pool_at = now + SLOT_SECONDS
            return False
        self.conn = conn
        return True


class HotPool(ConnectionPool[Conn]):
    """A ``psycopg_pool.ConnectionPool`` whose ``getconn`` gives the connection returned
    last (see the module's docstring); thread-safe. Arguments as the pool's own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slot = _Slot()
        self._slot_lock = threading.Lock()

    def getconn(self, timeout: float | None = None) -> Conn:
        """The slot's connection, else one of the pool's (waiting up to ``timeout``
        seconds: raises ``psycopg_pool.PoolTimeout`` after that)."""
        with self._slot_lock:
            conn: Conn | None = self._slot.take()
        return conn if conn is not None else super().getconn(timeout)

    def putconn(self, conn: Conn) -> None:
        """Keep ``conn`` in the slot, or return it to the pool."""
        with self._slot_lock:
            if self._slot.keep(conn):
                return
        super().putconn(conn)

    def close(self, timeout: float = 5.0) -> None:
        """Close the pool, and the slot's connection."""
        with self._slot_lock:
            self._slot.closing = True
            conn: Conn | None = self._slot.take()
        super().close(timeout)
        if conn is not None:
            super().putconn(conn)  # a closed pool closes what it is given back


class AsyncHotPool(AsyncConnectionPool[AsyncConn]):
    """``HotPool`` for asyncio: an ``AsyncConnectionPool`` (used from one event loop, so
    the slot needs no lock)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slot = _Slot()

    async def getconn(self, timeout: float | None = None) -> AsyncConn:
        """As ``HotPool.getconn``."""
        conn: AsyncConn | None = self._slot.take()
        return conn if conn is not None else await super().getconn(timeout)

    async def putconn(self, conn: AsyncConn) -> None:
        """As ``HotPool.putconn``."""
        if not self._slot.keep(conn):
            await super().putconn(conn)

    async def close(self, timeout: float = 5.0) -> None:
        """As ``HotPool.close``."""
        self._slot.closing = True
        conn: AsyncConn | None = self._slot.take()
        await super().close(timeout)
        if conn is not None:
            await super().putconn(conn)
