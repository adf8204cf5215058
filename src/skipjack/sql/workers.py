"""Statements of the live worker registry (the ``workers`` table): each worker's row, kept
fresh by its maintenance thread, and the removal of rows that expired. Only for people:
recovery never reads them."""

from __future__ import annotations

# A worker's row, written when it starts and on every refresh. expires_at is the database's
# now() + ttl seconds: a row not refreshed by then belongs to a worker that is gone. A row of
# the same name from another live process (two workers given one --name) is taken over; the
# statement returns that process's host and pid so the worker can say so (no row: none).
REGISTER_WORKER = """
WITH other AS (
    SELECT host, pid FROM {schema}.workers
     WHERE name = %(name)s AND expires_at >= now()
       AND (host, pid) IS DISTINCT FROM (%(host)s::text, %(pid)s::int)
), written AS (
    INSERT INTO {schema}.workers AS w (name, host, pid, version, queues, concurrency,
                                       expires_at, running, stats)
    VALUES (%(name)s, %(host)s, %(pid)s, %(version)s, %(queues)s::text[], %(concurrency)s,
            now() + make_interval(secs => %(ttl)s), %(running)s, %(stats)s::jsonb)
    ON CONFLICT (name) DO UPDATE
       SET host = EXCLUDED.host, pid = EXCLUDED.pid, version = EXCLUDED.version,
           queues = EXCLUDED.queues, concurrency = EXCLUDED.concurrency,
           started_at = CASE WHEN (w.host, w.pid) = (EXCLUDED.host, EXCLUDED.pid)
                             THEN w.started_at ELSE now() END,
           last_seen = now(), expires_at = EXCLUDED.expires_at, running = EXCLUDED.running,
           stats = EXCLUDED.stats
    RETURNING 1
)
SELECT host, pid FROM other WHERE EXISTS (SELECT 1 FROM written)
"""

# Only this process's row: another process may have taken the name over.
UNREGISTER_WORKER = """
DELETE FROM {schema}.workers WHERE name = %(name)s AND host = %(host)s AND pid = %(pid)s
"""

# Rows of workers that stopped without saying so (killed, cut off), removed by any worker.
EXPIRE_WORKERS = "DELETE FROM {schema}.workers WHERE expires_at < now() RETURNING name"

LIST_WORKERS = """
SELECT name, host, pid, version, queues, concurrency, running, started_at, last_seen, stats
  FROM {schema}.workers WHERE expires_at >= now() ORDER BY started_at, name
"""
