"""The project's skipjack app, configured from Django's settings: ``DjangoApp``."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import psycopg
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections, connections, transaction
from django.utils.module_loading import autodiscover_modules

from ...app import App, Task
from ...connections import sync_connection
from ...context import Job
from ...errors import ValidationError
from ...hooks import Hook
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
    atomic block (a ``"complete"`` handler's) and on an event loop (async handlers reach the
    ORM through ``sync_to_async``, which manages its own)."""

    def run(self, job: Job) -> AbstractContextManager[object] | None:
        if _on_event_loop():
            return None
        if any(c.in_atomic_block for c in connections.all(initialized_only=True)):
            return None
        return _closing_old()


def _on_event_loop() -> bool:
    """Whether this thread runs an event loop (Django then refuses its connections)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@contextmanager
def _closing_old() -> Iterator[None]:
    close_old_connections()
    try:
        yield
    finally:
        close_old_connections()


class _Tasks(dict[str, Task]):
    """The app's task registry, which also knows the tasks of Django's Tasks framework
    routed to a skipjack backend (by their module path, on first use)."""

    def __init__(self, app: DjangoApp) -> None:
        super().__init__()
        self._app = app
        self._unknown: set[str] = set()

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
        return default if task is None else task


class DjangoApp(App):
    """A ``skipjack.App`` on a database of Django's ``DATABASES``, configured by
    ``settings.SKIPJACK``; the project's one is ``skipjack.contrib.django.app``.

    Differences from ``skipjack.App``:

    - an enqueue without ``conn`` runs on Django's connection of the alias, in this thread:
      inside ``transaction.atomic()`` it joins that transaction (and savepoint), else it
      commits at once; async enqueues run it through ``sync_to_async``;
    - sync ``transaction="complete"`` handlers run inside ``transaction.atomic()`` on the
      worker thread's Django connection, so their ORM writes commit with the completion;
    - handlers run with Django's connections managed as around a request;
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
        self.tasks = _Tasks(self)

    def default_connection(self) -> psycopg.Connection[Any] | None:
        """Django's connection of the alias, in this thread (opened if it was not); None on
        a thread that runs an event loop, where Django allows no use of it (and no atomic
        block): the app's own connection then serves, committing at once.

        Raises:
            ImproperlyConfigured: it is not on psycopg 3.
        """
        if _on_event_loop():
            return None
        try:
            return sync_connection(connections[self.alias])
        except ValidationError as exc:
            raise ImproperlyConfigured(f"DATABASES[{self.alias!r}]: {exc}") from None

    def reading(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A new connection for a few reads, closed when the block ends: nothing of the
        app's stays connected to Django's database between calls (its test database is
        dropped at the end of a test run only when no session is left on it)."""
        return self.connect()

    async def enqueue_many_async(self, jobs: Iterable[JobSpec], *,
                                 conn: object | None = None) -> list[int]:
        """``skipjack.App.enqueue_many_async``; without ``conn``, the sync enqueue on
        Django's connection through ``sync_to_async`` (the thread Django's async ORM
        calls use)."""
        if conn is not None:
            return await super().enqueue_many_async(jobs, conn=conn)
        specs = list(jobs)
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


def register_backend_crons() -> None:
    """Schedule the ``cron`` entries of every ``.tasks.SkipjackBackend`` in ``TASKS``."""
    from .tasks import register_crons
    register_crons(get_app())
