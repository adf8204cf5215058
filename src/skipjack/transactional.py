"""Handlers whose database writes commit together with their job's completion.

For a task declared with ``transaction="complete"``, the worker opens a transaction, exposes
its connection as ``current_job().conn``, runs the handler, then writes the fenced completion
in the same transaction and commits. If the completion matches no row (the job was rescued or
re-claimed meanwhile), everything rolls back: the handler's rows never become visible. So an
effect table keyed by job id never sees a duplicate, whatever workers crash or stall. If the
handler raises, its writes roll back and the attempt is recorded as failed.

The handler must not commit or roll back that connection itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from .completer import Outcome, outcome_params
from .context import JobContext
from .jobs import dump_result
from .queries import Queries


def _params(ctx: JobContext, result: Any) -> dict[str, str]:
    job = ctx.job
    return outcome_params([Outcome(job.id, job.lease_version, job.queue, "complete",
                                   result=dump_result(result))])


def run_sync(conn: psycopg.Connection[Any], queries: Queries, ctx: JobContext,
             fn: Callable[..., Any], args: dict[str, Any],
             finishing: Callable[[], None]) -> bool:
    """Run a sync handler and its fenced completion in one transaction on ``conn``.

    ``finishing`` is called once the handler returned, before the completion is written
    (the heartbeat then stops treating a vanished lease as lost).

    Returns:
        True if the completion committed; False if it was stale (all rolled back).

    Raises:
        Exception: whatever the handler raised (its writes rolled back), or a database error.
    """
    applied = False
    with conn.transaction():
        ctx.conn = conn
        try:
            result = fn(**args)
        finally:
            ctx.conn = None
        finishing()
        applied = bool(conn.execute(queries.RECORD_OUTCOMES, _params(ctx, result)).fetchall())
        if not applied:
            raise psycopg.Rollback()
    return applied


async def run_async(conn: psycopg.AsyncConnection[Any], queries: Queries, ctx: JobContext,
                    fn: Callable[..., Any], args: dict[str, Any],
                    finishing: Callable[[], None]) -> bool:
    """Async :func:`run_sync`."""
    applied = False
    async with conn.transaction():
        ctx.conn = conn
        try:
            result = await fn(**args)
        finally:
            ctx.conn = None
        finishing()
        cur = await conn.execute(queries.RECORD_OUTCOMES, _params(ctx, result))
        applied = bool(await cur.fetchall())
        if not applied:
            raise psycopg.Rollback()
    return applied
