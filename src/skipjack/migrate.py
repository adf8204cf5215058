"""Numbered schema migrations, applied under a transaction-scoped advisory lock.

Migrations are the files ``migrations/NNNN_name.sql`` in this package. ``migrate`` first
reads which versions the schema has, taking no lock stronger than a read of the
``migrations`` table: when nothing is missing it is done, having run no DDL and taken no
advisory lock. Otherwise it runs every missing migration in a single transaction that first
takes ``pg_advisory_xact_lock`` on a key derived from the schema name, so any number of
processes may migrate at once: one applies, the others wait, then find nothing left to do.
The lock is released at commit and works through a transaction-mode pooler.

Inside that transaction every lock is taken with a short ``lock_timeout``. A migration that
alters ``jobs`` needs an ACCESS EXCLUSIVE lock on it; while its request waits (say behind a
backup's ACCESS SHARE lock), every enqueue, claim and read of the table queues behind the
request. With the timeout the request gives up instead, the transaction rolls back, and the
queue's statements go on; the migration tries again after a backoff, a bounded number of
times, then raises ``skipjack.errors.MigrationLockError`` naming the sessions that
hold locks on the schema's tables.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql

from .channels import channel_name, done_channel_name, due_channel_name
from .db import ReconnectDelay, connection_lost
from .errors import MigrationError, MigrationLockError, SchemaVersionError, ValidationError
from .sql import Queries, render
from .sql.schema import CREATE_SCHEMA

log = logging.getLogger("skipjack.migrate")

# How long each lock wait of a migration lasts at most (seconds), how many times a migration
# whose wait timed out is tried, and the backoff between tries (seconds, doubling, jittered).
LOCK_TIMEOUT = 3.0
LOCK_ATTEMPTS = 5
LOCK_TIMEOUT_MAX = 600.0
LOCK_ATTEMPTS_MAX = 100
RETRY_BASE = 0.5
RETRY_CAP = 4.0

# The most lock holders named in an error.
HOLDERS_SHOWN = 5


@dataclass(frozen=True)
class Migration:
    """One numbered migration file."""

    version: int
    name: str
    text: str


def migrations() -> list[Migration]:
    """The migrations shipped with this package, in version order."""
    found = []
    for entry in resources.files("skipjack.migrations").iterdir():
        m = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text("utf-8")))
    return sorted(found, key=lambda m: m.version)


LATEST_VERSION = migrations()[-1].version


def _lock_key(schema: str) -> int:
    digest = hashlib.sha1(b"skipjack.migrate:" + schema.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class _LockFailed(Exception):
    """One attempt's lock wait timed out or deadlocked, during ``step``."""

    def __init__(self, step: str, cause: psycopg.Error) -> None:
        self.step = step
        self.cause = cause
        super().__init__(step)


def check_lock_options(lock_timeout: float, attempts: int) -> None:
    """Validate the lock options of ``migrate``.

    Raises:
        ValidationError: ``lock_timeout`` is not in 0.001..600 seconds, or ``attempts`` not
            in 1..100.
    """
    if not (isinstance(lock_timeout, int | float)
            and 0.001 <= lock_timeout <= LOCK_TIMEOUT_MAX):
        raise ValidationError("lock_timeout", f"{lock_timeout!r} seconds is out of range "
                                              f"0.001..{LOCK_TIMEOUT_MAX:g}")
    if not (isinstance(attempts, int) and 1 <= attempts <= LOCK_ATTEMPTS_MAX):
        raise ValidationError("attempts", f"{attempts!r} is out of range 1..{LOCK_ATTEMPTS_MAX}")


