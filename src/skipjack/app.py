"""The application object: configuration, the task registry and enqueue (sync and async)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import chain
from operator import attrgetter
from typing import Any, overload

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from . import embedded
from .control import Control
from .cron import CronEntry, CronSchedule
from .errors import DuplicateJobError, ValidationError
from .jobs import (
    DEFAULT_MAX_ARGS_BYTES,
    QUEUE_MAX_BYTES,
    TASK_MAX_BYTES,
    JobSpec,
    check_delay,
    check_idempotency_key,
    check_lease,
    check_max_attempts,
    check_name,
    check_priority,
    check_run_at,
    check_timeout,
    check_transaction,
    serialize_args,
    unique_states_mask,
)
from .migrate import check_schema, migrate
from .queries import Queries, number_array, text_array
from .retry import Backoff

# Keepalives let an idle TCP connection that silently died (no RST) fail within about 25 s;
# tcp_user_timeout does the same for one with unacknowledged data in flight.
CONNECT_KWARGS: dict[str, Any] = {
    "connect_timeout": 10,
    "tcp_user_timeout": 30_000,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "application_name": os.environ.get("SKIPJACK_APPLICATION_NAME", "skipjack"),
}

_SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def resolve_dsn(dsn: str | None = None) -> str:
    """The DSN to use: ``dsn`` if given, else ``$SKIPJACK_DATABASE_URL``, else
    ``$DATABASE_URL``, else the embedded server (started on demand)."""
    return (dsn or os.environ.get("SKIPJACK_DATABASE_URL") or os.environ.get("DATABASE_URL")
            or embedded.dsn())


@dataclass(frozen=True)
class Task:
    """A registered task: a function plus its default job options.

    Create tasks with :meth:`App.task`; call :meth:`configure` for per-call options. Calling
    the task object calls the function directly (no queue involved).
    """

    app: App
    fn: Callable[..., Any]
    name: str
    queue: str = "default"
    priority: int = 0
    max_attempts: int = 25
    backoff: Backoff = field(default_factory=Backoff)
    run_at: datetime | None = None
    delay: float | None = None
    idempotency_key: str | None = None
    lease: float | None = None
    transaction: str = "none"
    timeout: float | None = None
    unique_states: int = 63

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @functools.cached_property
    def is_async(self) -> bool:
        """Whether the function is ``async def`` (run on the worker's event loop)."""
        return inspect.iscoroutinefunction(self.fn)

    def configure(
        self,
        *,
        queue: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        idempotency_key: str | None = None,
        unique_while: Iterable[str] | None = None,
        lease: float | None = None,
    ) -> Task:
        """A copy of this task with other options for the jobs it makes.

        Args:
            queue: queue name (1-63 bytes).
            priority: -100..100, higher runs first.
            max_attempts: 1..10,000.
            run_at: aware datetime at which the job becomes runnable (UTC stored).
            delay: seconds (or timedelta) from the database's ``now()`` at enqueue.
            idempotency_key: at most one job per key exists in the ``unique_while`` states;
                enqueueing the key again returns the existing job's id (it never changes
                that job, running or not).
            unique_while: the states in which the key is held, e.g.
                ``("scheduled", "available", "running")`` to allow a new job once the previous
                one finished; default every state (one job per key, ever).
            lease: seconds this job's claim lasts without renewal, instead of the worker's;
                a crashed worker's job is rescued this long after its last heartbeat.

        Raises:
            ValidationError: any option out of its range (see :mod:`skipjack.jobs`).
        """
        changes: dict[str, Any] = {}
        if queue is not None:
            changes["queue"] = check_name("queue", queue, QUEUE_MAX_BYTES)
        if priority is not None:
            changes["priority"] = check_priority(priority)
        if max_attempts is not None:
            changes["max_attempts"] = check_max_attempts(max_attempts)
        if run_at is not None:
            changes["run_at"] = check_run_at(run_at)
        if delay is not None:
            changes["delay"] = check_delay(delay)
        if idempotency_key is not None:
            changes["idempotency_key"] = check_idempotency_key(idempotency_key)
        if lease is not None:
            changes["lease"] = check_lease(lease)
        if unique_while is not None:
            changes["unique_states"] = unique_states_mask(unique_while)
        if changes.get("run_at") is not None and changes.get("delay") is not None:
            raise ValidationError("run_at", "give run_at or delay, not both")
        return dataclasses.replace(self, **changes)

    def job(self, **kwargs: Any) -> JobSpec:
        """A validated job for this task with ``kwargs`` as its arguments (not yet enqueued).

        Raises:
            ValidationError: the arguments break a rule of :mod:`skipjack.jobs`.
        """
        # positional, in JobSpec's field order: a third cheaper than keywords per job
        return JobSpec(self.queue, self.name, serialize_args(kwargs, self.app.max_args_bytes),
                       self.priority, self.max_attempts, self.run_at, self.delay,
                       self.idempotency_key, self.lease, self.unique_states)

    def enqueue(self, **kwargs: Any) -> int:
        """Enqueue one job on the app's own connection (committed at once); returns its id."""
        return self.app.enqueue(self.job(**kwargs))

    async def enqueue_async(self, **kwargs: Any) -> int:
        """Async :meth:`enqueue`."""
        return await self.app.enqueue_async(self.job(**kwargs))


class App(Control):
    """A skipjack application: where the jobs live, which tasks exist, which run on a cron.

    The operating methods (``stats``, ``cancel``, ``pause_queue``, ``prune``, ...) are
    documented in :class:`skipjack.control.Control`.

    Args:
        dsn: a libpq connection string or URI. None: ``$SKIPJACK_DATABASE_URL``, then
            ``$DATABASE_URL``, then the embedded PostgreSQL server.
        schema: the schema holding skipjack's tables (lower-case identifier, <= 63 bytes).
            None: ``$SKIPJACK_SCHEMA``, else ``skipjack``.
        max_args_bytes: the limit on serialised job args, in bytes (<= 255 MiB, jsonb's own
            limit is about 255 MB).
        prepare: let psycopg prepare statements it runs often (the default). Set False when
            enqueueing through a transaction-mode pooler that cannot keep prepared
            statements (PgBouncer before 1.21).
        pool_size: the most connections the app's own pool opens (sync and async each) for
            enqueues without ``conn``; 1..1,000. A call waits up to 30 s for a free one,
            then raises ``psycopg_pool.PoolTimeout``: give as many as the threads (or tasks)
            that enqueue at once.

    Raises:
        ValidationError: bad schema name, size limit or pool size.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str | None = None,
        max_args_bytes: int = DEFAULT_MAX_ARGS_BYTES,
        prepare: bool = True,
        pool_size: int = 4,
    ) -> None:
        schema = schema or os.environ.get("SKIPJACK_SCHEMA") or "skipjack"
        if not isinstance(schema, str) or not _SCHEMA_RE.fullmatch(schema):
            raise ValidationError(
                "schema", f"{schema!r} must match [a-z_][a-z0-9_]* and be at most 63 bytes"
            )
        if not 1 <= max_args_bytes <= 255 * 1024 * 1024:
            raise ValidationError("max_args_bytes", "must be 1..267,386,880 bytes (255 MiB)")
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) \
                or not 1 <= pool_size <= 1000:
            raise ValidationError("pool_size", f"must be an int in 1..1000, got {pool_size!r}")
        self.pool_size = pool_size
        self._dsn = dsn
        self.schema = schema
        self.max_args_bytes = max_args_bytes
        self.queries = Queries(schema)
        self.connect_kwargs: dict[str, Any] = {**CONNECT_KWARGS, "autocommit": True}
        if not prepare:
            self.connect_kwargs["prepare_threshold"] = None
        self.tasks: dict[str, Task] = {}
        self.crons: dict[str, CronEntry] = {}
        self._lock = threading.Lock()
        self._pool: ConnectionPool[psycopg.Connection[Any]] | None = None
        self._apool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None

    # --- configuration -------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        """The resolved connection string (starts the embedded server when it is the one)."""
        with self._lock:
            if self._dsn is None:
                self._dsn = resolve_dsn()
            return self._dsn

    @overload
    def task(self, fn: Callable[..., Any], /) -> Task: ...

    @overload
    def task(
        self,
        fn: None = None,
        /,
        *,
        name: str | None = None,
        queue: str = "default",
        priority: int = 0,
        max_attempts: int = 25,
        backoff: Backoff | None = None,
        lease: float | None = None,
        transaction: str = "none",
        timeout: float | None = None,
    ) -> Callable[[Callable[..., Any]], Task]: ...

    def task(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        queue: str = "default",
        priority: int = 0,
        max_attempts: int = 25,
        backoff: Backoff | None = None,
        lease: float | None = None,
        transaction: str = "none",
        timeout: float | None = None,
    ) -> Task | Callable[[Callable[..., Any]], Task]:
        """Register a function as a task; usable bare (``@app.task``) or with options.

        Args:
            fn: the handler, sync or ``async def``; it is called with the job's args as
                keyword arguments.
            name: the task name stored with each job (default ``module.qualname``).
            queue, priority, max_attempts: defaults for this task's jobs (see
                :meth:`Task.configure` for the ranges).
            backoff: retry delay policy (default :class:`skipjack.retry.Backoff()`).
            lease: seconds a claim of this task's jobs lasts (default: the worker's lease);
                it must be more than twice the worker's heartbeat interval.
            transaction: what the handler's database transaction spans.
                ``"none"`` (default): the handler runs outside any transaction and the
                outcome is recorded afterwards. ``"complete"``: ``current_job().conn`` is a
                connection in a transaction that also records the fenced completion, so
                the handler's writes commit exactly once (see :mod:`skipjack.transactional`).
                ``"claim"``: the articles' first design; the job is claimed in a transaction
                that stays open while the handler runs (sync handlers only) and commits with
                the outcome. No lease or rescue is involved: if the worker dies, PostgreSQL
                rolls back and the job is available again. The handler must finish within
                its lease: the session's ``idle_in_transaction_session_timeout`` is set to
                it, so a stalled worker's transaction is ended by the server.
            timeout: seconds an attempt may run; past it the attempt fails (and is retried
                per policy). Async handlers are cancelled; a sync handler's thread cannot be
                stopped, so it is told through ``current_job().cancelled`` and its eventual
                result is ignored.

        Raises:
            ValidationError: bad option, or the name is taken by another function.
        """

        def register(f: Callable[..., Any]) -> Task:
            if transaction == "claim" and inspect.iscoroutinefunction(f):
                raise ValidationError("transaction", "'claim' runs sync handlers only; use "
                                      "'complete' for an async handler")
            if transaction == "claim" and timeout is not None:
                raise ValidationError("timeout", "not supported with transaction='claim' (its "
                                      "lease bounds it: the server ends an idle claim)")
            default = f"{f.__module__}.{f.__qualname__}"
            task_name = check_name("task", default if name is None else name, TASK_MAX_BYTES)
            task = Task(
                app=self,
                fn=f,
                name=task_name,
                queue=check_name("queue", queue, QUEUE_MAX_BYTES),
                priority=check_priority(priority),
                max_attempts=check_max_attempts(max_attempts),
                backoff=backoff or Backoff(),
                lease=check_lease(lease),
                transaction=check_transaction(transaction),
                timeout=check_timeout(timeout),
            )
            existing = self.tasks.get(task_name)
            if existing is not None and existing.fn is not f:
                raise ValidationError("task", f"name {task_name!r} is already registered")
            self.tasks[task_name] = task
            return task

        return register(fn) if fn is not None else register

    def cron(self, expr: str, *, tz: str = "UTC", name: str | None = None,
             args: dict[str, Any] | None = None,
             grace: float = 600.0) -> Callable[[Task], Task]:
        """Enqueue a task on a schedule: ``@app.cron("*/5 * * * *", tz="Europe/Berlin")``
        above ``@app.task``. Every worker of the app runs the scheduler; each slot becomes at
        most one job (see :mod:`skipjack.cron` for syntax, DST and misfire policy).

        Args:
            expr: 5-field cron expression or ``@daily``-style macro.
            tz: IANA time zone of the expression.
            name: the schedule's name (default: the task name); unique in the app.
            args: keyword arguments of every job (validated now).
            grace: seconds after its slot within which a missed run still happens.

        Raises:
            ValidationError: bad expression, zone, args or a name already used.
        """
        schedule = CronSchedule(expr, tz)
        if not 10 <= grace <= 86400 * 7:
            raise ValidationError("grace", f"{grace} seconds is out of range 10..604800")

        def register(task: Task) -> Task:
            if not isinstance(task, Task):
                raise ValidationError("cron", "decorate a task: put @app.cron above @app.task")
            # the slot's job key is "cron:<name>:<slot>", at most 255 bytes
            entry_name = check_name("cron name", name or task.name, CRON_NAME_MAX_BYTES)
            if entry_name in self.crons:
                raise ValidationError("cron name", f"{entry_name!r} is already scheduled")
            task.job(**(args or {}))  # validate the arguments now
            self.crons[entry_name] = CronEntry(entry_name, schedule, task, dict(args or {}),
                                               grace)
            return task

        return register

    # --- connections ---------------------------------------------------------------------

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """A new sync connection to the app's database (autocommit unless told otherwise)."""
        opts = {**self.connect_kwargs, **kwargs}
        return psycopg.connect(self.dsn, **opts)

    async def connect_async(self, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
        """A new async connection to the app's database (autocommit unless told otherwise)."""
        opts = {**self.connect_kwargs, **kwargs}
        return await psycopg.AsyncConnection.connect(self.dsn, **opts)

    def _sync_pool(self) -> ConnectionPool[psycopg.Connection[Any]]:
        with self._lock:
            if self._pool is None:
                self._pool = ConnectionPool(
                    self._dsn or resolve_dsn(), min_size=1, max_size=self.pool_size, open=False,
                    kwargs=self.connect_kwargs,
                )
                self._pool.open()
            return self._pool

    async def _async_pool(self) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
        if self._apool is None:
            pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
                self.dsn, min_size=1, max_size=self.pool_size, open=False,
                kwargs=self.connect_kwargs,
            )
            await pool.open()
            self._apool = pool
        return self._apool

    def close(self) -> None:
        """Close the app's own connection pools (not connections handed to it)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    async def close_async(self) -> None:
        """Close the async pool (and the sync one)."""
        if self._apool is not None:
            await self._apool.close()
            self._apool = None
        self.close()

    def migrate(self) -> list[int]:
        """Create or upgrade the schema; safe when many processes do it at once.

        Returns the migration versions this call applied. Raises
        :class:`SchemaVersionError` if the database is newer than this code.
        """
        with self.connect() as conn:
            return migrate(conn, self.schema)

    def check_schema(self) -> None:
        """Raise :class:`SchemaVersionError` unless the schema matches this code exactly."""
        with self.connect() as conn:
            check_schema(conn, self.schema)

    # --- enqueue -------------------------------------------------------------------------

    def enqueue(self, job: JobSpec, *, conn: psycopg.Connection[Any] | None = None) -> int:
        """Enqueue one job; returns its id. See :meth:`enqueue_many`."""
        return self.enqueue_many([job], conn=conn)[0]

    def enqueue_many(
        self, jobs: Iterable[JobSpec], *, conn: psycopg.Connection[Any] | None = None
    ) -> list[int]:
        """Enqueue jobs atomically: one statement for up to 1,000 of them; more are written
        1,000 to a statement (:data:`CHUNK_JOBS`) in one transaction (on the app's own
        connection each is sent without waiting for the previous one's result: psycopg
        pipeline mode).

        Args:
            jobs: specs from :meth:`Task.job`, any iterable. Without ``conn`` it is read as the
                jobs are written, while this call's transaction is open on one of the app's
                connections, so a generator's work overlaps the server's; such a generator
                must not be slow (the transaction stays open while it runs), nor enqueue an
                idempotency key it yielded before (that enqueue would wait for this call to
                commit, forever). With ``conn`` it is read in full first (it may read from
                that connection).
            conn: the caller's connection. The jobs then belong to the caller's transaction
                (and savepoints): workers see them, and are woken, only at commit, and a
                rollback removes them. Without it, the app's own connection commits at once.

        Returns:
            The job ids, in input order. A job whose idempotency key already exists gets the
            existing job's id.

        Raises:
            ValidationError: an item is not a JobSpec (or ``jobs`` itself raises it, e.g.
                from :meth:`Task.job`); nothing of this call is written, whichever item it is.
            DuplicateJobError: a key is held by a job this caller's snapshot cannot see.
            psycopg.Error: the database refused or could not be reached; nothing of this call
                was written (a transaction of the caller's is then failed, as after any
                refused statement: roll it back).
        """
        chunks = _chunks(jobs)
        if conn is not None:
            chunks = iter(list(chunks))
        first = next(chunks, None)  # checked before taking a connection
        if first is None:
            return []
        try:
            if conn is None:
                with self._sync_pool().connection() as own:
                    return self._enqueue_on(own, first, chunks, pipelined=True)
            return self._enqueue_on(conn, first, chunks, pipelined=False)
        except psycopg.errors.UndefinedTable as exc:
            self._note_not_migrated(exc)
            raise

    def _enqueue_on(self, conn: psycopg.Connection[Any], first: _Chunk,
                    chunks: Iterator[_Chunk], *, pipelined: bool) -> list[int]:
        """Write the chunks (specs, whether more follow): on the app's own connection in
        pipeline mode; on a caller's one statement after the other (pipeline mode there would
        be the caller's to choose, and psycopg refuses it after a ``stream()``)."""
        specs, more = first
        # tuple rows, whatever the row factory of the caller's connection
        atomic = conn.transaction() if _needs_transaction(conn, more) else nullcontext()
        with atomic, conn.cursor(row_factory=tuple_row) as cur:
            cursors: list[psycopg.Cursor[tuple[Any, ...]]] = []
            with conn.pipeline() if pipelined and more else nullcontext():
                for chunk, _ in chain([first], chunks):
                    if chunk is not specs:
                        specs += chunk
                    cursors.append(sent := conn.cursor(row_factory=tuple_row) if cursors else cur)
                    sent.execute(*_enqueue_statement(self.queries, chunk))
            rows = [row for sent in cursors for row in sent.fetchall()]
            return self._resolve_keys(cur, specs, rows)

    def _resolve_keys(self, cur: psycopg.Cursor[tuple[Any, ...]], specs: list[JobSpec],
                      rows: list[tuple[int, str | None]]) -> list[int]:
        """The ids in input order, reading the ids of keys already held (see _KEY_ROUNDS)."""
        q = self.queries
        existing: list[tuple[int, str]] = []
        for _ in range(_KEY_ROUNDS):
            missing = _missing_keys(specs, [*rows, *existing])
            if not missing:
                break
            existing += cur.execute(q.EXISTING_KEYS, {"keys": missing}).fetchall()
            for chunk, _ in _chunks(_specs_to_retry(specs, [*rows, *existing])):
                rows += cur.execute(*_enqueue_statement(q, chunk)).fetchall()
        return _assign_ids(specs, rows, existing)

    async def enqueue_async(
        self, job: JobSpec, *, conn: psycopg.AsyncConnection[Any] | None = None
    ) -> int:
        """Async :meth:`enqueue`."""
        return (await self.enqueue_many_async([job], conn=conn))[0]

    async def enqueue_many_async(
        self, jobs: Iterable[JobSpec], *, conn: psycopg.AsyncConnection[Any] | None = None
    ) -> list[int]:
        """Async :meth:`enqueue_many`; ``conn`` is the caller's async connection."""
        chunks = _chunks(jobs)
        if conn is not None:
            chunks = iter(list(chunks))
        first = next(chunks, None)
        if first is None:
            return []
        try:
            if conn is None:
                async with (await self._async_pool()).connection() as own:
                    return await self._enqueue_on_async(own, first, chunks, pipelined=True)
            return await self._enqueue_on_async(conn, first, chunks, pipelined=False)
        except psycopg.errors.UndefinedTable as exc:
            self._note_not_migrated(exc)
            raise

    def _note_not_migrated(self, exc: psycopg.errors.UndefinedTable) -> None:
        """Say what to do when the missing relation is one of skipjack's (not, say, a table
        the caller's iterable read)."""
        if f'relation "{self.schema}.' in (exc.diag.message_primary or ""):
            exc.add_note(f"skipjack: schema {self.schema!r} has no skipjack tables on this "
                         "database: run `skipjack migrate` (or App.migrate()) first, or check "
                         "the schema name")

    async def _enqueue_on_async(self, conn: psycopg.AsyncConnection[Any], first: _Chunk,
                                chunks: Iterator[_Chunk], *, pipelined: bool) -> list[int]:
        specs, more = first
        atomic = conn.transaction() if _needs_transaction(conn, more) else nullcontext()
        async with atomic, conn.cursor(row_factory=tuple_row) as cur:
            cursors: list[psycopg.AsyncCursor[tuple[Any, ...]]] = []
            async with conn.pipeline() if pipelined and more else nullcontext():
                for chunk, _ in chain([first], chunks):
                    if chunk is not specs:
                        specs += chunk
                    cursors.append(sent := conn.cursor(row_factory=tuple_row) if cursors else cur)
                    await sent.execute(*_enqueue_statement(self.queries, chunk))
            rows = [row for sent in cursors for row in await sent.fetchall()]
            return await self._resolve_keys_async(cur, specs, rows)

    async def _resolve_keys_async(self, cur: psycopg.AsyncCursor[tuple[Any, ...]],
                                  specs: list[JobSpec],
                                  rows: list[tuple[int, str | None]]) -> list[int]:
        q = self.queries
        existing: list[tuple[int, str]] = []
        for _ in range(_KEY_ROUNDS):
            missing = _missing_keys(specs, [*rows, *existing])
            if not missing:
                break
            existing += await (await cur.execute(q.EXISTING_KEYS, {"keys": missing})).fetchall()
            for chunk, _ in _chunks(_specs_to_retry(specs, [*rows, *existing])):
                rows += await (await cur.execute(*_enqueue_statement(q, chunk))).fetchall()
        return _assign_ids(specs, rows, existing)


