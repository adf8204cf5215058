"""The app's own pools (skipjack.pools): the connection returned last serves the next caller;
concurrent callers get others; a connection left in a transaction, broken, or past the slot's
time goes back through the pool; closing closes the slot's connection too."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

from skipjack import App, pools
from skipjack.pools import AsyncHotPool, HotPool

from support import Server


def _pid(pool: ConnectionPool[psycopg.Connection[Any]]) -> int:
    with pool.connection() as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        return int(row[0])


def _pool(server: Server, cls: type[ConnectionPool[Any]] = HotPool,
          ) -> ConnectionPool[psycopg.Connection[Any]]:
    """A pool holding two idle connections: a plain pool hands them out in turn."""
    pool = cls(server.dsn, min_size=2, max_size=4, kwargs={"autocommit": True}, open=True)
    pool.wait(timeout=30)
    return pool


def test_one_caller_at_a_time_gets_one_connection(server: Server) -> None:
    plain, hot = _pool(server, ConnectionPool), _pool(server)
    try:
        assert len({_pid(plain) for _ in range(20)}) == 2
        assert len({_pid(hot) for _ in range(20)}) == 1
    finally:
        plain.close()
        hot.close()


def test_concurrent_callers_get_their_own_connections(server: Server) -> None:
    pool = _pool(server)
    held = threading.Barrier(3)
    pids: list[int] = []

    def hold() -> None:
        with pool.connection() as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            pids.append(row[0])
            held.wait(timeout=30)  # all three hold one at once

    try:
        threads = [threading.Thread(target=hold) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(set(pids)) == 3
        assert len({_pid(pool) for _ in range(10)}) == 1  # one again once they are back
    finally:
        pool.close()


def test_a_connection_returned_in_a_transaction_is_rolled_back_not_handed_on(
        server: Server, schema: str) -> None:
    pool = _pool(server)
    try:
        with pool.connection() as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
            conn.execute(f"CREATE TABLE {schema}.t (n int)")
        conn = pool.getconn()
        conn.execute("BEGIN")
        conn.execute(f"INSERT INTO {schema}.t VALUES (1)")
        pool.putconn(conn)  # still in its transaction
        with pool.connection() as again:
            assert again.info.transaction_status == TransactionStatus.IDLE
            assert again.execute(f"SELECT count(*) FROM {schema}.t").fetchone() == (0,)
    finally:
        pool.close()


def test_a_broken_connection_is_replaced(server: Server) -> None:
    pool = _pool(server)
    try:
        first = _pid(pool)
        with server.connect() as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [first])
        with pytest.raises(psycopg.OperationalError):
            _pid(pool)  # the slot's connection: as with any idle pooled one, the use fails
        second = _pid(pool)
        assert second != first and _pid(pool) == second
    finally:
        pool.close()


def test_past_the_slot_time_connections_go_through_the_pool(
        server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools, "SLOT_SECONDS", 0.0)
    pool = _pool(server)
    try:
        assert len({_pid(pool) for _ in range(20)}) == 2  # the pool's own order again
    finally:
        pool.close()


def test_closing_closes_the_slot_connection(server: Server) -> None:
    pool = _pool(server)
    with pool.connection() as conn:
        pass
    pool.close()
    assert conn.closed


def test_async_pool(server: Server) -> None:
    async def main() -> tuple[set[int], set[int], bool]:
        pool = AsyncHotPool(server.dsn, min_size=2, max_size=4, kwargs={"autocommit": True},
                            open=False)
        await pool.open(wait=True, timeout=30)

        async def pid(held: asyncio.Barrier | None = None) -> int:
            async with pool.connection() as conn:
                row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
                assert row is not None
                if held is not None:
                    await asyncio.wait_for(held.wait(), 30)  # all three hold one at once
                return int(row[0])

        one = {await pid() for _ in range(20)}
        held = asyncio.Barrier(3)
        concurrent = set(await asyncio.gather(*(pid(held) for _ in range(3))))
        async with pool.connection() as last:
            pass
        await pool.close()
        return one, concurrent, last.closed

    one, concurrent, closed = asyncio.run(main())
    assert len(one) == 1 and len(concurrent) == 3 and closed


def test_the_apps_enqueues_one_at_a_time_share_a_connection(app: App) -> None:
    t = app.task(name="t")(lambda n: None)
    for n in range(10):
        t.enqueue(n=n)
    pids = set()
    for _ in range(10):
        with app.reading() as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            pids.add(row[0])
        t.enqueue(n=0)
    assert len(pids) == 1
    with app.reading() as conn:
        assert conn.execute(f"SELECT count(*) FROM {app.schema}.jobs").fetchone() == (20,)
