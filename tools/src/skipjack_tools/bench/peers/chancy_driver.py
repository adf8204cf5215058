"""chancy through its public API, for ``skipjack bench --compare``.

Configuration: an ``Async`` executor queue (no process pool for no-op and sleeping jobs) with
``concurrency`` = the scenario's, ``eager_polling=True`` (poll again as soon as a job ends),
a 1 s polling interval, notifications on, and ``push_many`` with one batch for bulk enqueue.
Drain times come from chancy's jobs table (first ``started_at`` to last ``completed_at``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from chancy import Chancy, Queue, Worker, job  # type: ignore[import-not-found]

if TYPE_CHECKING:
    from . import _driverlib as lib
else:
    import _driverlib as lib

SPAN = """
SELECT count(*), extract(epoch FROM max(completed_at) - min(started_at))::float8
  FROM chancy_jobs WHERE state = 'succeeded'
"""
SEEN: list[float] = []
SLEEP = {"seconds": 0.0}


async def _noop(i: int = 0) -> None:
    """A job that does nothing (or sleeps SLEEP seconds)."""
    if SLEEP["seconds"]:
        await asyncio.sleep(SLEEP["seconds"])


async def _latency(t0: float) -> None:
    """Records the enqueue-to-start latency."""
    SEEN.append((time.time() - t0) * 1000)


noop = job()(_noop)
latency = job()(_latency)


async def _chancy(dsn: str, concurrency: int) -> Any:
    chancy = Chancy(dsn, log=logging.getLogger("chancy-bench"))
    await chancy.__aenter__()
    await chancy.migrate()
    await chancy.declare(Queue("bench", concurrency=concurrency, executor=Chancy.Executor.Async,
                               polling_interval=1, eager_polling=True))
    return chancy


async def w1(p: dict[str, Any]) -> dict[str, Any]:
    chancy = await _chancy(p["dsn"], 10)

    async def single(i: int) -> None:
        await chancy.push(noop.job.with_queue("bench").with_kwargs(i=i))

    async def bulk(n: int) -> None:
        base = noop.job.with_queue("bench")
        async for _ in chancy.push_many([base.with_kwargs(i=i) for i in range(n)],
                                        batch_size=n):
            pass

    result = await lib.timed_enqueue(single, bulk, p)
    await chancy.__aexit__(None, None, None)
    return result


async def _count(chancy: Any, n: int) -> bool:
    async with chancy.pool.connection() as conn, conn.cursor() as cur:
        await cur.execute("SELECT count(*) FROM chancy_jobs WHERE state = 'succeeded'")
        row = await cur.fetchone()
    return bool(row and row[0] >= n)


async def _drain(p: dict[str, Any], seconds: float, concurrency: int) -> dict[str, Any]:
    SLEEP["seconds"] = seconds
    chancy = await _chancy(p["dsn"], concurrency)
    base = noop.job.with_queue("bench")
    n = p["jobs"]
    async for _ in chancy.push_many([base for _ in range(n)], batch_size=10_000):
        pass

    async def done() -> bool:
        return await _count(chancy, n)

    async with Worker(chancy, register_signal_handlers=False):
        await lib.wait_until(done, 600)
    await chancy.__aexit__(None, None, None)
    return lib.span_rate(p["dsn"], SPAN)


async def w2(p: dict[str, Any]) -> dict[str, Any]:
    return await _drain(p, 0.0, p["concurrency"])


async def w4(p: dict[str, Any]) -> dict[str, Any]:
    return await _drain(p, p["seconds"], 8)


async def w3(p: dict[str, Any]) -> dict[str, Any]:
    chancy = await _chancy(p["dsn"], 10)
    async with Worker(chancy, register_signal_handlers=False):
        await asyncio.sleep(2.0)
        for _ in range(p["jobs"]):
            await chancy.push(latency.job.with_queue("bench").with_kwargs(t0=time.time()))
            await asyncio.sleep(0.02)

        async def all_seen() -> bool:
            return bool(len(SEEN) >= p["jobs"])

        await lib.wait_until(all_seen, 60)
    await chancy.__aexit__(None, None, None)
    return {**lib.percentiles(SEEN), "samples": SEEN}


if __name__ == "__main__":
    lib.main({"w1": w1, "w2": w2, "w3": w3, "w4": w4})
