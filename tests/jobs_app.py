"""Tasks run by the worker processes of the test suite (``jobs_app:app``).

The schema and DSN come from SKIPJACK_SCHEMA and SKIPJACK_DATABASE_URL. Handlers write to
the test schema's exec_log (start/finish rows) on a connection of their own thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from skipjack import App, Backoff, Discard, Snooze, current_job

SCHEMA = os.environ.get("SKIPJACK_SCHEMA", "skipjack")
app = App(schema=SCHEMA)
_local = threading.local()
_pool: ConnectionPool[Any] | None = None
_pool_lock = threading.Lock()


def _conn() -> psycopg.Connection[Any]:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = _local.conn = app.connect()
    return conn


def log_event(event: str) -> None:
    """Record ``event`` for the current job. A thread's connection that a server restart cut
    is replaced once, so tests of the worker's recovery do not also count its handlers'
    stale connections (each of the ten threads would fail one attempt)."""
    job = current_job().job
    statement = sql.SQL("INSERT INTO {}.exec_log (job_id, attempt, lease_version, worker, pid, "
                        "event) VALUES (%s, %s, %s, %s, %s, %s)").format(sql.Identifier(SCHEMA))
    values = (job.id, job.attempt, job.lease_version, "", os.getpid(), event)
    try:
        _conn().execute(statement, values)
    except psycopg.OperationalError:
        _local.conn.close()
        _conn().execute(statement, values)


@app.task(name="sleep")
def sleep(seconds: float = 0.0) -> None:
    log_event("start")
    time.sleep(seconds)
    log_event("finish")


@app.task(name="short_lease", lease=2.0)
def short_lease(seconds: float = 0.0) -> None:
    sleep(seconds)


@app.task(name="payload")
def payload(data: str) -> None:
    log_event("start")
    assert set(data) == {"a"}
    log_event("finish")


@app.task(name="async_sleep")
async def async_sleep(seconds: float = 0.0) -> None:
    await asyncio.to_thread(log_event, "start")
    await asyncio.sleep(seconds)
    await asyncio.to_thread(log_event, "finish")


@app.task(name="cpu")
def cpu(seconds: float) -> None:
    """Holds the GIL in a tight loop (a CPU-bound sync handler)."""
    log_event("start")
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    log_event("finish")


@app.task(name="cpu_async")
async def cpu_async(seconds: float) -> None:
    """Blocks the event loop itself for ``seconds``."""
    log_event("start")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    log_event("finish")


@app.task(name="fail", max_attempts=3, backoff=Backoff(base=0.01, cap=0.05))
def fail(message: str = "boom", timeout: bool = False) -> None:
    log_event("start")
    if timeout:  # as a socket timeout would
        raise TimeoutError(message)
    raise RuntimeError(message)


@app.task(name="nul", max_attempts=1)
def nul() -> str:
    """Fails with NUL in its message, or (on a retried job) returns NUL in its result."""
    log_event("start")
    if current_job().job.max_attempts == 1:
        raise RuntimeError("bad\x00byte")
    log_event("finish")
    return "result\x00with nul"


def _write_effect(conn: Any) -> None:
    job = current_job().job
    conn.execute(sql.SQL("INSERT INTO {}.effect_rows (job_id, pid) VALUES (%s, %s)").format(
        sql.Identifier(SCHEMA)), (job.id, os.getpid()))


@app.task(name="effect", transaction="complete")
def effect(seconds: float = 0.0) -> None:
    """Writes its effect in the completion's transaction; sleeps only on attempt 1."""
    log_event("start")
    time.sleep(seconds if current_job().job.attempt == 1 else 0)
    _write_effect(current_job().conn)
    log_event("finish")


@app.task(name="effect_until_cancelled", transaction="complete")
def effect_until_cancelled(seconds: float = 0.0) -> None:
    """On attempt 1, waits up to ``seconds`` or until its job is taken from it (a lost
    lease), then writes its effect anyway, as a handler that does not stop when told: the
    completion that would commit the effect must then be refused by fencing."""
    log_event("start")
    if current_job().job.attempt == 1:
        current_job().cancelled.wait(seconds)
    _write_effect(current_job().conn)
    log_event("finish")


@app.task(name="async_effect", transaction="complete")
async def async_effect(seconds: float = 0.0) -> None:
    job = current_job()
    await asyncio.to_thread(log_event, "start")
    await asyncio.sleep(seconds if job.job.attempt == 1 else 0)
    await job.conn.execute(sql.SQL("INSERT INTO {}.effect_rows (job_id, pid) VALUES (%s, %s)")
                           .format(sql.Identifier(SCHEMA)), (job.job.id, os.getpid()))
    await asyncio.to_thread(log_event, "finish")


@app.task(name="held_effect", transaction="claim", lease=2.0)
def held_effect(seconds: float = 0.0, in_statement: bool = False) -> None:
    """Runs inside its claim's transaction (transaction="claim"); on its first start takes
    ``seconds``, asleep or in a statement of that transaction."""
    log_event("start")
    taken = seconds if _starts() == 1 else 0
    if in_statement:
        current_job().conn.execute("SELECT pg_sleep(%s)", [taken])
    else:
        time.sleep(taken)
    _write_effect(current_job().conn)
    log_event("finish")


def _starts() -> int:
    """How often this job has started (held claims roll back their attempt count)."""
    row = _conn().execute(sql.SQL("SELECT count(*) FROM {}.exec_log WHERE job_id = %s AND "
                                  "event = 'start'").format(sql.Identifier(SCHEMA)),
                          [current_job().job.id]).fetchone()
    return int(row[0]) if row else 0


@app.task(name="slow_query")
def slow_query(seconds: float) -> None:
    log_event("start")
    _conn().execute("SELECT pg_sleep(%s)", [seconds])
    log_event("finish")


