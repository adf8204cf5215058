"""procrastinate through its public API, for ``skipjack bench --compare``.

Configuration: ``PsycopgConnector`` (its async connector), async tasks, a worker with
``concurrency`` = the scenario's, ``wait=False`` to stop once the queue is drained, LISTEN/NOTIFY
on (its default) and a 1 s polling fallback. Drain times come from procrastinate's own events
table (first ``started`` to last ``succeeded``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import procrastinate  # type: ignore[import-not-found]

if TYPE_CHECKING:
    from . import _driverlib as lib
else:
    import _driverlib as lib

SPAN = """
SELECT count(*) FILTER (WHERE type = 'succeeded'),
       extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded')
                        - min(at) FILTER (WHERE type = 'started'))::float8
  FROM procrastinate_events
"""


def _app(dsn: str) -> Any:
    logging.getLogger("procrastinate").setLevel(logging.WARNING)
    return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))


async def w1(p: dict[str, Any]) -> dict[str, Any]:
    app = _app(p["dsn"])

    async def _noop(i: int) -> None:
        pass

    noop = app.task(name="noop")(_noop)

    async with app.open_async():
        await app.schema_manager.apply_schema_async()

        async def single(i: int) -> None:
            await noop.defer_async(i=i)

        async def bulk(n: int) -> None:
            await noop.batch_defer_async(*({"i": i} for i in range(n)))

        return await lib.timed_enqueue(single, bulk, p)


async def _drain(p: dict[str, Any], seconds: float, concurrency: int) -> dict[str, Any]:
    app = _app(p["dsn"])

    async def _work() -> None:
        if seconds:
            await asyncio.sleep(seconds)

    work = app.task(name="work")(_work)

    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        n = p["jobs"]
        for start in range(0, n, 10_000):
            await work.batch_defer_async(*({} for _ in range(min(10_000, n - start))))
        await asyncio.wait_for(app.run_worker_async(
            concurrency=concurrency, wait=False, install_signal_handlers=False,
            fetch_job_polling_interval=1.0), 600)
    return lib.span_rate(p["dsn"], SPAN)


async def w2(p: dict[str, Any]) -> dict[str, Any]:
    return await _drain(p, 0.0, p["concurrency"])


async def w4(p: dict[str, Any]) -> dict[str, Any]:
    return await _drain(p, p["seconds"], 8)


async def w3(p: dict[str, Any]) -> dict[str, Any]:
    app = _app(p["dsn"])
    seen: list[float] = []

    async def _latency(t0: float) -> None:
        seen.append((time.time() - t0) * 1000)

    latency = app.task(name="latency")(_latency)

    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        running = asyncio.create_task(app.run_worker_async(
            concurrency=10, install_signal_handlers=False, fetch_job_polling_interval=1.0))
        await asyncio.sleep(1.0)
        for _ in range(p["jobs"]):
            await latency.defer_async(t0=time.time())
            await asyncio.sleep(0.02)

        async def all_seen() -> bool:
            return bool(len(seen) >= p["jobs"])

        await lib.wait_until(all_seen, 30)
        running.cancel()
        try:
            await asyncio.wait_for(running, 30)
        except asyncio.CancelledError:
            pass
    return {**lib.percentiles(seen), "samples": seen}


if __name__ == "__main__":
    lib.main({"w1": w1, "w2": w2, "w3": w3, "w4": w4})
