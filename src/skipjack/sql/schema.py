"""Statements about the schema itself: migrations, its version, the database clock, and
LISTEN/NOTIFY checks."""

from __future__ import annotations

from psycopg import sql

# The database clock, which every time skipjack computes is read from.
DB_NOW = "SELECT now()"

DROP_SCHEMA = "DROP SCHEMA IF EXISTS {schema} CASCADE"

SCHEMA_VERSION = """
SELECT max(version) FROM {schema}.migrations
"""

SCHEMA_EXISTS = """
SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = %(schema)s AND tablename = 'migrations')
"""
# Transaction-scoped: released at commit or rollback, safe through a transaction pooler.
MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(%(key)s)"

CREATE_MIGRATIONS_TABLE = """
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""

APPLIED_MIGRATIONS = "SELECT version FROM {schema}.migrations ORDER BY version"

RECORD_MIGRATION = """
INSERT INTO {schema}.migrations (version, name) VALUES (%(version)s, %(name)s)
"""

# A round trip through LISTEN/NOTIFY, to check notifications reach the worker's sessions;
# sent only while the notification queue has room (one row when sent, none when not).
PROBE_NOTIFY = "SELECT pg_notify(%(channel)s, 'probe') WHERE {schema}.may_notify()"


def listen_statement(channel: str) -> sql.Composed:
    """``LISTEN channel`` with the channel quoted as an identifier."""
    return sql.SQL("LISTEN {}").format(sql.Identifier(channel))
