"""The SQL that only the tools run (the demo, ``skipjack chaos`` and the benchmarks).

Each statement is a template in which ``{schema}`` stands for the quoted schema name; values
are always bound parameters (``%(name)s``), never interpolated. :func:`render` fills in the
schema with :mod:`psycopg.sql`, as the library does with its own statements, and keeps each
result (UTF-8 bytes) for the next call.
"""

from __future__ import annotations

import functools

from psycopg import sql

# Empty a tool's own schema before a run (the demo, chaos) or after it (a benchmark).
DROP_SCHEMA = "DROP SCHEMA IF EXISTS {schema} CASCADE"

# Before each benchmark scenario: write out what earlier scenarios left dirty (a checkpoint
# spread over minutes otherwise slows the next scenario's commits), then see whether an
# autovacuum worker is still busy with the tables of an earlier one.
CHECKPOINT = "CHECKPOINT"
AUTOVACUUMS = "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"

# Totals over a whole run of the demo: jobs that needed more than one
# attempt, and seconds from the first enqueue to the last finish.
RUN_SUMMARY = """
SELECT count(*) FILTER (WHERE attempt > 1) AS retried,
       extract(epoch FROM max(finished_at) - min(created_at))::float8 AS span_seconds
  FROM {schema}.jobs
"""

# --- chaos (fault-injection audit) ---------------------------------------------------------

# starts: one row per handler start; effects: one row per committed effect, deliberately
# without a unique constraint so that a duplicate would be counted, not refused.
CHAOS_TABLES = """
CREATE TABLE {schema}.chaos_starts (job_id bigint NOT NULL, attempt int NOT NULL,
    lease_version bigint NOT NULL, pid int NOT NULL, at timestamptz NOT NULL DEFAULT now());
CREATE TABLE {schema}.chaos_effects (job_id bigint NOT NULL, pid int NOT NULL,
    at timestamptz NOT NULL DEFAULT now())
"""

CHAOS_START = """
INSERT INTO {schema}.chaos_starts (job_id, attempt, lease_version, pid)
VALUES (%(job_id)s, %(attempt)s, %(lease_version)s, %(pid)s)
"""

CHAOS_EFFECT = "INSERT INTO {schema}.chaos_effects (job_id, pid) VALUES (%(job_id)s, %(pid)s)"

CHAOS_AUDIT = """
SELECT (SELECT count(*) FROM {schema}.jobs) AS rows,
       (SELECT count(*) FROM {schema}.jobs WHERE state = 'succeeded') AS completed,
       (SELECT count(*) FROM {schema}.jobs WHERE state = 'discarded') AS discarded,
       (SELECT count(*) FROM {schema}.jobs
         WHERE state IN ('scheduled', 'available', 'running')) AS unfinished,
       (SELECT count(*) FROM {schema}.jobs
         WHERE state = 'running' AND lease_expires_at < now()) AS stuck,
       (SELECT coalesce(sum(n - 1), 0)::bigint
          FROM (SELECT count(*) AS n FROM {schema}.chaos_effects GROUP BY job_id) AS e
       ) AS duplicate_effects,
       (SELECT count(*) FROM {schema}.jobs j WHERE state = 'succeeded' AND NOT EXISTS
          (SELECT 1 FROM {schema}.chaos_effects e WHERE e.job_id = j.id)) AS missing_effects,
       (SELECT count(*) - count(DISTINCT job_id) FROM {schema}.chaos_starts) AS duplicate_starts,
       (SELECT coalesce(max(attempt), 0) FROM {schema}.jobs) AS max_attempt
"""

# Attempts that graceful stops spent: rescues (a lease that expired) of jobs held by a worker
# after it was SIGTERMed (pid and time given as arrays: the worker's name is host:pid:...).
CHAOS_GRACEFUL_LOSSES = """
SELECT count(*)
  FROM {schema}.jobs AS j, jsonb_array_elements(j.errors) AS e,
       unnest(%(pids)s::int[], %(stopped_at)s::float8[]) AS t(pid, at)
 WHERE e->>'error' LIKE 'lease expired%%'
   AND split_part(e->>'worker', ':', 2) = t.pid::text
   AND (e->>'at')::timestamptz >= to_timestamp(t.at)
"""

CHAOS_FINISHED = """
SELECT count(*) FROM {schema}.jobs WHERE state IN ('succeeded', 'discarded')
"""

# Cut every session of one application (the workers of one chaos run), not our own.
TERMINATE_BACKENDS = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
 WHERE application_name = %(application_name)s AND pid <> pg_backend_pid()
"""


@functools.lru_cache(maxsize=256)
def render(template: str, schema: str) -> bytes:
    """One of the templates above rendered for ``schema``, as UTF-8 encoded SQL text
    (``bytes``, which psycopg sends as is); the result is cached per template and schema.

    Args:
        template: SQL text (``str``) with ``{schema}`` placeholders; literal braces written
            doubled.
        schema: the schema name (``str``), quoted with :class:`psycopg.sql.Identifier`,
            never interpolated.

    Raises:
        KeyError: the template holds a placeholder other than ``{schema}``.
    """
    return sql.SQL(template).format(schema=sql.Identifier(schema)).as_string().encode()
