"""Numbered schema migrations, applied under a transaction-scoped advisory lock.

Migrations are the files ``migrations/NNNN_name.sql`` in this package. :func:`migrate` runs
every missing one in a single transaction that first takes ``pg_advisory_xact_lock`` on a key
derived from the schema name, so any number of processes may migrate at once: one applies,
the others wait, then find nothing left to do. The lock is released at commit and works
through a transaction-mode pooler.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

import psycopg

from .db import channel_name
from .errors import SchemaVersionError
from .sql import Queries, render


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


def migrate(conn: psycopg.Connection[object], schema: str) -> list[int]:
    """Apply every missing migration to ``schema`` and commit.

    Args:
        conn: a connection with no transaction open; it is left with none open.
        schema: the schema to create or upgrade.

    Returns:
        The versions applied by this call (empty when the schema was up to date).

    Raises:
        SchemaVersionError: the schema is newer than this code knows.
        psycopg.Error: the database refused a statement; the transaction is rolled back and
            nothing of this call is kept.
    """
    q = Queries(schema)
    applied_now: list[int] = []
    with conn.transaction():
        conn.execute(q.MIGRATION_LOCK, {"key": _lock_key(schema)})
        conn.execute(q.CREATE_MIGRATIONS_TABLE)
        applied = {row[0] for row in conn.execute(q.APPLIED_MIGRATIONS).fetchall()}  # type: ignore[index]
        if applied and max(applied) > LATEST_VERSION:
            raise SchemaVersionError(_too_new(schema, max(applied)))
        for m in migrations():
            if m.version in applied:
                continue
            conn.execute(render(m.text, schema, channel=channel_name(schema)))
            conn.execute(q.RECORD_MIGRATION, {"version": m.version, "name": m.name})
            applied_now.append(m.version)
    return applied_now


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
            f"schema {schema!r} has no skipjack tables: run `skipjack migrate` "
            "(or App.migrate()) first"
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
