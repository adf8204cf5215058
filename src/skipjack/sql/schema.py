"""Statements about the schema itself: migrations, its version, the database clock, and
LISTEN/NOTIFY checks."""

from __future__ import annotations

from psycopg import sql

# The database clock, which every time skipjack computes is read from.
DB_NOW = "SELECT now()"

# The database clock as seconds since 1970-01-01 UTC, at the moment the statement runs: how
# far a worker's clock is from it (the due-time notifications give the database's times).
DB_EPOCH = "SELECT extract(epoch FROM clock_timestamp())::float8"

DROP_SCHEMA = "DROP SCHEMA IF EXISTS {schema} CASCADE"

SCHEMA_VERSION = """
SELECT max(version) FROM {schema}.migrations
"""

SCHEMA_EXISTS = """
SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = %(schema)s AND tablename = 'migrations')
"""
# Transaction-scoped: released at commit or rollback, safe through a transaction pooler.
MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(%(key)s)"

# The longest a migration's transaction waits for each lock it takes (milliseconds, as text):
# set after it holds the advisory lock, so that a wait for a table lock gives up instead of
# queueing the queue's own statements behind its request for long.
SET_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', %(timeout)s, true)"

# The sessions holding locks on the schema's tables, oldest transaction first: who a
# migration's lock request waited for.
LOCK_HOLDERS = """
SELECT l.pid, a.application_name, a.state, a.xact_start, a.query_start,
       string_agg(DISTINCT l.mode || ' on ' || c.relname, ', ') AS locks
  FROM pg_locks AS l
  JOIN pg_class AS c ON c.oid = l.relation
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
  LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
 WHERE l.locktype = 'relation' AND l.granted AND n.nspname = %(schema)s
   AND c.relkind IN ('r', 'p') AND l.pid <> pg_backend_pid()
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
 GROUP BY l.pid, a.application_name, a.state, a.xact_start, a.query_start
 ORDER BY a.xact_start NULLS LAST, l.pid
 LIMIT %(limit)s
"""

# The schema, unless it exists: CREATE SCHEMA IF NOT EXISTS checks the CREATE privilege on
# the database even when the schema exists, which an owner given its schema by a DBA
# (CREATE SCHEMA ... AUTHORIZATION) lacks. {name} is the schema's name as a literal.
CREATE_SCHEMA = """
DO $create$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = {name}) THEN
        CREATE SCHEMA {schema};
    END IF;
END $create$
"""

CREATE_MIGRATIONS_TABLE = """
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

# The listener's check that its connection is alive after a silence.
PING = "SELECT 1"

# A round trip through LISTEN/NOTIFY, to check notifications reach the worker's sessions;
# sent only while the notification queue has room (one row when sent, none when not).
PROBE_NOTIFY = "SELECT pg_notify(%(channel)s, 'probe') WHERE {schema}.may_notify()"


def listen_statement(channel: str) -> sql.Composed:
    """``LISTEN channel`` with the channel quoted as an identifier."""
    return sql.SQL("LISTEN {}").format(sql.Identifier(channel))
