"""The task run by the failover test's workers (``failover_app:app``).

The schema and DSN come from SKIPJACK_SCHEMA and SKIPJACK_DATABASE_URL (the cluster's
multi-host DSN). Each start of the handler is written twice: first as a line of the file
$SKIPJACK_HA_STARTS (outside the database, so a start under a claim that a failover undid is
still seen), then as an exec_log row; the effect is written in the completion's transaction.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

from skipjack import App, Backoff, current_job

SCHEMA = os.environ.get("SKIPJACK_SCHEMA", "skipjack")
STARTS = os.environ.get("SKIPJACK_HA_STARTS", os.devnull)
app = App(schema=SCHEMA)
_local = threading.local()


def record_start() -> None:
    """Append ``job_id attempt lease_version pid`` to the starts file (one write: whole
    lines, whatever other threads and processes append)."""
    job = current_job().job
    line = f"{job.id} {job.attempt} {job.lease_version} {os.getpid()}\n".encode()
    fd = os.open(STARTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def log_event(event: str) -> None:
    """An exec_log row for the current job, on this thread's own connection; a connection
    that failed is dropped (the next call opens a new one) and the error raised, which fails
    the attempt."""
    job = current_job().job
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed or conn.broken:
        conn = _local.conn = app.connect()
    statement = sql.SQL("INSERT INTO {}.exec_log (job_id, attempt, lease_version, worker, pid, "
                        "event) VALUES (%s, %s, %s, '', %s, %s)").format(sql.Identifier(SCHEMA))
    try:
        conn.execute(statement, (job.id, job.attempt, job.lease_version, os.getpid(), event))
    except psycopg.OperationalError:
        conn.close()
        raise


@app.task(name="ha.effect", transaction="complete", max_attempts=100,
          backoff=Backoff(base=0.05, cap=0.5))
def effect(seconds: float = 0.02) -> None:
    """Record the start, work ``seconds``, write the effect in the completion's transaction."""
    record_start()
    log_event("start")
    time.sleep(seconds)
    job = current_job()
    job.conn.execute(sql.SQL("INSERT INTO {}.effect_rows (job_id, pid) VALUES (%s, %s)").format(
        sql.Identifier(SCHEMA)), (job.job.id, os.getpid()))
    log_event("finish")