@app.task(name="slow_async", timeout=0.5, max_attempts=2, backoff=Backoff(base=0.05, cap=0.1))
async def slow_async(seconds: float) -> None:
    await asyncio.to_thread(log_event, "start")
    await asyncio.sleep(seconds)
    await asyncio.to_thread(log_event, "finish")


@app.task(name="slow_sync", timeout=0.5, max_attempts=1)
def slow_sync(seconds: float) -> None:
    log_event("start")
    end = time.monotonic() + seconds
    while time.monotonic() < end and not current_job().cancelled.is_set():
        time.sleep(0.01)
    log_event("finish")


@app.task(name="sync_wait")
def sync_wait(seconds: float) -> None:
    """A sync handler that stops early when its job is cancelled."""
    log_event("start")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        current_job().raise_if_cancelled()
        time.sleep(0.01)
    log_event("finish")


@app.task(name="hang", timeout=0.5, max_attempts=1)
def hang(seconds: float) -> None:
    """Ignores its timeout: the thread stays busy after the attempt failed."""
    log_event("start")
    time.sleep(seconds)


@app.task(name="snooze_once")
def snooze_once() -> None:
    log_event("start")
    if _starts() == 1:
        raise Snooze(0.5)
    log_event("finish")


@app.task(name="stubborn")
async def stubborn() -> None:
    """Swallows cancellation: the worker must still shut down within its grace."""
    log_event("start")
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class LibraryAbort(BaseException):
    """A library's own BaseException, not an Exception (some libraries' timeouts are)."""


def _raise_base_exception(how: str) -> None:
    """Raise the BaseException (not an Exception) that ``how`` names, if it names one."""
    if how == "exit":
        raise SystemExit(3)
    if how == "keyboard":
        raise KeyboardInterrupt()
    if how == "generator_exit":
        raise GeneratorExit()
    if how == "library_abort":
        raise LibraryAbort("aborted")


@app.task(name="misbehave", max_attempts=1)
async def misbehave(how: str) -> str | None:
    """Ways a handler can misbehave that must fail only its own job."""
    log_event("start")
    _raise_base_exception(how)
    if how == "bad_str":
        raise BadStr()
    if how == "cancelled":
        raise asyncio.CancelledError()
    if how == "huge_result":
        return "y" * (2 * 1024 * 1024)
    return None


@app.task(name="deaf", timeout=0.5, max_attempts=1)
async def deaf(seconds: float) -> str:
    """Catches every CancelledError and goes on, for ``seconds``."""
    log_event("start")
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        try:
            await asyncio.sleep(left)
        except asyncio.CancelledError:
            log_event("cancel ignored")
    log_event("finish")
    return "done"


@app.task(name="misbehave_sync", max_attempts=1)
def misbehave_sync(how: str) -> None:
    """``misbehave``'s BaseExceptions, from a sync handler."""
    log_event("start")
    _raise_base_exception(how)


@app.task(name="misbehave_claim", transaction="claim", max_attempts=1)
def misbehave_claim(how: str) -> None:
    """``misbehave``'s BaseExceptions, from a claim-mode handler."""
    log_event("start")
    _raise_base_exception(how)


@app.task(name="pooled")
def pooled(seconds: float) -> None:
    """Holds a transaction on a connection of the application's own small pool."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ConnectionPool(app.dsn, min_size=1, max_size=4, open=True)
    log_event("start")
    with _pool.connection() as conn, conn.transaction():
        conn.execute("SELECT pg_sleep(%s)", [seconds])
    log_event("finish")


def _misbehave(conn: Any, how: str) -> None:
    """End or abort the job's own transaction, as a handler must not."""
    if how in ("COMMIT", "ROLLBACK"):
        conn.execute(how)
        return
    if how in ("COMMIT_BEGIN", "ROLLBACK_BEGIN"):  # and carry on in a transaction of its own
        conn.execute(how.split("_")[0])
        conn.execute("BEGIN")
        return
    try:
        conn.execute("SELECT 1 / 0")
    except psycopg.Error:
        pass  # and go on, with the transaction aborted


@app.task(name="claim_loses_session", transaction="claim", max_attempts=2,
          backoff=Backoff(base=0.2, cap=0.5))
def claim_loses_session(how: str) -> None:
    """Ends its claim's session: terminates its backend ("terminate") or closes the
    connection ("close")."""
    log_event("start")
    conn = current_job().conn
    if how == "terminate":
        conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    else:
        conn.close()
    log_event("finish")


@app.task(name="claim_ok", transaction="claim")
def claim_ok() -> None:
    log_event("start")
    log_event("finish")


@app.task(name="claim_discards", transaction="claim", lease=2.0)
def claim_discards() -> None:
    """Sends its job to the dead letter on its first start; succeeds on the next."""
    log_event("start")
    if _starts() == 1:
        raise Discard("not wanted this time")
    log_event("finish")


@app.task(name="claim_misbehaves", transaction="claim", lease=2.0, max_attempts=2)
def claim_misbehaves(how: str, seconds: float = 0.0) -> None:
    """On its first start, ends or aborts its claim's transaction, then takes ``seconds``."""
    log_event("start")
    if _starts() == 1:
        _misbehave(current_job().conn, how)
        time.sleep(seconds)
    log_event("finish")


@app.task(name="complete_misbehaves", transaction="complete", max_attempts=2)
def complete_misbehaves(how: str, seconds: float = 0.0) -> None:
    """On its first attempt, ends or aborts its completion's transaction; sleeps ``seconds``
    in it on every attempt."""
    log_event("start")
    if current_job().job.attempt == 1:
        _misbehave(current_job().conn, how)
    time.sleep(seconds)
    log_event("finish")
