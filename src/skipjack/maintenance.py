"""The rescuer: returns jobs whose lease expired to their queue, or to the dead letter.

It reads only the job row (lease expiry and fencing token), never a worker registry, so a
crashed worker's jobs are recovered whatever name the next worker has. Safe to run in every
worker at once: candidates are locked with SKIP LOCKED and each write is guarded by the token
read in the first step (see ``RESCUE`` in :mod:`skipjack.queries`).
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from .queries import Queries

log = logging.getLogger("skipjack.rescuer")


def rescue(
    conn: psycopg.Connection[Any], queries: Queries, limit: int = 1000
) -> list[tuple[int, str]]:
    """Rescue up to ``limit`` jobs whose lease expired.

    Args:
        conn: an autocommit connection.
        queries: the statements of the app's schema.
        limit: the most jobs handled in one call.

    Returns:
        (job id, new state) for each job moved: ``available`` or ``discarded`` (last attempt).

    Raises:
        psycopg.Error: the database could not be reached; nothing was changed.
    """
    candidates = conn.execute(queries.RESCUE_CANDIDATES, {"limit": limit}).fetchall()
    if not candidates:
        return []
    rows = conn.execute(
        queries.RESCUE,
        {"id": [c[0] for c in candidates], "lease_version": [c[1] for c in candidates]},
    ).fetchall()
    for job_id, state in rows:
        log.warning("rescued job %s (lease expired) -> %s", job_id, state)
    return [(r[0], r[1]) for r in rows]
