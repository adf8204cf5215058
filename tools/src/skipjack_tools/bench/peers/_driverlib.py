"""Helpers shared by the peer drivers (which run in the peers' virtualenvs, without skipjack).

A driver is started as ``python NAME_driver.py '<json>'`` where the JSON object holds
``scenario`` (w1..w4), ``dsn`` (a fresh database of its own) and the scenario's sizes. It
prints one line ``BENCH-RESULT <json>`` with its figures; anything else it prints is ignored.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import psycopg

Scenario = Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]
MARK = "BENCH-RESULT "


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """Nearest-rank p50/p95/p99 and max, rounded to 3 decimals."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))], 3)

    return {"p50": at(50), "p95": at(95), "p99": at(99), "max": round(ordered[-1], 3)}


def query_one(dsn: str, statement: str) -> tuple[Any, ...]:
    """One row of one statement, on a fresh autocommit connection."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(statement.encode()).fetchone()
    return tuple(row) if row else ()


def span_rate(dsn: str, statement: str) -> dict[str, Any]:
    """``statement`` returns (jobs, seconds from first start to last completion)."""
    jobs, seconds = query_one(dsn, statement)
    return {"jobs_per_s": round(jobs / seconds, 1) if seconds else None, "jobs": jobs,
            "seconds": round(seconds or 0, 3)}


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout: float) -> None:
    """Await ``condition`` every 50 ms until true; raise TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"peer benchmark timed out after {timeout:.0f}s")
        await asyncio.sleep(0.05)


async def timed_enqueue(single: Callable[[int], Awaitable[Any]],
                        bulk: Callable[[int], Awaitable[Any]], params: dict[str, Any]
                        ) -> dict[str, Any]:
    """W1: ``single(i)`` n times, then ``bulk(n)`` ``params["bulk_calls"]`` times; jobs
    per second of the singles, and the median of the bulk calls' (and each of them)."""
    await single(-1)  # connection set-up is not part of the measure
    n = params["single"]
    started = time.perf_counter()
    for i in range(n):
        await single(i)
    single_s = time.perf_counter() - started
    calls = []
    for _ in range(params["bulk_calls"]):
        started = time.perf_counter()
        await bulk(params["bulk"])
        calls.append(round(params["bulk"] / (time.perf_counter() - started), 1))
    return {"single_jobs_per_s": round(n / single_s, 1),
            "bulk_jobs_per_s": round(statistics.median(calls), 1), "bulk_calls": calls}


def main(scenarios: dict[str, Scenario]) -> None:
    """Run the scenario named in ``argv[1]`` and print its result line."""
    params: dict[str, Any] = json.loads(sys.argv[1])
    result = asyncio.run(scenarios[params["scenario"]](params))
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