CRON_NAME_MAX_BYTES = 224

# A bulk enqueue writes at most this many jobs, or this many characters of args, per
# statement (a statement must stay well under PostgreSQL's 1 GiB message limit; a larger job,
# up to max_args_bytes, is a statement of its own). 10,000 jobs from a generator: 1,000 per
# statement took 61 ms, 500 66 ms, 2,000 74 ms, one statement after the whole list 95-101 ms
# (docs/performance.md).
CHUNK_JOBS = 1000
CHUNK_MAX_CHARS = 32 * 1024 * 1024

_Chunk = tuple[list[JobSpec], bool]


def _chunks(jobs: Iterable[JobSpec]) -> Iterator[_Chunk]:
    """The specs in chunks of at most CHUNK_JOBS jobs and CHUNK_MAX_CHARS characters of args,
    each with whether another follows; refuses an item that is not a JobSpec."""
    chunk: list[JobSpec] = []
    chars = 0
    for i, spec in enumerate(jobs):
        if not isinstance(spec, JobSpec):
            raise ValidationError(
                f"jobs[{i}]", f"must be a JobSpec (from Task.job()), got {type(spec).__name__}"
            )
        size = len(spec.args_json)
        if chunk and (len(chunk) == CHUNK_JOBS or chars + size > CHUNK_MAX_CHARS):
            yield chunk, True
            chunk, chars = [], 0
        chunk.append(spec)
        chars += size
    if chunk:
        yield chunk, False


