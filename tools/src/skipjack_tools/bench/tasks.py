"""Tasks for benchmark worker processes: ``skipjack worker skipjack_tools.bench.tasks:app``.

The schema comes from ``$SKIPJACK_SCHEMA`` (the bench sets it for each child process).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from skipjack.app import App, Task

app = App(schema=os.environ.get("SKIPJACK_SCHEMA", "skipjack"))


def register(target: App) -> dict[str, Task]:
    """Register the benchmark tasks on ``target``; returns them by short name."""

    @target.task(name="bench.noop", queue="bench")
    async def noop(**_: Any) -> None:
        """Does nothing: the queue's own cost per job."""

    @target.task(name="bench.sleep", queue="bench")
    async def sleep(seconds: float = 0.002, **_: Any) -> None:
        """Waits ``seconds`` without holding a thread (the 2 ms job of W4, docs/performance.md)."""
        await asyncio.sleep(seconds)

    return {"noop": noop, "sleep": sleep}


TASKS = register(app)
