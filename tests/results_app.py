"""Tasks for the tests of results and progress (``results_app:app``), run by real worker
processes. The schema and DSN come from SKIPJACK_SCHEMA and SKIPJACK_DATABASE_URL."""

from __future__ import annotations

import os
import time

from psycopg import sql

from skipjack import App, Backoff, current_job

app = App(schema=os.environ.get("SKIPJACK_SCHEMA", "skipjack"))


@app.task(name="add")
def add(a: int, b: int) -> dict[str, int]:
    return {"sum": a + b}


@app.task(name="add_async")
async def add_async(a: int, b: int) -> int:
    return a + b


@app.task(name="boom", max_attempts=1)
def boom(message: str) -> None:
    raise ValueError(message)


@app.task(name="stepwise")
def stepwise(gate: str) -> str:
    """Report one step, wait (up to a minute) until the test opens the gate (a row in the
    schema's gates table), then report the second step."""
    ctx = current_job()
    ctx.progress({"done": 1, "total": 2})
    _wait_for(gate)
    ctx.progress({"done": 2, "total": 2})
    return "through"


def _wait_for(gate: str) -> None:
    """Wait (up to a minute) until the test opens ``gate``: a row in the gates table."""
    statement = sql.SQL("SELECT 1 FROM {}.gates WHERE name = %s").format(
        sql.Identifier(app.schema))
    deadline = time.monotonic() + 60
    with app.connect() as conn:
        while conn.execute(statement, (gate,)).fetchone() is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the gate never opened")
            time.sleep(0.02)


@app.task(name="held_until", transaction="claim", lease=30.0)
def held_until(gate: str) -> str:
    """A claim-mode job (its row locked while it runs) that waits for its gate."""
    started = sql.SQL("INSERT INTO {}.gates VALUES (%s)").format(sql.Identifier(app.schema))
    with app.connect() as conn:
        conn.execute(started, (gate + ":started",))
    _wait_for(gate)
    return "released"


@app.task(name="flaky_once", max_attempts=3, backoff=Backoff(base=0.05, cap=0.05))
def flaky_once() -> int:
    """Fails its first attempt; retried 50-100 ms later."""
    attempt = current_job().job.attempt
    if attempt == 1:
        raise RuntimeError("first attempt fails")
    return attempt


@app.task(name="reports_then_waits")
def reports_then_waits(mark: bool, gate: str) -> str:
    """Report progress ("step 1", after a check mark if ``mark``), then wait (up to a
    minute) for the gate."""
    current_job().progress(("\u2713 " if mark else "") + "step 1")
    _wait_for(gate)
    return "waited"


@app.task(name="echo")
def echo(value: object) -> object:
    return value
