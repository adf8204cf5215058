"""The application object: configuration, the task registry and enqueue (sync and async)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, overload

import psycopg

from . import enqueue as enqueuing
from .admin import Admin
from .connections import async_connection, sync_connection
from .cron import GRACE_MAX, GRACE_MIN, CronSchedule
from .db import Database
from .errors import ValidationError
from .hooks import Hook, Hooks
from .jobs import (
    DEFAULT_MAX_ARGS_BYTES,
    QUEUE_MAX_BYTES,
    TASK_MAX_BYTES,
    HandlerArguments,
    JobSpec,
    TransactionMode,
    check_delay,
    check_idempotency_key,
    check_lease,
    check_max_attempts,
    check_name,
    check_priority,
    check_run_at,
    check_timeout,
    check_transaction,
    job_ids,
    serialize_args,
    unique_states_mask,
)
from .migrate import LOCK_ATTEMPTS, LOCK_TIMEOUT, check_schema, migrate
from .pools import AsyncHotPool, HotPool
from .results import JobHandle, close_listener
from .retry import Backoff

_SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")

# A cron entry's name is part of its slots' idempotency keys, "cron:<name>:<slot>", which
# must fit in 255 bytes.
CRON_NAME_MAX_BYTES = 224


# Seconds a read waits for a connection of the app's pool.
READ_TIMEOUT = 10.0

# A callable giving a context manager that yields a psycopg connection in an open transaction
# (see App's complete_transaction).
TransactionSource = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]
# The same for async handlers: an async context manager yielding a psycopg AsyncConnection.
AsyncTransactionSource = Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]]


@dataclass(frozen=True)
class Task:
    """A registered task: a function plus its default job options.

    Create tasks with ``App.task``; call ``configure`` for per-call options. Calling
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
    transaction: TransactionMode = "none"
    timeout: float | None = None
    unique_states: int = 63
    arguments: HandlerArguments | None = field(default=None, repr=False, compare=False)

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
            delay: seconds (or timedelta) from the database's ``now()`` at enqueue. One call
                takes one of ``run_at`` and ``delay``; in a chain of calls the last one
                given wins (``configure(run_at=t).configure(delay=5)``: in 5 s).
            idempotency_key: at most one job per key exists in the ``unique_while`` states;
                enqueueing the key again returns the existing job's id (it never changes
                that job, running or not).
            unique_while: the states in which the key is held, e.g.
                ``("scheduled", "available", "running")`` to allow a new job once the previous
                one finished; default every state (one job per key, ever).
            lease: seconds this job's claim lasts without renewal, instead of the worker's;
                a crashed worker's job is rescued this long after its last heartbeat.

        Raises:
            ValidationError: any option out of its range (see ``skipjack.jobs``).
        """
        changes: dict[str, Any] = {}
        if queue is not None:
            changes["queue"] = check_name("queue", queue, QUEUE_MAX_BYTES)
        if priority is not None:
            changes["priority"] = check_priority(priority)
        if max_attempts is not None:
            changes["max_attempts"] = check_max_attempts(max_attempts)
        if run_at is not None and delay is not None:
            raise ValidationError("run_at", "give run_at or delay, not both")
        if run_at is not None:  # and not an earlier configure's delay
            changes["run_at"], changes["delay"] = check_run_at(run_at), None
        if delay is not None:  # and not an earlier configure's run_at
            changes["delay"], changes["run_at"] = check_delay(delay), None
        if idempotency_key is not None:
            changes["idempotency_key"] = check_idempotency_key(idempotency_key)
        if lease is not None:
            changes["lease"] = check_lease(lease)
        if unique_while is not None:
            changes["unique_states"] = unique_states_mask(unique_while)
        return dataclasses.replace(self, **changes)

    def job(self, *args: Any, **kwargs: Any) -> JobSpec:
        """A validated job for this task with ``kwargs`` as its arguments (not yet enqueued).
        Arguments are stored by name, so they are given by keyword.

        Raises:
            ValidationError: the arguments break a rule of ``skipjack.jobs``, or do not
                fit the handler's signature (an unexpected or missing argument), or some
                are positional.
        """
        if args:
            raise self._positional(args, "job")
        if self.arguments is not None:
            problem = self.arguments.mismatch(kwargs)
            if problem is not None:
                raise ValidationError("args", f"task {self.name!r}: {problem}")
        # positional, in JobSpec's field order: a third cheaper than keywords per job
        return JobSpec(self.queue, self.name, serialize_args(kwargs, self.app.max_args_bytes),
                       self.priority, self.max_attempts, self.run_at, self.delay,
                       self.idempotency_key, self.lease, self.unique_states)

    def enqueue(self, *args: Any, **kwargs: Any) -> JobHandle:
        """Enqueue one job, with ``kwargs`` as its arguments, as ``App.enqueue`` does
        without ``conn`` (on the app's own connection, committed at once, unless the app
        joins a framework's transaction); returns its ``skipjack.JobHandle``.
        ``enqueue_on`` enqueues in a transaction of the caller's.

        Raises:
            ValidationError: as ``job``; or ``conn`` given, which the handler does not
                take (the message points to ``enqueue_on``).
        """
        if args:
            raise self._positional(args, "enqueue")
        self._refuse_conn(kwargs)
        return self.app.enqueue(self.job(**kwargs))

    async def enqueue_async(self, *args: Any, **kwargs: Any) -> JobHandle:
        """Async ``enqueue``."""
        if args:
            raise self._positional(args, "enqueue_async")
        self._refuse_conn(kwargs, "enqueue_on_async")
        return await self.app.enqueue_async(self.job(**kwargs))

    def _positional(self, args: tuple[Any, ...], method: str) -> ValidationError:
        """The error for arguments given by position to ``method``."""
        names = self.arguments.order if self.arguments is not None else ()
        example = ", ".join(f"{n}=..." for n in names[:len(args)]) or "name=value"
        return ValidationError("args", f"task {self.name!r}: arguments are given by keyword "
                                       f"(task.{method}({example})), not by position: got "
                                       f"{len(args)} positional")

    def _refuse_conn(self, kwargs: dict[str, Any], instead: str = "enqueue_on") -> None:
        if "conn" in kwargs and not (self.arguments is None or self.arguments.any_keyword
                                     or "conn" in self.arguments.names):
            raise ValidationError("conn", f"task {self.name!r} takes no argument 'conn': to "
                                  f"enqueue in your transaction, call "
                                  f"task.{instead}(conn, **arguments)")

    def enqueue_on(self, conn: object, /, *args: Any, **kwargs: Any) -> JobHandle:
        """Enqueue one job in the transaction of ``conn`` (anything ``App.enqueue``
        takes as ``conn``: a psycopg connection, an SQLAlchemy session or connection, a
        Django connection), with ``kwargs`` as its arguments. ``conn`` is positional, so a
        task may have an argument named ``conn``; ``task.configure(...).enqueue_on(conn,
        ...)`` sets options too.

        Raises:
            ValidationError: as ``job``, or ``conn`` is not a connection skipjack can
                use.
        """
        if args:
            raise self._positional(args, "enqueue_on")
        return self.app.enqueue(self.job(**kwargs), conn=conn)

    async def enqueue_on_async(self, conn: object, /, *args: Any, **kwargs: Any) -> JobHandle:
        """Async ``enqueue_on``: ``conn`` is a psycopg ``AsyncConnection``, or an
        SQLAlchemy ``AsyncSession`` or ``AsyncConnection``."""
        if args:
            raise self._positional(args, "enqueue_on_async")
        return await self.app.enqueue_async(self.job(**kwargs), conn=conn)


class App(Admin):
    """A skipjack application: where the jobs live, which tasks exist, which run on a cron.

    The operating methods (``stats``, ``cancel``, ``pause_queue``, ``prune``, ...) are
    documented in ``skipjack.admin.Admin``.

    Args:
        dsn: a libpq connection string or URI, or a callable returning one (called on first
            use). None: ``$SKIPJACK_DATABASE_URL``, then ``$DATABASE_URL``, then the
            embedded PostgreSQL server.
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
        hooks: ``skipjack.hooks.Hook`` objects run around enqueues and executions
            (more with ``add_hook``).
        complete_transaction: where sync ``transaction="complete"`` handlers get their
            transaction: a callable returning a context manager that gives a psycopg
            connection in an open transaction, commits it when the block ends and rolls it
            back when it raises. None: a connection of the worker's own pool. The framework
            integrations set it so that a handler's ORM writes join the job's transaction
            (``skipjack.contrib.sqlalchemy.job_transactions``, the Django app's).
        complete_transaction_async: the same for ``async def`` ``"complete"`` handlers: a
            callable returning an async context manager that gives a psycopg
            ``AsyncConnection`` in an open transaction
            (``skipjack.contrib.sqlalchemy.async_job_transactions``).

    Raises:
        ValidationError: bad schema name, size limit or pool size.
        TypeError: an item of ``hooks`` is not a Hook.
    """

    def __init__(
        self,
        dsn: str | Callable[[], str] | None = None,
        *,
        schema: str | None = None,
        max_args_bytes: int = DEFAULT_MAX_ARGS_BYTES,
        prepare: bool = True,
        pool_size: int = 4,
        hooks: Sequence[Hook] = (),
        complete_transaction: TransactionSource | None = None,
        complete_transaction_async: AsyncTransactionSource | None = None,
    ) -> None:
        schema = schema or os.environ.get("SKIPJACK_SCHEMA") or "skipjack"
        if not isinstance(schema, str) or not _SCHEMA_RE.fullmatch(schema):
            raise ValidationError(
                "schema", f"{schema!r} must match [a-z_][a-z0-9_]* and be at most 63 bytes"
            )
        if isinstance(max_args_bytes, bool) or not isinstance(max_args_bytes, int) \
                or not 1 <= max_args_bytes <= 255 * 1024 * 1024:
            raise ValidationError("max_args_bytes", "must be 1..267,386,880 bytes (255 MiB)")
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) \
                or not 1 <= pool_size <= 1000:
            raise ValidationError("pool_size", f"must be an int in 1..1000, got {pool_size!r}")
        self.pool_size = pool_size
        self.db = Database(dsn, schema, prepare=prepare)
        self.schema = schema
        self.max_args_bytes = max_args_bytes
        self.tasks: dict[str, Task] = {}
        self.crons: dict[str, CronEntry] = {}
        self.hooks = Hooks(hooks)
        self.complete_transaction = complete_transaction
        self.complete_transaction_async = complete_transaction_async
        self._lock = threading.Lock()
        self._pool: HotPool | None = None
        self._apool: AsyncHotPool | None = None

    # --- configuration -------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        """The resolved connection string (starts the embedded server when it is the one)."""
        return self.db.dsn

    def add_hook(self, hook: Hook) -> None:
        """Run ``hook`` (a ``skipjack.hooks.Hook``) around this app's enqueues and its
        workers' executions from now on, after the hooks added before it. A worker reads the
        hooks as each attempt starts.

        Raises:
            TypeError: ``hook`` is not a Hook.
        """
        self.hooks.add(hook)

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
        transaction: TransactionMode = "none",
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
        transaction: TransactionMode = "none",
        timeout: float | None = None,
    ) -> Task | Callable[[Callable[..., Any]], Task]:
        """Register a function as a task; usable bare (``@app.task``) or with options.

        Args:
            fn: the handler, sync or ``async def``; it is called with the job's args as
                keyword arguments.
            name: the task name stored with each job (default ``module.qualname``).
            queue: the default queue of this task's jobs (1-63 bytes).
            priority: their default priority (-100..100, higher first).
            max_attempts: their default attempts (1..10,000).
            backoff: retry delay policy (default ``skipjack.retry.Backoff()``).
            lease: seconds a claim of this task's jobs lasts (default: the worker's lease);
                it must be more than twice the worker's heartbeat interval.
            transaction: what the handler's database transaction spans.
                ``"none"`` (default): the handler runs outside any transaction and the
                outcome is recorded afterwards. ``"complete"``: ``current_job().conn`` is a
                connection in a transaction that also records the fenced completion, so
                the handler's writes commit exactly once (see ``skipjack.transactional``).
                ``"claim"``: the job is claimed in a transaction
                that stays open while the handler runs (sync handlers only) and commits with
                the outcome. No rescue is involved: if the worker dies, PostgreSQL
                rolls back and the job is available again. The handler must finish within
                its lease: past it the worker ends the claim's session and counts the
                attempt as timed out; the transaction's idle and statement timeouts (and
                from PostgreSQL 17 on its transaction timeout) are the lease plus 5 s, so
                the server ends a stalled worker's transaction and a killed worker's
                statement.
            timeout: seconds an attempt may run; past it the attempt fails (and is retried
                per policy). Async handlers are cancelled; a sync handler's thread cannot be
                stopped, so it is told through ``current_job().cancelled`` and its eventual
                result is ignored.

        Raises:
            ValidationError: bad option, or the name is taken by another function.
        """

        if backoff is not None and not isinstance(backoff, Backoff):
            raise ValidationError("backoff", f"must be a skipjack.Backoff, got "
                                  f"{type(backoff).__name__}")

        def register(f: Callable[..., Any]) -> Task:
            if transaction == "claim" and inspect.iscoroutinefunction(f):
                raise ValidationError("transaction", "'claim' runs sync handlers only; use "
                                      "'complete' for an async handler")
            if transaction == "claim" and timeout is not None:
                raise ValidationError("timeout", "not supported with transaction='claim' (its "
                                      "lease bounds it: past it the claim is ended)")
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
                arguments=HandlerArguments.of(f),
            )
            # registered ones only (a registry that resolves names on lookup must not)
            existing = self.tasks[task_name] if task_name in self.tasks else None
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
        most one job (see ``skipjack.cron`` for syntax, DST and misfire policy).

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
        if isinstance(grace, bool) or not isinstance(grace, int | float) \
                or not GRACE_MIN <= grace <= GRACE_MAX:
            raise ValidationError("grace", f"{grace} seconds is out of range "
                                           f"{GRACE_MIN:g}..{GRACE_MAX:g}")

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

    async def connect_async(self, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
        """A new async connection to the app's database (autocommit unless told otherwise).

        Raises:
            psycopg.OperationalError: the database cannot be reached.
        """
        return await self.db.connect_async(**kwargs)

    def _sync_pool(self) -> HotPool:
        dsn = self.db.dsn  # resolved outside the pool lock: it may start the embedded server
        with self._lock:
            if self._pool is None:
                self._pool = HotPool(
                    dsn, min_size=1, max_size=self.pool_size, open=False,
                    kwargs=self.db.connect_kwargs,
                )
                self._pool.open()
            return self._pool

    async def _async_pool(self) -> AsyncHotPool:
        if self._apool is None:
            pool = AsyncHotPool(
                self.dsn, min_size=1, max_size=self.pool_size, open=False,
                kwargs=self.db.connect_kwargs,
            )
            await pool.open()
            self._apool = pool
        return self._apool

    def reading(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A connection of the app's own pool for a few reads (see ``Admin.reading``);
        its transaction ends when the block does.

        Raises:
            psycopg_pool.PoolTimeout: (an OperationalError) no connection within 10 s.
        """
        return self._sync_pool().connection(timeout=READ_TIMEOUT)

    def close(self) -> None:
        """Close the app's own connection pools (not connections handed to it) and the
        connection that waits for job ends (``JobHandle.result``)."""
        close_listener(self)
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    async def close_async(self) -> None:
        """Close the async pool (and the sync one)."""
        if self._apool is not None:
            await self._apool.close()
            self._apool = None
        self.close()

    def migrate(self, *, lock_timeout: float = LOCK_TIMEOUT,
                attempts: int = LOCK_ATTEMPTS) -> list[int]:
        """Create or upgrade the schema; safe when many processes do it at once, and while
        workers run. An up-to-date schema is only read (no DDL, no lock beyond a read).

        Args:
            lock_timeout: seconds, 0.001..600: the longest each lock wait lasts. While a
                migration waits for a table lock, the queue's statements on that table wait
                behind it, so keep this well under the workers' lease.
            attempts: 1..100: tries when a lock wait timed out, with a backoff between.

        Returns:
            The migration versions this call applied.

        Raises:
            ValidationError: ``lock_timeout`` or ``attempts`` out of range.
            SchemaVersionError: the database is newer than this code.
            MigrationLockError: another session held a lock on a table of the schema through
                every attempt (the message names it).
            MigrationError: the database refused a migration's statement (nothing applied).
        """
        with self.connect() as conn:
            return migrate(conn, self.schema, lock_timeout=lock_timeout, attempts=attempts)

    def check_schema(self) -> None:
        """Raise ``SchemaVersionError`` unless the schema matches this code exactly."""
        with self.connect() as conn:
            check_schema(conn, self.schema)

    # --- enqueue -------------------------------------------------------------------------

    def job_handle(self, job_id: int) -> JobHandle:
        """A ``skipjack.JobHandle`` for the job ``job_id`` of this app (whether it
        exists is checked when the handle is used).

        Raises:
            ValidationError: ``job_id`` is not an int in 1..2^63-1 (a float or a bool is not).
        """
        (checked,) = job_ids([job_id], "job_id")
        return JobHandle(checked, self)

    def default_connection(self) -> psycopg.Connection[Any] | None:
        """The connection enqueues without ``conn`` join: None here (the app's own, committed
        at once); the Django app's is Django's connection, so that an enqueue inside
        ``transaction.atomic()`` belongs to it."""
        return None

    def enqueue(self, job: JobSpec, *, conn: object | None = None) -> JobHandle:
        """Enqueue one job; returns its ``skipjack.JobHandle`` (the id, as an int, that
        can wait for the outcome). See ``enqueue_many``."""
        return JobHandle(self.enqueue_many([job], conn=conn)[0], self)

    def enqueue_many(
        self, jobs: Iterable[JobSpec], *, conn: object | None = None
    ) -> list[int]:
        """Enqueue jobs atomically: one statement for up to 1,000 of them; more are written
        1,000 to a statement (``skipjack.enqueue.CHUNK_JOBS``) in one transaction (on the
        app's own connection each is sent without waiting for the previous one's result:
        psycopg pipeline mode).

        Args:
            jobs: specs from ``Task.job``, any iterable. Without ``conn`` it is read as the
                jobs are written, while this call's transaction is open on one of the app's
                connections, so a generator's work overlaps the server's; such a generator
                must not be slow (the transaction stays open while it runs), nor enqueue an
                idempotency key it yielded before (that enqueue would wait for this call to
                commit, forever). With ``conn`` it is read in full first (it may read from
                that connection).
            conn: the caller's connection: a psycopg ``Connection``, an SQLAlchemy
                ``Session`` or ``Connection`` (psycopg driver) or a Django connection (see
                ``skipjack.connections``). The jobs then belong to the caller's
                transaction (and savepoints): workers see them, and are woken, only at
                commit, and a rollback removes them. Without it, the app's
                ``default_connection``, else its own connection, which commits at once.

        Returns:
            The job ids, in input order (plain ints; ``job_handle`` makes a handle of
            one). A job whose idempotency key already exists gets the existing job's id.

        Raises:
            ValidationError: ``conn`` is not a connection skipjack can use; an item is not a
                JobSpec (or ``jobs`` itself raises it, e.g.
                from ``Task.job``); nothing of this call is written, whichever item it is.
                A value holds a character the database's encoding cannot store (a database
                not in UTF8); the statement holding it was not sent (on a caller's
                transaction, roll it back: a call of more than 1,000 jobs may have sent
                others).
            DuplicateJobError: a key is held by a job this caller's snapshot cannot see.
            psycopg.Error: the database refused or could not be reached; nothing of this call
                was written (a transaction of the caller's is then failed, as after any
                refused statement: roll it back).
        """
        raw = sync_connection(conn) if conn is not None else self.default_connection()
        plan = enqueuing.Plan(self.queries, jobs, read_all=raw is not None)
        if plan.empty:  # checked before taking a connection
            return []
        with self.hooks.around_enqueue(plan.specs, raw is not None) as call:
            if call is not None:
                plan.metadata = self.hooks.metadata_json(call)
            try:
                if raw is None:
                    with self._sync_pool().connection() as own:
                        ids = enqueuing.run(own, plan, pipelined=True)
                else:
                    ids = enqueuing.run(raw, plan, pipelined=False)
            except psycopg.errors.UndefinedTable as exc:
                enqueuing.note_not_migrated(exc, self.schema)
                raise
            except (UnicodeEncodeError, psycopg.errors.UntranslatableCharacter) as exc:
                raise enqueuing.not_encodable(exc) from None
            if call is not None:
                call.ids, call.inserted = ids, plan.inserted
        return ids

    async def enqueue_async(self, job: JobSpec, *, conn: object | None = None) -> JobHandle:
        """Async ``enqueue``."""
        return JobHandle((await self.enqueue_many_async([job], conn=conn))[0], self)

    async def enqueue_many_async(
        self, jobs: Iterable[JobSpec], *, conn: object | None = None
    ) -> list[int]:
        """Async ``enqueue_many``; ``conn`` is the caller's psycopg ``AsyncConnection``,
        or an SQLAlchemy ``AsyncSession`` or ``AsyncConnection`` (psycopg driver)."""
        if conn is not None:
            conn = await async_connection(conn)
        plan = enqueuing.Plan(self.queries, jobs, read_all=conn is not None)
        if plan.empty:
            return []
        with self.hooks.around_enqueue(plan.specs, conn is not None) as call:
            if call is not None:
                plan.metadata = self.hooks.metadata_json(call)
            try:
                if conn is None:
                    async with (await self._async_pool()).connection() as own:
                        ids = await enqueuing.run_async(own, plan, pipelined=True)
                else:
                    assert isinstance(conn, psycopg.AsyncConnection)
                    ids = await enqueuing.run_async(conn, plan, pipelined=False)
            except psycopg.errors.UndefinedTable as exc:
                enqueuing.note_not_migrated(exc, self.schema)
                raise
            except (UnicodeEncodeError, psycopg.errors.UntranslatableCharacter) as exc:
                raise enqueuing.not_encodable(exc) from None
            if call is not None:
                call.ids, call.inserted = ids, plan.inserted
        return ids


@dataclass(frozen=True)
class CronEntry:
    """A task enqueued on a schedule, with fixed keyword arguments; ``grace`` is seconds
    after its slot within which a missed run still happens (see ``skipjack.cron``)."""

    name: str
    schedule: CronSchedule
    task: Task
    args: dict[str, Any]
    grace: float = 600.0