def migrate(conn: psycopg.Connection[Any], schema: str, *, lock_timeout: float = LOCK_TIMEOUT,
            attempts: int = LOCK_ATTEMPTS) -> list[int]:
    """Apply every missing migration to ``schema`` and commit.

    Args:
        conn: a connection with no transaction open; it is left with none open.
        schema: the schema to create or upgrade.
        lock_timeout: seconds, 0.001..600: the longest each lock wait of an attempt lasts
            (the wait for another process's migration, under the advisory lock, excepted).
        attempts: 1..100: how many times to try when a lock wait timed out or deadlocked,
            with a backoff of 0.5 s doubling up to 4 s (jittered) between tries.

    Returns:
        The versions applied by this call (empty when the schema was up to date).

    Raises:
        ValidationError: ``lock_timeout`` or ``attempts`` out of range.
        SchemaVersionError: the schema is newer than this code knows.
        MigrationLockError: every attempt timed out (or deadlocked) waiting for a lock; the
            message names the sessions holding locks on the schema's tables.
        MigrationError: the database refused a statement; the transaction is rolled back and
            nothing of this call is kept.
        psycopg.OperationalError: the connection to the database was lost.
    """
    check_lock_options(lock_timeout, attempts)
    q = Queries(schema)
    delays = ReconnectDelay(base=RETRY_BASE, cap=RETRY_CAP)
    for attempt in range(1, attempts + 1):
        try:
            return _migrate_once(conn, schema, q, lock_timeout)
        except _LockFailed as failed:
            holders = _lock_holders(conn, q, schema)
            if attempt == attempts:
                raise MigrationLockError(
                    _lock_message(schema, failed, holders, lock_timeout, attempts),
                    [h.pid for h in holders]) from failed.cause
            delay = delays.next()
            log.warning("migrate %s: %s: %s (attempt %d of %d); %s; trying again in %.1f s",
                        schema, failed.step, _lock_failure(failed, lock_timeout), attempt,
                        attempts, _holders_text(holders), delay)
            time.sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _migrate_once(conn: psycopg.Connection[Any], schema: str, q: Queries,
                  lock_timeout: float) -> list[int]:
    """One attempt of ``migrate``.

    Raises:
        _LockFailed: a lock wait timed out or deadlocked (everything rolled back).
    """
    timeout = {"timeout": f"{max(1, round(lock_timeout * 1000))}ms"}
    step = "reading the applied migrations"
    try:
        # No lock beyond a read of the migrations table while the schema is up to date.
        with conn.transaction():
            conn.execute(q.SET_LOCK_TIMEOUT, timeout)
            applied = _applied(conn, q, schema)
        if applied is not None and _up_to_date(schema, applied):
            return []
        applied_now: list[int] = []
        with conn.transaction():
            step = "waiting for another process's migration (advisory lock)"
            conn.execute(q.MIGRATION_LOCK, {"key": _lock_key(schema)})
            conn.execute(q.SET_LOCK_TIMEOUT, timeout)
            step = "creating the schema and its migrations table"
            conn.execute(_create_schema(schema))
            conn.execute(q.CREATE_MIGRATIONS_TABLE)
            step = "reading the applied migrations"
            applied = {row[0] for row in conn.execute(q.APPLIED_MIGRATIONS).fetchall()}
            if _up_to_date(schema, applied):  # another process applied them meanwhile
                return []
            for m in migrations():
                if m.version in applied:
                    continue
                step = f"migration {m.version} ({m.name})"
                conn.execute(_rendered(m, schema))
                conn.execute(q.RECORD_MIGRATION, {"version": m.version, "name": m.name})
                applied_now.append(m.version)
        return applied_now
    except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as exc:
        raise _LockFailed(step, exc) from exc
    except psycopg.Error as exc:
        if connection_lost(exc):
            raise
        raise MigrationError(f"schema {schema!r}: {step} failed, nothing of this call was "
                             f"applied: {_db_error(exc)}") from exc


def _applied(conn: psycopg.Connection[Any], q: Queries, schema: str) -> set[int] | None:
    """The versions applied to ``schema``, or None when it has no migrations table."""
    row = conn.execute(q.SCHEMA_EXISTS, {"schema": schema}).fetchone()
    if not (row and row[0]):
        return None
    return {r[0] for r in conn.execute(q.APPLIED_MIGRATIONS).fetchall()}


def _create_schema(schema: str) -> sql.Composed:
    """The statement creating ``schema`` unless it exists (see ``sql.schema.CREATE_SCHEMA``)."""
    return render(CREATE_SCHEMA, schema, name=schema)


def _rendered(m: Migration, schema: str) -> sql.Composed:
    """A migration's text for ``schema``, with its channel names filled in."""
    return render(m.text, schema, channel=channel_name(schema),
                  done_channel=done_channel_name(schema), due_channel=due_channel_name(schema))


def pending(conn: psycopg.Connection[Any], schema: str) -> list[Migration]:
    """The migrations not yet applied to ``schema``, in order (all of them for a schema
    that has none); only reads.

    Raises:
        SchemaVersionError: the schema is newer than this code knows.
    """
    q = Queries(schema)
    applied = _applied(conn, q, schema) or set()
    _up_to_date(schema, applied)  # raises for a newer schema
    return [m for m in migrations() if m.version not in applied]


def pending_sql(conn: psycopg.Connection[Any], schema: str, todo: list[Migration]) -> str:
    """The SQL that applies ``todo`` to ``schema`` as ``migrate`` would, for a DBA to
    review and run with psql: one transaction, under the same advisory lock, each migration
    followed by its record in the migrations table. Empty when ``todo`` is."""
    if not todo:
        return ""
    q = Queries(schema)
    bind = psycopg.ClientCursor(conn).mogrify  # the statements with their values, as text
    parts = [f"-- skipjack migrations {[m.version for m in todo]} for schema {schema!r}",
             "BEGIN;", bind(q.MIGRATION_LOCK, {"key": _lock_key(schema)}) + ";",
             _create_schema(schema).as_string(conn).strip() + ";",
             q.CREATE_MIGRATIONS_TABLE.decode().strip() + ";"]
    for m in todo:
        parts.append(f"-- {m.version:04d}_{m.name}")
        parts.append(_rendered(m, schema).as_string(conn).strip())
        parts.append(bind(q.RECORD_MIGRATION, {"version": m.version, "name": m.name}).strip()
                     + ";")
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"