def _iso(values: list[Any]) -> list[Any]:
    return [None if v is None else v.isoformat() for v in values]


# The columns of a bulk enqueue besides args: (JobSpec attribute, statement parameter,
# array literal of a list of values, conversion of the values first). run_at goes as ISO 8601
# text: datetimes equal in Python may still differ in their offset (the two 02:30 of a night
# when the clocks go back compare equal), and the text keeps them apart.
_BULK_COLUMNS: tuple[tuple[str, str, Callable[[list[Any]], str],
                           Callable[[list[Any]], list[Any]] | None], ...] = (
    ("queue", "queue", text_array, None),
    ("task", "task", text_array, None),
    ("priority", "priority", number_array, None),
    ("max_attempts", "max_attempts", number_array, None),
    ("run_at", "run_at", text_array, _iso),
    ("delay", "delay", number_array, None),
    ("idempotency_key", "idempotency_key", text_array, None),
    ("lease", "lease_seconds", number_array, None),
    ("unique_states", "unique_states", number_array, None),
)


def _enqueue_statement(q: Queries, specs: list[JobSpec]) -> tuple[bytes, dict[str, Any]]:
    """ENQUEUE_ONE with plain values for one job, else ENQUEUE with args as one array
    literal (see :func:`~skipjack.queries.text_array`) and each other column as one value
    when every job shares it, else as an array literal; their *_NO_KEYS forms when no job
    has an idempotency key."""
    keyed = any(s.idempotency_key is not None for s in specs)
    if len(specs) == 1:
        s = specs[0]
        return q.ENQUEUE_ONE if keyed else q.ENQUEUE_ONE_NO_KEYS, {
            "queue": s.queue, "task": s.task, "args": s.args_json, "priority": s.priority,
            "max_attempts": s.max_attempts, "run_at": s.run_at, "delay": s.delay,
            "idempotency_key": s.idempotency_key, "lease_seconds": s.lease,
            "unique_states": s.unique_states}
    params: dict[str, Any] = {"args": text_array([s.args_json for s in specs])}
    for attr, name, array, convert in _BULK_COLUMNS:
        values = list(map(attrgetter(attr), specs))
        if convert is not None:
            values = convert(values)
        if values.count(values[0]) == len(values):
            params[name], params["same_" + name] = None, values[0]
        else:
            params[name], params["same_" + name] = array(values), None
    return q.ENQUEUE if keyed else q.ENQUEUE_NO_KEYS, params


