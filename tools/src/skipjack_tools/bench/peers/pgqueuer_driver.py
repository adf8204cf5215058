"""pgqueuer through its public API (asyncpg driver), for ``skipjack bench --compare``.

Configuration: the asyncpg driver (pgqueuer's primary one), ``QueueManager.run`` with
``batch_size=10`` (its default and the documented knob for throughput), drain mode for W2 and
W4; W4 caps the worker at 8 jobs in flight with ``max_concurrent_tasks=8`` (which needs a
batch of at most 4). Drain times come from pgqueuer's own log table (first ``picked`` to last
``successful``).
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import asyncpg  # type: ignore[import-not-found]
from pgqueuer import AsyncpgDriver, Queries, QueueManager  # type: ignore[import-not-found]
from pgqueuer.types import QueueExecutionMode  # type: ignore[import-not-found]
from psycopg.conninfo import conninfo_to_dict

if TYPE_CHECKING:
    from . import _driverlib as lib
else:
    import _driverlib as lib

SPAN = """
SELECT count(*) FILTER (WHERE status = 'successful'),
       extract(epoch FROM max(created) FILTER (WHERE status = 'successful')
                        - min(created) FILTER (WHERE status = 'picked'))::float8
  FROM pgqueuer_log
"""


async def _queries(dsn: str, install: bool = False) -> Any:
    params = conninfo_to_dict(dsn)
    conn = await asyncpg.connect(
        host=params.get("host"), port=params.get("port"), user=params.get("user"),
        password=params.get("password"), database=params.get("dbname"))
    queries = Queries(AsyncpgDriver(conn))
    if install:
        await queries.install()
    return queries


async def w1(p: dict[str, Any]) -> dict[str, Any]:
    q = await _queries(p["dsn"], install=True)

    async def single(i: int) -> None:
        await q.enqueue("noop", str(i).encode())

    async def bulk(n: int) -> None:
        await q.enqueue(["noop"] * n, [str(i).encode() for i in range(n)], [0] * n)

    return await lib.timed_enqueue(single, bulk, p)


async def _drain(p: dict[str, Any], seconds: float, batch: int, cap: int | None
                 ) -> dict[str, Any]:
    q = await _queries(p["dsn"], install=True)
    n = p["jobs"]
    await q.enqueue(["work"] * n, [b"" for _ in range(n)], [0] * n)
    qm = QueueManager(await _queries(p["dsn"]))

    async def work(job: Any) -> None:
        if seconds:
            await asyncio.sleep(seconds)

    qm.entrypoint("work")(work)

    await asyncio.wait_for(qm.run(batch_size=batch, max_concurrent_tasks=cap,
                                  mode=QueueExecutionMode.drain,
                                  dequeue_timeout=timedelta(seconds=1)), 600)
    return lib.span_rate(p["dsn"], SPAN)


async def w2(p: dict[str, Any]) -> dict[str, Any]:
    return await _drain(p, 0.0, batch=10, cap=None)


async def w4(p: dict[str, Any]) -> dict[str, Any]:
    return await _drain(p, p["seconds"], batch=4, cap=8)


async def w3(p: dict[str, Any]) -> dict[str, Any]:
    producer = await _queries(p["dsn"], install=True)
    qm = QueueManager(await _queries(p["dsn"]))
    seen: list[float] = []

    async def latency(job: Any) -> None:
        seen.append((time.time() - float(job.payload.decode())) * 1000)

    qm.entrypoint("latency")(latency)

    running = asyncio.create_task(qm.run(batch_size=10))
    await asyncio.sleep(1.0)
    for _ in range(p["jobs"]):
        await producer.enqueue("latency", repr(time.time()).encode())
        await asyncio.sleep(0.02)

    async def all_seen() -> bool:
        return bool(len(seen) >= p["jobs"])

    await lib.wait_until(all_seen, 30)
    qm.shutdown.set()
    await asyncio.wait_for(running, 30)
    return {**lib.percentiles(seen), "samples": seen}


if __name__ == "__main__":
    lib.main({"w1": w1, "w2": w2, "w3": w3, "w4": w4})