def _up_to_date(schema: str, applied: set[int]) -> bool:
    """Whether every shipped migration is in ``applied``.

    Raises:
        SchemaVersionError: ``applied`` holds a version newer than this code knows.
    """
    if applied and max(applied) > LATEST_VERSION:
        raise SchemaVersionError(_too_new(schema, max(applied)))
    return {m.version for m in migrations()} <= applied


@dataclass(frozen=True)
class LockHolder:
    """A session seen holding locks on a table of the schema (any field but ``pid`` may be
    None when the role may not see the other session's activity)."""

    pid: int
    application_name: str | None
    state: str | None
    xact_start: datetime | None
    query_start: datetime | None
    locks: str  # e.g. "AccessShareLock on jobs"

    def describe(self) -> str:
        """One line for people: pid, application name, state, start times and locks."""
        def when(value: datetime | None) -> str:
            return value.isoformat(timespec="seconds") if value is not None else "unknown"

        return (f"pid {self.pid} (application_name {self.application_name!r}, state "
                f"{self.state!r}, transaction started {when(self.xact_start)}, query started "
                f"{when(self.query_start)}) holds {self.locks}")


def _lock_holders(conn: psycopg.Connection[Any], q: Queries, schema: str) -> list[LockHolder]:
    """The sessions holding locks on the schema's tables now, oldest transaction first.

    Raises:
        psycopg.OperationalError: the connection was lost.
    """
    try:
        with conn.transaction():
            rows = conn.execute(q.LOCK_HOLDERS, {"schema": schema,
                                                 "limit": HOLDERS_SHOWN}).fetchall()
    except psycopg.Error as exc:
        if connection_lost(exc):
            raise
        log.warning("migrate %s: cannot read the sessions holding locks: %s", schema, exc)
        return []
    return [LockHolder(*row) for row in rows]


def _lock_failure(failed: _LockFailed, lock_timeout: float) -> str:
    if isinstance(failed.cause, psycopg.errors.DeadlockDetected):
        return "deadlocked with another session"
    return f"a lock wait gave up after {lock_timeout:g} s"


def _holders_text(holders: list[LockHolder]) -> str:
    if not holders:
        return ("no session holding a lock on the schema's tables was seen (it ended "
                "meanwhile, is a prepared transaction, or its lock is on another object)")
    return "; ".join(h.describe() for h in holders)


def _lock_message(schema: str, failed: _LockFailed, holders: list[LockHolder],
                  lock_timeout: float, attempts: int) -> str:
    tables = sorted({lock.rsplit(" on ", 1)[-1] for h in holders
                     for lock in h.locks.split(", ")})
    what = (f"a session holds a lock on table {', '.join(tables)}" if holders
            else "a session holds a lock on one of its tables")
    end = (f", or end it (SELECT pg_terminate_backend({holders[0].pid}) ends the oldest)"
           if holders else "")
    return (f"schema {schema!r} is not migrated: {failed.step} could not take its locks in "
            f"{attempts} attempt{'s' if attempts != 1 else ''} "
            f"(the last: {_lock_failure(failed, lock_timeout)}): {what}: "
            f"{_holders_text(holders)}. Nothing was applied, and the queue kept running. "
            f"Run `skipjack migrate` again once that session has ended{end}.")


def _db_error(exc: psycopg.Error) -> str:
    """The database's error for people: SQLSTATE and message (and its detail, if any)."""
    text = (exc.diag.message_primary or str(exc)).strip()
    detail = exc.diag.message_detail
    return f"{exc.sqlstate or 'error'}: {text}" + (f" ({detail})" if detail else "")


def check_schema(conn: psycopg.Connection[object], schema: str) -> None:
    """Refuse to run against a schema that is missing, older or newer than this code.

    Raises:
        SchemaVersionError: with what to do (run ``skipjack migrate``, or upgrade skipjack).
    """
    q = Queries(schema)
    row = conn.execute(q.SCHEMA_EXISTS, {"schema": schema}).fetchone()
    version = None
    if row and row[0]:  # type: ignore[index]
        version = conn.execute(q.SCHEMA_VERSION).fetchone()[0]  # type: ignore[index]
    if version is None:
        raise SchemaVersionError(
            f"schema {schema!r} has no skipjack tables: migrate it first (`skipjack migrate "
            "MODULE:APP`, or `skipjack migrate` with this --dsn and --schema, or "
            "App.migrate())"
        )
    if version > LATEST_VERSION:
        raise SchemaVersionError(_too_new(schema, version))
    if version < LATEST_VERSION:
        raise SchemaVersionError(
            f"schema {schema!r} is at version {version}, this skipjack needs {LATEST_VERSION}: "
            "run `skipjack migrate`"
        )


def _too_new(schema: str, version: int) -> str:
    return (
        f"schema {schema!r} is at version {version}, newer than this skipjack "
        f"(which knows up to {LATEST_VERSION}): upgrade skipjack in this process"
    )