def _needs_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
                       several: bool) -> bool:
    """Whether several statements need a transaction of their own: on an autocommit
    connection outside any (the app's own, or a caller's). One statement is atomic, and a
    caller's open transaction already holds them all."""
    return (several and conn.autocommit
            and conn.info.transaction_status == TransactionStatus.IDLE)


# A key whose holder finished between our insert and our look-up of its id is free again:
# such jobs are inserted anew, for at most this many rounds.
_KEY_ROUNDS = 3


def _specs_to_retry(specs: list[JobSpec], rows: list[tuple[int, str | None]]) -> list[JobSpec]:
    missing = set(_missing_keys(specs, rows))
    return [s for s in specs if s.idempotency_key in missing]


def _missing_keys(specs: list[JobSpec], rows: list[tuple[int, str | None]]) -> list[str]:
    inserted = {key for _, key in rows if key is not None}
    return sorted({s.idempotency_key for s in specs
                   if s.idempotency_key is not None and s.idempotency_key not in inserted})


def _assign_ids(
    specs: list[JobSpec],
    rows: list[tuple[int, str | None]],
    existing: list[tuple[int, str]],
) -> list[int]:
    """Map returned rows back to input order: keyed jobs by key, the rest by id order
    (rows were inserted in input order, so their identity values ascend with it)."""
    if not existing and len(rows) == len(specs) and all(key is None for _, key in rows):
        return sorted(job_id for job_id, _ in rows)  # no keys: the common bulk case
    by_key = {key: job_id for job_id, key in existing}
    by_key.update({key: job_id for job_id, key in rows if key is not None})
    unkeyed = iter(sorted(job_id for job_id, key in rows if key is None))
    ids = []
    for spec in specs:
        if spec.idempotency_key is None:
            ids.append(next(unkeyed))
        elif spec.idempotency_key in by_key:
            ids.append(by_key[spec.idempotency_key])
        else:
            raise DuplicateJobError(
                f"idempotency_key {spec.idempotency_key!r} is taken by a job not visible to "
                "this transaction (uncommitted elsewhere, or committed after its snapshot)"
            )
    return ids
