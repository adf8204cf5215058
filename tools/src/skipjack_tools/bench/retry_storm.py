"""W7 retry storm: 1,000 jobs fail at once; where do their retries land?

A worker runs 1,000 jobs whose handler raises. Each failure schedules the next attempt with
the task's backoff; the bench then reads the retries' ``run_at`` from the table: the most
retries due in any one second, and the seconds from the first to the last. Cases: a fixed
60 s delay (no jitter), and skipjack's default backoff (base 1 s, cap 1 h, equal jitter) for
a failure of attempt 1 (delay 1-2 s) and of attempt 7 (delay 64-128 s).
"""

from __future__ import annotations

import asyncio
from typing import Any

from psycopg import sql

from skipjack.app import App
from skipjack.retry import Backoff

from .common import QUEUE, Settings, connect, fresh_app, quiet_job_failures
from .worker_run import run_worker

CASES: dict[str, tuple[Backoff, int]] = {
    "fixed_60s": (Backoff(base=60.0, cap=60.0, jitter=False), 1),
    "default_attempt_1": (Backoff(), 1),
    "default_attempt_7": (Backoff(), 7),
}


def _case(settings: Settings, backoff: Backoff, attempt: int, jobs: int) -> dict[str, Any]:
    with fresh_app(settings.dsn, "w7") as app:
        @app.task(name="bench.fail", queue=QUEUE, backoff=backoff)
        async def fail() -> None:
            raise RuntimeError("the downstream service is down")

        app.enqueue_many(fail.job() for _ in range(jobs))
        table = sql.Identifier(app.schema, "jobs")
        with connect(app.dsn) as conn:
            conn.execute(sql.SQL("UPDATE {} SET attempt = %s").format(table), [attempt - 1])

        async def until() -> None:
            while await asyncio.to_thread(_failed, app, attempt) < jobs:
                await asyncio.sleep(0.05)

        with quiet_job_failures():  # every job fails on purpose
            run_worker(app, concurrency=100, until=until, timeout=60 + jobs / 50)
        with connect(app.dsn) as conn:
            row = conn.execute(sql.SQL(
                "WITH r AS (SELECT run_at, (errors -> -1 ->> 'at')::timestamptz AS failed_at"
                "             FROM {t} WHERE state IN ('scheduled', 'available') AND attempt = %s)"
                "SELECT (SELECT max(n) FROM (SELECT count(*) AS n FROM r"
                "          GROUP BY floor(extract(epoch FROM run_at))) b),"
                "       extract(epoch FROM max(run_at) - min(run_at))::float8,"
                "       extract(epoch FROM max(failed_at) - min(failed_at))::float8,"
                "       extract(epoch FROM min(run_at - failed_at))::float8,"
                "       extract(epoch FROM max(run_at - failed_at))::float8 FROM r"
            ).format(t=table), [attempt]).fetchone()
    assert row is not None
    most, spread, failed_over, min_delay, max_delay = row
    return {"failed_attempt": attempt, "retries": jobs, "max_retries_in_one_second": most,
            "retries_spread_s": round(spread or 0, 2),
            "failures_spread_s": round(failed_over or 0, 2),
            "delay_min_s": round(min_delay or 0, 2), "delay_max_s": round(max_delay or 0, 2)}


def _failed(app: App, attempt: int) -> int:
    with connect(app.dsn) as conn:
        row = conn.execute(sql.SQL(
            "SELECT count(*) FROM {} "
            "WHERE state IN ('scheduled', 'available') AND attempt = %s").format(
                sql.Identifier(app.schema, "jobs")), [attempt]).fetchone()
    return int(row[0]) if row else 0


def run(settings: Settings) -> dict[str, Any]:
    """W7 for every case (single runs)."""
    jobs = settings.n(1000, minimum=100)
    out: dict[str, Any] = {"jobs": jobs, "cases": {}}
    for name, (backoff, attempt) in CASES.items():
        settings.log(f"W7 retry storm: {jobs} failures, {name}")
        out["cases"][name] = _case(settings, backoff, attempt, jobs)
    return out
