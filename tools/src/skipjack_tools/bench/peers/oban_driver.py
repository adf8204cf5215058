"""Oban for Python through its public API, for ``skipjack bench --compare`` (Python 3.12+).

Configuration: ``Oban.create_pool`` (psycopg's async pool), the tables installed with
``oban.schema.install``, one queue whose limit is the scenario's concurrency, and the default
notifier (LISTEN/NOTIFY) and producer settings. Drain times come from Oban's jobs table (first
``attempted_at`` to last ``completed_at``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from oban import Oban, worker  # type: ignore[import-not-found]
from oban.schema import install  # type: ignore[import-not-found]

if TYPE_CHECKING:
    from . import _driverlib as lib
else:
    import _driverlib as lib

SPAN = """
SELECT count(*), extract(epoch FROM max(completed_at) - min(attempted_at))::float8
  FROM oban_jobs WHERE state = 'completed'
"""
SEEN: list[float] = []
SLEEP = {"seconds": 0.0}


class _Noop:
    """Does nothing, or sleeps SLEEP seconds."""

    async def process(self, job: Any) -> None:
        if SLEEP["seconds"]:
            await asyncio.sleep(SLEEP["seconds"])


class _Latency:
    """Records the enqueue-to-start latency."""

    async def process(self, job: Any) -> None:
        SEEN.append((time.time() - job.args["t0"]) * 1000)


Noop = worker(queue="bench")(_Noop)
Latency = worker(queue="bench")(_Latency)


async def _pool(dsn: str) -> Any:
    logging.getLogger("oban").setLevel(logging.WARNING)
    pool = await Oban.create_pool(dsn, max_size=10)
    await install(pool)
    return pool


async def w1(p: dict[str, Any]) -> dict[str, Any]:
    pool = await _pool(p["dsn"])
    async with Oban(pool=pool) as oban:
        async def single(i: int) -> None:
            await oban.enqueue(Noop.new({"i": i}))

        async def bulk(n: int) -> None:
            await oban.enqueue_many([Noop.new({"i": i}) for i in range(n)])

        result = await lib.timed_enqueue(single, bulk, p)
    await pool.close()
    return result


async def _done(pool: Any, n: int) -> bool:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM oban_jobs WHERE state = 'completed'")
        row = await cur.fetchone()
    return bool(row and row[0] >= n)


async def _drain(p: dict[str, Any], seconds: float, concurrency: int) -> dict[str, Any]:
    SLEEP["seconds"] = seconds
    pool = await _pool(p["dsn"])
    n = p["jobs"]
    async with Oban(pool=pool) as client:
        for start in range(0, n, 10_000):
            await client.enqueue_many([Noop.new({}) for _ in range(min(10_000, n - start))])

    async def done() -> bool:
        return await _done(pool, n)

    async with Oban(pool=pool, queues={"bench": concurrency}):
        await lib.wait_until(done, 600)
    await pool.close()
    return lib.span_rate(p["dsn"], SPAN)


async def w2(p: dict[str, Any]) -> dict[str, Any]:
    return await _drain(p, 0.0, p["concurrency"])


async def w4(p: dict[str, Any]) -> dict[str, Any]:
    return await _drain(p, p["seconds"], 8)


async def w3(p: dict[str, Any]) -> dict[str, Any]:
    pool = await _pool(p["dsn"])
    async with Oban(pool=pool, queues={"bench": 10}) as oban:
        await asyncio.sleep(1.0)
        for _ in range(p["jobs"]):
            await oban.enqueue(Latency.new({"t0": time.time()}))
            await asyncio.sleep(0.02)

        async def all_seen() -> bool:
            return bool(len(SEEN) >= p["jobs"])

        await lib.wait_until(all_seen, 60)
    await pool.close()
    return {**lib.percentiles(SEEN), "samples": SEEN}


if __name__ == "__main__":
    lib.main({"w1": w1, "w2": w2, "w3": w3, "w4": w4})
