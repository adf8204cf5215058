"""A worker inside a Starlette or FastAPI application's process, for small deployments: it
starts with the application's lifespan and stops with it (a SIGTERM to uvicorn stops both,
the worker gracefully)::

    from fastapi import FastAPI
    from skipjack.contrib.starlette import lifespan

    api = FastAPI(lifespan=lifespan(jobs, queues=["default"], concurrency=4))

or, beside other startup work::

    @asynccontextmanager
    async def app_lifespan(api):
        async with running_worker(jobs, concurrency=4):
            yield

The worker shares the server's event loop: ``async def`` handlers run beside the requests
(keep them short, or give sync handlers the heavy work: those run in the worker's threads).
Run workers in processes of their own (``skipjack worker``) once the jobs matter more than
the requests. Only Starlette's lifespan protocol is used: this module imports no framework.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from ..app import App
from ..runtime.worker import Worker

log = logging.getLogger("skipjack.worker")


@asynccontextmanager
async def running_worker(app: App, queues: Sequence[str] = ("default",), *,
                         migrate: bool = False, **options: Any) -> AsyncIterator[Worker]:
    """Run a ``skipjack.Worker`` of ``app`` on the running event loop for the block; at
    its end, stop it gracefully (running jobs get ``shutdown_grace`` seconds, the rest are
    released to other workers).

    Args:
        app: the app whose tasks run.
        queues: the queues to serve.
        migrate: migrate the schema first (else a schema that is not migrated raises).
        options: further ``skipjack.Worker`` settings (concurrency, lease, ...).

    Yields:
        The worker (its ``stats`` and ``status()`` can back a health endpoint).

    Raises:
        ConfigError: a setting out of range (before the block).
        SchemaVersionError: the schema is not migrated (before the block).
    """
    worker = Worker(app, list(queues), **options)
    if migrate:
        await asyncio.to_thread(app.migrate)
    await asyncio.to_thread(app.check_schema)  # fail the startup, not a background task
    task = asyncio.create_task(worker.run_async(), name="skipjack-worker")
    task.add_done_callback(_report_failure)
    try:
        yield worker
    finally:
        worker.stop()
        await task


def _report_failure(task: asyncio.Task[None]) -> None:
    """Log a worker that ended on its own with an error (the application runs on)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the in-process worker stopped: %r", task.exception(),
                  exc_info=task.exception())


def lifespan(app: App, queues: Sequence[str] = ("default",), **options: Any
             ) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """A lifespan for ``Starlette(lifespan=...)`` or ``FastAPI(lifespan=...)`` that runs a
    worker of ``app`` (see ``running_worker`` for the arguments)."""

    @asynccontextmanager
    async def run(_server_app: Any) -> AsyncIterator[None]:
        async with running_worker(app, queues, **options):
            yield

    return run
