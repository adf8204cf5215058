"""The project's skipjack app, configured from Django's settings: ``DjangoApp``."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Literal

import psycopg
from asgiref.sync import sync_to_async
from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections, connections, transaction
from django.utils.module_loading import autodiscover_modules

from ...app import App, Task
from ...connections import sync_connection
from ...context import Job
from ...errors import ValidationError
from ...hooks import Hook, Hooks
from ...jobs import JobSpec
from ...migrate import migrate

log = logging.getLogger("skipjack.worker")

SETTINGS = {"DATABASE", "SCHEMA", "AUTODISCOVER", "POOL_SIZE", "PREPARE", "MAX_ARGS_BYTES"}


def skipjack_settings() -> dict[str, Any]:
    """``settings.SKIPJACK`` (a dict; every key optional, see the package's doc).

    Raises:
        ImproperlyConfigured: it is not a dict, has an unknown key, or names a database
            alias that ``DATABASES`` does not have.
    """
    conf = getattr(settings, "SKIPJACK", {})
    if not isinstance(conf, dict):
        raise ImproperlyConfigured("settings.SKIPJACK must be a dict")
    unknown = set(conf) - SETTINGS
    if unknown:
        raise ImproperlyConfigured(f"settings.SKIPJACK: unknown key(s) {sorted(unknown)}; "
                                   f"known: {sorted(SETTINGS)}")
    module = conf.get("AUTODISCOVER", "tasks")
    if module is not None and not isinstance(module, str):
        raise ImproperlyConfigured("settings.SKIPJACK['AUTODISCOVER'] must be a module name "
                                   f"or None, got {module!r}")
    alias = conf.get("DATABASE", "default")
    if alias not in settings.DATABASES:
        raise ImproperlyConfigured(f"settings.SKIPJACK['DATABASE'] is {alias!r}, which "
                                   f"settings.DATABASES does not have")
    return conf


def configured_schema() -> str:
    """The schema of the jobs: ``SKIPJACK["SCHEMA"]``, else ``$SKIPJACK_SCHEMA``, else
    ``skipjack`` (as ``skipjack.App`` resolves it)."""
    return (skipjack_settings().get("SCHEMA") or os.environ.get("SKIPJACK_SCHEMA")
            or "skipjack")


def conninfo(alias: str) -> str:
    """A libpq connection string for the database ``alias`` as Django connects to it now
    (its test database during tests).

    Raises:
        ImproperlyConfigured: the alias is not a PostgreSQL database.
    """
    wrapper = connections[alias]
    if wrapper.vendor != "postgresql":
        raise ImproperlyConfigured(f"skipjack needs PostgreSQL: DATABASES[{alias!r}] is "
                                   f"{wrapper.vendor}")
    keywords = {o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults()}
    params = {k: v for k, v in wrapper.get_connection_params().items()
              if k in keywords and v is not None and v != ""}
    return psycopg.conninfo.make_conninfo(**params)


class DjangoConnections(Hook):
    """Around each sync handler, as Django does around a request: close the thread's
    connections that broke or outlived ``CONN_MAX_AGE``, before and after. Skipped inside an
    atomic block (a ``"complete"`` handler's) and on an event loop (an async handler's are
    closed by ``_DjangoHooks`` on the thread its ORM calls run on)."""

    def run(self, job: Job) -> AbstractContextManager[object] | None:
        if _on_event_loop():
            return None
        if _in_atomic_block():
            return None
        return _closing_old()


class _DjangoHooks(Hooks):
    """The app's hooks, and around each attempt of an ``async def`` handler in a worker,
    Django's request cycle for the thread its ORM calls run on: the connections that
    broke or outlived ``CONN_MAX_AGE`` on the thread of ``sync_to_async(thread_sensitive=
    True)`` (where Django's async ORM runs them) are closed before the attempt and after
    it, as ``request_started`` and ``request_finished`` do (not after an attempt that was
    cancelled: the next one's close comes first). Those two calls wait while another
    call runs on that thread, as the handler's own ORM calls would."""

    def wrap(self, job: Job, fn: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
        wrapped = super().wrap(job, fn, is_async)
        if not is_async:
            return wrapped

        async def with_connections(**kwargs: Any) -> Any:
            await _close_old_on_orm_thread()
            try:
                result = await wrapped(**kwargs)
            except asyncio.CancelledError:
                # taken from its handler (timeout, lost lease, shutdown): no wait for the ORM
                # thread, which may still run its call; the next attempt's close comes first
                raise
            except BaseException:
                await _close_old_on_orm_thread()
                raise
            await _close_old_on_orm_thread()
            return result

        return with_connections


async def _close_old_on_orm_thread() -> None:
    """``close_old_connections`` on the thread where ``sync_to_async(thread_sensitive=True)``
    runs this task's ORM calls; nothing when a connection there is in an atomic block."""
    await sync_to_async(_close_old_unless_atomic, thread_sensitive=True)()


def _close_old_unless_atomic() -> None:
    if not _in_atomic_block():
        close_old_connections()


def _in_atomic_block(alias: str | None = None) -> bool:
    """Whether one of this thread's Django connections (of ``alias``, or any) is inside
    ``transaction.atomic()``; none is opened to tell."""
    return any(c.in_atomic_block for c in connections.all(initialized_only=True)
               if alias is None or c.alias == alias)


def _sync_code_in_atomic_block(alias: str) -> bool:
    """Whether the connection of ``alias`` that this thread's sync code uses is inside an
    atomic block: on an event loop, Django's connections (an asgiref ``Local``) are the
    loop's own, and that one is the thread's (an event loop started inside
    ``transaction.atomic()``). False when it cannot be told."""
    storage = getattr(getattr(connections, "_connections", None), "_storage", None)
    if not isinstance(storage, threading.local):
        return False
    return bool(getattr(getattr(storage, alias, None), "in_atomic_block", False))


def _on_event_loop() -> bool:
    """Whether this thread runs an event loop (Django then refuses its connections)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _async_unsafe_allowed() -> bool:
    """Whether ``DJANGO_ALLOW_ASYNC_UNSAFE`` lets Django's connections be used on a thread
    that runs an event loop (Django's own test: the variable is set and not empty)."""
    return bool(os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE"))


@contextmanager
def _closing_old() -> Iterator[None]:
    close_old_connections()
    try:
        yield
    finally:
        close_old_connections()


_SKIPJACK_DIR = str(Path(__file__).resolve().parents[2]) + os.sep  # warnings point past it


class _Tasks(dict[str, Task]):
    """The app's task registry, which also knows the tasks of Django's Tasks framework
    routed to a skipjack backend (by their module path, on first use). It refuses an
    ``async def`` ``"complete"`` handler, and warns of a task declared where a worker of
    ``manage.py skipjack`` does not look."""

    def __init__(self, app: DjangoApp) -> None:
        super().__init__()
        self._app = app
        self._unknown: set[str] = set()

    def __setitem__(self, name: str, task: Task) -> None:
        """Register ``task`` under ``name`` (``App.task`` does).

        Raises:
            ValidationError: ``task`` is an ``async def`` handler with
                ``transaction="complete"`` (see ``check_declaration``).
        """
        check_declaration(task)
        super().__setitem__(name, task)

    def get(self, name: str, default: Any = None) -> Any:
        task = super().get(name)
        if task is None and name not in self._unknown:
            from .tasks import runner_for_path
            try:
                task = runner_for_path(self._app, name)
            except Exception:  # a module that fails to import: the job's task is unknown
                log.exception("task %r: looking it up among Django's tasks failed", name)
            if task is None:
                self._unknown.add(name)
                if apps.ready:
                    log.warning("task %r is not known to this process: a worker of manage.py "
                                "skipjack knows the tasks declared in the %r module of each "
                                "installed app (and in what those import); a task declared "
                                "elsewhere (in the project package, say) never runs",
                                name, _autodiscovered_module())
        return default if task is None else task


def _autodiscovered_module() -> str:
    try:
        return str(skipjack_settings().get("AUTODISCOVER", "tasks"))
    except ImproperlyConfigured:
        return "tasks"


def check_declaration(task: Task) -> None:
    """Check a task declared on the Django app: refuse an ``async def`` handler with
    ``transaction="complete"``, and warn (``RuntimeWarning``) of one declared after
    Django's setup in a module outside every installed app, which a worker of ``manage.py
    skipjack`` never imports (its jobs would stay unknown to it). Such a task still works
    with a worker in the same process (``skipjack.testing.drain``), hence no error.

    Raises:
        ValidationError: the ``async def`` ``"complete"`` handler, naming the task.
    """
    if task.transaction == "complete" and inspect.iscoroutinefunction(task.fn):
        raise ValidationError(
            "transaction", f"task {task.name!r}: an async def handler cannot have "
            f"transaction='complete' on the Django app: Django allows no transaction.atomic() "
            f"on an event loop, so its ORM writes could not be part of the job's transaction "
            f"(they would commit even when the completion does not); make it a sync def "
            f"(it then runs in transaction.atomic() with the completion), or use "
            f"transaction='none'")
    module = getattr(task.fn, "__module__", None)
    if apps.ready and isinstance(module, str) and module != "__main__" \
            and apps.get_containing_app_config(module) is None:
        warnings.warn(
            f"skipjack task {task.name!r} is declared in {module!r}, outside every installed "
            f"app, after Django's setup: a worker of manage.py skipjack does not import it, "
            f"so its jobs would never run there (the worker logs them as an unknown task); "
            f"declare it in the {_autodiscovered_module()!r} module of an installed app",
            RuntimeWarning, stacklevel=_stacklevel_outside_skipjack())


def _stacklevel_outside_skipjack() -> int:
    """The ``stacklevel`` of ``warnings.warn`` (called by this function's caller) that
    points at the first frame outside skipjack: the line declaring the task."""
    level, frame = 2, sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_SKIPJACK_DIR):
        level, frame = level + 1, frame.f_back
    return level


class DjangoApp(App):
    """A ``skipjack.App`` on a database of Django's ``DATABASES``, configured by
    ``settings.SKIPJACK``; the project's one is ``skipjack.contrib.django.app``.

    Differences from ``skipjack.App``:

    - an enqueue without ``conn`` runs on Django's connection of the alias, in this thread:
      inside ``transaction.atomic()`` it joins that transaction (and savepoint), else it
      commits at once; async enqueues run it through ``sync_to_async``; on an event loop,
      an atomic block it cannot join is an error, never a job on another connection (see
      ``default_connection``);
    - sync ``transaction="complete"`` handlers run inside ``transaction.atomic()`` on the
      worker thread's Django connection, so their ORM writes commit with the completion;
      ``async def`` ones are refused at declaration (``ValidationError``);
    - handlers run with Django's connections managed as around a request: a sync handler's
      thread's, an async one's on the thread of ``sync_to_async(thread_sensitive=True)``;
    - a task declared after Django's setup outside every installed app warns (a worker of
      ``manage.py skipjack`` would not know it);
    - the tasks of Django's Tasks framework sent to ``.tasks.SkipjackBackend`` run too.

    Args:
        alias: the database alias (default ``SKIPJACK["DATABASE"]``, else ``"default"``).
        kwargs: as for ``skipjack.App`` (defaults from ``settings.SKIPJACK``).

    Raises:
        ImproperlyConfigured: bad ``settings.SKIPJACK``.
        ValidationError: a setting out of range (see ``skipjack.App``).
    """

    def __init__(self, alias: str | None = None, **kwargs: Any) -> None:
        conf = skipjack_settings()
        self.alias: str = alias or conf.get("DATABASE", "default")
        kwargs.setdefault("schema", configured_schema())
        kwargs.setdefault("pool_size", conf.get("POOL_SIZE", 4))
        kwargs.setdefault("prepare", conf.get("PREPARE", True))
        if "MAX_ARGS_BYTES" in conf:
            kwargs.setdefault("max_args_bytes", conf["MAX_ARGS_BYTES"])
        kwargs.setdefault("complete_transaction", self._atomic)
        hooks = [DjangoConnections(), *kwargs.pop("hooks", ())]
        super().__init__(lambda: conninfo(self.alias), hooks=hooks, **kwargs)
        self.hooks = _DjangoHooks(list(self.hooks))
        self.tasks = _Tasks(self)

    def default_connection(self) -> psycopg.Connection[Any] | None:
        """Django's connection of the alias, in this thread (opened if it was not): the
        connection Django's ORM uses here, so that an enqueue inside
        ``transaction.atomic()`` joins that block.

        On a thread that runs an event loop, Django refuses its connections unless
        ``DJANGO_ALLOW_ASYNC_UNSAFE`` is set, and code on the loop has connections of its own
        (apart from those of the thread's sync code). There: Django's connection where it
        is allowed (joining a block opened on the loop), else None outside any atomic block
        (the app's own connection then serves, committing at once); and an error when an
        atomic block is open that the enqueue could not join, rather than a job written
        outside that transaction.

        Raises:
            ImproperlyConfigured: it is not on psycopg 3.
            ValidationError: (field ``conn``) on an event loop, an atomic block of the alias
                is open that this enqueue cannot join: one opened on the loop where Django
                no longer allows its connection, or one of the thread's sync code, which
                started the loop inside ``transaction.atomic()``.
        """
        return self.django_connection(in_atomic_block="refuse")

    def django_connection(self, *, in_atomic_block: Literal["refuse", "other"]
                          ) -> psycopg.Connection[Any] | None:
        """Django's connection of the alias for this thread, or None where Django refuses
        it (on an event loop, unless ``DJANGO_ALLOW_ASYNC_UNSAFE`` is set). On an event loop,
        inside an atomic block this connection is not in (see ``default_connection``),
        ``in_atomic_block="refuse"`` raises (for an enqueue) and ``"other"`` goes on (for a
        read, which then does not see that block's jobs).

        Raises:
            ImproperlyConfigured: it is not on psycopg 3.
            ValidationError: refused inside an atomic block (see ``default_connection``).
        """
        if _on_event_loop():
            allowed = _async_unsafe_allowed()
            if in_atomic_block == "refuse":
                on_loop = _in_atomic_block(self.alias)
                if (on_loop and not allowed) or (
                        not on_loop and _sync_code_in_atomic_block(self.alias)):
                    raise ValidationError("conn", self._unjoinable_atomic_block())
            if not allowed:
                return None
        try:
            return sync_connection(connections[self.alias])
        except ValidationError as exc:
            raise ImproperlyConfigured(f"DATABASES[{self.alias!r}]: {exc}") from None

    def _unjoinable_atomic_block(self) -> str:
        return (f"Django's connection {self.alias!r} is inside transaction.atomic() on this "
                f"thread, but this enqueue runs on an event loop, where that transaction "
                f"cannot be joined (Django refuses its connection there, or gives the loop "
                f"connections of its own); skipjack does not write the job on another "
                f"connection, where it would commit even if the block rolled back. Enqueue "
                f"in the block's sync code, outside the event loop; from async code, run a "
                f"function that opens the block and enqueues with sync_to_async (outside any "
                f"block, await task.enqueue_async(...) needs none); or pass the connection "
                f"to enqueue in as conn= (task.enqueue_on(conn, ...))")

    def reading(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A new connection for a few reads, closed when the block ends: nothing of the
        app's stays connected to Django's database between calls (its test database is
        dropped at the end of a test run only when no session is left on it)."""
        return self.connect()

    async def enqueue_many_async(self, jobs: Iterable[JobSpec], *,
                                 conn: object | None = None) -> list[int]:
        """``skipjack.App.enqueue_many_async``; without ``conn``, the sync enqueue on
        Django's connection through ``sync_to_async`` (the thread Django's async ORM
        calls use). When a Django connection of this thread is inside an atomic block (one
        opened on the loop where ``DJANGO_ALLOW_ASYNC_UNSAFE`` allows it, or one of the
        sync code that started the loop), ``sync_to_async`` would write the job on another
        thread's connection, outside that transaction: the enqueue then joins the block
        where it can and is refused otherwise, as ``default_connection`` says.

        Raises:
            ValidationError: as ``skipjack.App.enqueue_many_async``, and (field ``conn``)
                refused inside an atomic block as above.
        """
        if conn is not None:
            return await super().enqueue_many_async(jobs, conn=conn)
        specs = list(jobs)
        if _in_atomic_block(self.alias) or _sync_code_in_atomic_block(self.alias):
            return self.enqueue_many(specs)  # this thread's transaction, or the refusal
        enqueue = sync_to_async(self.enqueue_many, thread_sensitive=True)
        ids: list[int] = await enqueue(specs)
        return ids

    @contextmanager
    def _atomic(self) -> Iterator[psycopg.Connection[Any]]:
        """A ``"complete"`` handler's transaction: ``transaction.atomic()`` on this thread's
        Django connection of the alias, its old connections closed before and after."""
        close_old_connections()
        try:
            with transaction.atomic(using=self.alias):
                yield sync_connection(connections[self.alias])
        finally:
            close_old_connections()

    def migrate_django(self) -> list[int]:
        """Apply skipjack's migrations to the alias's database as Django connects to it now
        (its test database during tests), on a connection of their own."""
        with psycopg.connect(conninfo(self.alias), autocommit=True) as conn:
            return migrate(conn, self.schema)


_app: DjangoApp | None = None
_app_lock = threading.Lock()


def get_app() -> DjangoApp:
    """The project's ``DjangoApp`` (made on first use)."""
    global _app
    with _app_lock:
        if _app is None:
            _app = DjangoApp()
        return _app


def autodiscover() -> None:
    """Import the ``SKIPJACK["AUTODISCOVER"]`` module (default ``tasks``) of every installed
    app that has one, so that workers know every task."""
    module = skipjack_settings().get("AUTODISCOVER", "tasks")
    if module:
        autodiscover_modules(module)


def register_backend_tasks() -> None:
    """Make the runners of the Django tasks (sent to a ``.tasks.SkipjackBackend``) that the
    autodiscovered modules hold, and schedule the ``cron`` entries of every such backend in
    ``TASKS``."""
    from .tasks import register_crons, register_discovered
    module = skipjack_settings().get("AUTODISCOVER", "tasks")
    if module:
        register_discovered(get_app(), module)
    register_crons(get_app())
