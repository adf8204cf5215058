"""Helpers for an application's tests, against a real PostgreSQL (the embedded server by
default).

- ``drain``: run the jobs waiting in the database in the test process, with a real
  worker, until none is runnable; then assert on their outcome.
- ``inline``: while active, an enqueue runs its handler at once in the caller's thread
  (no database, no retry: its exception reaches the caller), as an eager mode.
- ``enqueued`` and ``assert_enqueued``: what was enqueued, read from the database.
- ``app_fixture``: a pytest fixture giving each test the app on a fresh schema
  (``fresh_schema``), dropped afterwards.

For example, in a ``conftest.py``::

    from skipjack.testing import app_fixture
    from myproject.jobs import app

    jobs_app = app_fixture(app)

and in a test::

    def test_signup_sends_mail(jobs_app):
        signup("ada@example.com")
        assert_enqueued(jobs_app, "send_welcome", email="ada@example.com")
        assert drain(jobs_app) == {"succeeded": 1}
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import itertools
import json
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import psycopg

from .app import App
from .context import Job, JobContext, set_current
from .db import Database
from .errors import ValidationError
from .jobs import JobSpec
from .runtime.worker import Worker


def drain(app: App, queues: Iterable[str] | None = None, *, timeout: float = 60.0,
          concurrency: int = 1, scheduled_within: float = 5.0) -> dict[str, int]:
    """Run jobs with a real worker in this process until no job of ``queues`` is runnable:
    waiting, running, or scheduled to run within ``scheduled_within`` seconds (so that
    retries with short delays run too); jobs scheduled later stay scheduled. Jobs enqueued in
    a transaction still open are not seen: commit first.

    Args:
        app: the app whose tasks run.
        queues: the queues to run (default: every queue of the app's tasks, and
            ``default``).
        timeout: seconds after which ``TimeoutError`` is raised, once the worker
            stopped (running jobs get a second, then are released).
        concurrency: jobs run at once (1: one after the other, in enqueue order within a
            priority).
        scheduled_within: seconds ahead within which a scheduled job is waited for (5: the
            first retries of the default backoff).

    Returns:
        The count of every job of these queues by state, e.g. ``{"succeeded": 3}``.

    Raises:
        TimeoutError: jobs were still runnable after ``timeout`` seconds.
        SchemaVersionError: the schema is not migrated.
    """
    names = sorted(set(queues) if queues is not None
                   else {t.queue for t in app.tasks.values()} | {"default"})
    worker = Worker(app, names, concurrency=concurrency, poll_interval=0.05,
                    stage_interval=0.05, shutdown_grace=1.0, name=f"drain:{secrets.token_hex(3)}")
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(worker.run_async())
        except BaseException as exc:  # reported to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="skipjack-drain", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while _runnable(app, names, scheduled_within):
            if failure:
                raise failure[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs of {names} were still runnable after {timeout}s")
            time.sleep(0.02)
    finally:
        worker.stop()
        thread.join(60)  # the grace, then the release of what still runs
    if failure:
        raise failure[0]
    return _states(app, names)


def _runnable(app: App, queues: list[str], within: float) -> int:
    with app.reading() as conn:
        row = conn.execute(app.queries.RUNNABLE_NOW,
                           {"queues": queues, "within": within}).fetchone()
    return int(row[0]) if row else 0


def _states(app: App, queues: list[str]) -> dict[str, int]:
    with app.reading() as conn:
        rows = conn.execute(app.queries.STATES_IN_QUEUES, {"queues": queues}).fetchall()
    return {state: int(n) for state, n in rows}


def enqueued(app: App, task: str | None = None, *, conn: Any = None,
             limit: int = 10_000) -> list[dict[str, Any]]:
    """The jobs of ``task`` (a task name; None: every task), oldest first, as dicts with id,
    queue, task, args, state, priority, run_at, idempotency_key and max_attempts.

    Args:
        conn: read in this connection's transaction (any kind ``enqueue`` accepts), to see
            jobs it enqueued and has not committed; None: a connection of the app's.
        limit: at most this many jobs.
    """
    params = {"task": task, "limit": limit}
    if conn is None:
        with app.reading() as own:
            rows = own.execute(app.queries.ENQUEUED, params).fetchall()
    else:
        from .connections import reading_cursor, sync_connection
        with reading_cursor(sync_connection(conn)) as cur:
            rows = cur.execute(app.queries.ENQUEUED, params).fetchall()
    keys = ("id", "queue", "task", "args", "state", "priority", "run_at", "idempotency_key",
            "max_attempts")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def assert_enqueued(app: App, task: str, *, count: int | None = None, conn: Any = None,
                    **args: Any) -> list[dict[str, Any]]:
    """Assert that jobs of ``task`` with these ``args`` (a subset of each job's args) were
    enqueued: at least one, or exactly ``count``. Returns the matching jobs.

    Raises:
        AssertionError: no such job (or not ``count`` of them); the message lists the jobs
            of the task that were enqueued.
    """
    jobs = enqueued(app, task, conn=conn)
    matching = [j for j in jobs if all(j["args"].get(k, _MISSING) == v for k, v in args.items())]
    if (count is None and not matching) or (count is not None and len(matching) != count):
        wanted = "a job" if count is None else f"{count} jobs"
        seen = [j["args"] for j in jobs[:20]]
        raise AssertionError(f"expected {wanted} of task {task!r} with args {args}, found "
                             f"{len(matching)}; the task's jobs have args {seen}"
                             + (" ..." if len(jobs) > 20 else ""))
    return matching


_MISSING = object()
_inline_ids = itertools.count(-1, -1)


@contextmanager
def inline(app: App) -> Iterator[list[tuple[JobSpec, Any]]]:
    """While the block runs, ``enqueue`` and ``enqueue_many`` on ``app`` (sync and async)
    run each job's handler at once, in the caller's thread, instead of writing it: nothing
    reaches the database, nothing is retried, and what a handler raises reaches the
    enqueuer. The args still go through JSON, as they would in the database, and
    ``current_job()`` works (ids are negative; attempt 1). Async handlers run to completion
    on a private event loop (the sync forms) or on the caller's (the async forms).

    Yields:
        A list that gets each (job spec, handler's return value), in run order.

    Raises:
        ValidationError: (at enqueue) a job of a task ``app`` does not have.
    """
    ran: list[tuple[JobSpec, Any]] = []
    original = app.enqueue_many, app.enqueue_many_async

    def prepared(spec: JobSpec) -> tuple[Callable[..., Any], dict[str, Any], JobContext]:
        task = app.tasks.get(spec.task)
        if task is None:
            raise ValidationError("task", f"{spec.task!r} is not a task of this app")
        now = datetime.now(UTC)
        job = Job(next(_inline_ids), spec.queue, spec.task, json.loads(spec.args_json),
                  spec.priority, 1, spec.max_attempts, 0, now, now, now, spec.idempotency_key,
                  spec.lease or 30.0)
        return task.fn, json.loads(spec.args_json), JobContext(job)

    def run_many(jobs: Iterable[JobSpec], *, conn: object | None = None) -> list[int]:
        ids = []
        for spec in jobs:
            fn, args, ctx = prepared(spec)
            # in a context of its own: current_job() is this job's inside, and nothing
            # of it is left once it returns (an enqueue inside a handler nests)
            value = contextvars.copy_context().run(_call, ctx, fn, args)
            if asyncio.iscoroutine(value):
                value = _run_coroutine(ctx, value)
            ran.append((spec, value))
            ids.append(ctx.job.id)
        return ids

    async def run_many_async(jobs: Iterable[JobSpec], *,
                             conn: object | None = None) -> list[int]:
        ids = []
        for spec in jobs:
            fn, args, ctx = prepared(spec)
            value = contextvars.copy_context().run(_call, ctx, fn, args)
            if asyncio.iscoroutine(value):
                value = await asyncio.create_task(value, context=_context_of(ctx))
            ran.append((spec, value))
            ids.append(ctx.job.id)
        return ids

    app.enqueue_many = run_many  # type: ignore[method-assign]
    app.enqueue_many_async = run_many_async  # type: ignore[method-assign]
    try:
        yield ran
    finally:
        app.enqueue_many, app.enqueue_many_async = original  # type: ignore[method-assign]


def _call(ctx: JobContext, fn: Callable[..., Any], args: dict[str, Any]) -> Any:
    set_current(ctx)
    return fn(**args)


def _context_of(ctx: JobContext) -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(set_current, ctx)
    return context


def _run_coroutine(ctx: JobContext, coroutine: Any) -> Any:
    """Run an async handler's coroutine to its end from sync code, on an event loop of its
    own: in a thread when this one already runs a loop."""
    async def run() -> Any:
        set_current(ctx)
        return await coroutine

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()


@contextmanager
def fresh_schema(app: App) -> Iterator[App]:
    """Point ``app`` (its tasks and cron entries unchanged) at a new, migrated schema on its
    database for the block, then drop that schema and point it back. The database is the
    app's: ``$SKIPJACK_DATABASE_URL``, ``$DATABASE_URL``, else the embedded server.

    Yields:
        ``app`` itself.
    """
    old_db, old_schema = app.db, app.schema
    name = "test_" + secrets.token_hex(6)
    app.close()
    app.db = Database(old_db.dsn, name, prepare="prepare_threshold" not in old_db.connect_kwargs)
    app.schema = name
    try:
        app.migrate()
        yield app
    finally:
        app.close()
        try:
            _drop_schema(app, name)
        finally:
            app.db, app.schema = old_db, old_schema


def _drop_schema(app: App, name: str) -> None:
    """Drop a test's schema. A session of the test's that holds a lock on it (a
    transaction left open) would make the drop wait forever: after 5 s such sessions are
    ended (the schema was the test's alone), and the drop goes on."""
    drop = app.queries.DROP_SCHEMA  # app.queries is the test schema's here
    with app.connect() as conn:
        try:
            with conn.transaction():
                conn.execute(app.queries.SET_LOCK_TIMEOUT, {"timeout": "5s"})
                conn.execute(drop)
            return
        except psycopg.errors.LockNotAvailable:
            pass
        ended = conn.execute(app.queries.END_SCHEMA_SESSIONS, {"schema": name}).fetchall()
        warnings.warn(f"skipjack.testing: ended {len(ended)} session(s) that held locks on "
                      f"the test schema {name!r} (a transaction the test left open)",
                      stacklevel=3)
        conn.execute(drop)


def app_fixture(app: App) -> Any:
    """A pytest fixture (function scope) that gives each test ``app`` on a fresh schema
    (see ``fresh_schema``); assign it to a name in a ``conftest.py``, which becomes the
    fixture's name.

    Raises:
        ModuleNotFoundError: pytest is not installed.
    """
    import pytest

    def fixture() -> Iterator[App]:
        with fresh_schema(app) as fresh:
            yield fresh

    return pytest.fixture(fixture)


__all__ = ["app_fixture", "assert_enqueued", "drain", "enqueued", "fresh_schema",
           "inline"]
