"""Waiting for a job's outcome: ``JobHandle``, which every enqueue returns.

A waiter marks its job ``awaited``; the job's end (whoever records it: a worker, a rescuer,
a cancel or discard by hand) then sends a notification on the schema's channel for ends
(migration 6), which one listener thread per app hands to every waiter of that job. Waiters
also read the job again every ``POLL_INTERVAL`` seconds, so a missed notification (a
full notification queue, a lost listener connection) only delays them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg

from .channels import channel_name, done_channel_name
from .db import ReconnectDelay
from .errors import JobFailed, JobNotFound, ResultTimeout, ValidationError
from .sql.schema import listen_statement

if TYPE_CHECKING:
    from .admin import Admin

log = logging.getLogger("skipjack.results")

POLL_INTERVAL = 1.0  # seconds between a waiter's reads of its job, notification or not
MARK_RETRY = 0.005  # seconds before a mark that met a locked row is tried again (doubling)
LISTEN_WAIT = 1.0  # seconds a first waiter waits for the listener's LISTEN before reading
FINISHED = frozenset({"succeeded", "discarded", "cancelled"})


class JobHandle(int):
    """The id of an enqueued job (an ``int``: it compares, hashes, serialises and binds as
    the id), with a way to wait for the job's outcome and read its progress.

    Handles are made by enqueue; ``skipjack.App.job_handle`` makes one for any id.
    """

    app: Admin

    def __new__(cls, job_id: int, app: Admin) -> JobHandle:
        handle = super().__new__(cls, job_id)
        handle.app = app
        return handle

    def __repr__(self) -> str:
        return f"JobHandle({int(self)})"

    def __str__(self) -> str:  # the id, as for an int
        return int.__repr__(self)

    def __reduce__(self) -> tuple[type[int], tuple[int]]:  # pickles as the bare id
        return int, (int(self),)

    @property
    def id(self) -> int:
        """The job's id."""
        return int(self)

    def state(self) -> str:
        """The job's state now: scheduled, available, running, succeeded, discarded or
        cancelled.

        Raises:
            JobNotFound: no job has this id (see ``skipjack.errors.JobNotFound``).
        """
        return str(_read(self.app, int(self))["state"])

    def progress(self) -> Any:
        """The latest progress the job's handler reported
        (``skipjack.JobContext.progress``), None if none yet.

        Raises:
            JobNotFound: no job has this id.
        """
        return _read(self.app, int(self))["progress"]

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the job to end; return its handler's return value (as stored: JSON
        values as they were, anything else as its ``repr``; see
        ``skipjack.jobs.dump_result``).

        Woken by a notification within milliseconds of the job's end, else by a read every
        second. Waiting changes nothing about the job, and a job enqueued in a transaction
        of the caller's that is still open cannot run: commit first.

        Args:
            timeout: seconds to wait at most (None: as long as it takes).

        Raises:
            ValidationError: ``timeout`` is negative or not a number.
            JobFailed: the job was discarded (its errors attached) or cancelled.
            ResultTimeout: it had not ended within ``timeout`` (it goes on).
            JobNotFound: no job has this id.
            psycopg.OperationalError: the database could not be reached.
        """
        deadline = _deadline(timeout)
        listener = _listener(self.app)
        event = threading.Event()
        listener.add(int(self), event.set)
        try:
            listener.wait_listening(min(LISTEN_WAIT, _left(deadline)))
            retry = None if _mark(self.app, int(self)) else MARK_RETRY
            while True:
                row = _read(self.app, int(self))
                wait = _next_wait(int(self), row, deadline, timeout, retry)
                if wait is None:
                    return _outcome(int(self), row)
                event.wait(wait)
                event.clear()
                if retry is not None:
                    retry = None if _mark(self.app, int(self)) else _later(retry)
        finally:
            listener.remove(int(self), event.set)

    async def result_async(self, timeout: float | None = None) -> Any:
        """``result`` for a coroutine: the event loop runs on while it waits (the reads
        run in a thread)."""
        deadline = _deadline(timeout)
        listener = _listener(self.app)
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

        listener.add(int(self), wake)
        try:
            await asyncio.to_thread(listener.wait_listening, min(LISTEN_WAIT, _left(deadline)))
            marked = await asyncio.to_thread(_mark, self.app, int(self))
            retry = None if marked else MARK_RETRY
            while True:
                row = await asyncio.to_thread(_read, self.app, int(self))
                wait = _next_wait(int(self), row, deadline, timeout, retry)
                if wait is None:
                    return _outcome(int(self), row)
                try:
                    await asyncio.wait_for(event.wait(), wait)
                except TimeoutError:
                    pass
                event.clear()
                if retry is not None:
                    marked = await asyncio.to_thread(_mark, self.app, int(self))
                    retry = None if marked else _later(retry)
        finally:
            listener.remove(int(self), wake)


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise ValidationError("timeout", f"{timeout!r} must be seconds >= 0, or None")
    return time.monotonic() + timeout


def _left(deadline: float | None) -> float:
    return float("inf") if deadline is None else deadline - time.monotonic()


def _next_wait(job_id: int, row: dict[str, Any], deadline: float | None,
               timeout: float | None, retry: float | None = None) -> float | None:
    """Seconds to wait before reading the job again (at most ``retry``, when the mark is
    still to be made); None once it ended.

    Raises:
        ResultTimeout: it has not ended and the deadline passed.
    """
    if row["state"] in FINISHED:
        return None
    left = _left(deadline)
    if left <= 0:
        raise ResultTimeout(f"job {job_id} had not ended within {timeout}s "
                            f"(it is {row['state']})")
    return min(POLL_INTERVAL, left, POLL_INTERVAL if retry is None else retry)


def _later(retry: float) -> float:
    """The next wait before a mark is tried again: doubling, up to ``POLL_INTERVAL``."""
    return min(2 * retry, POLL_INTERVAL)


def _mark(app: Admin, job_id: int) -> bool:
    """Mark the job awaited (see ``MARK_AWAITED``); whether the mark is done (False: its row
    was locked, try again)."""
    with app.reading() as conn:
        rows = conn.execute(app.queries.MARK_AWAITED,
                            {"id": job_id, "channel": channel_name(app.queries.schema)}
                            ).fetchall()
        if not conn.autocommit:
            conn.commit()  # the mark must be visible before the job's end is written
    return bool(rows)


def _read(app: Admin, job_id: int) -> dict[str, Any]:
    with app.reading() as conn:
        row = conn.execute(app.queries.JOB_OUTCOME, {"id": job_id}).fetchone()
    if row is None:
        raise JobNotFound(f"no job {job_id}")
    state, result, errors, progress, attempt, max_attempts = row
    return {"state": state, "result": result, "errors": errors, "progress": progress,
            "attempt": attempt, "max_attempts": max_attempts}


def _outcome(job_id: int, row: dict[str, Any]) -> Any:
    if row["state"] == "succeeded":
        return row["result"]
    raise JobFailed(job_id, row["state"], list(row["errors"] or []))


# --- the listener ---------------------------------------------------------------------------

_LISTENERS: dict[int, Listener] = {}
_LISTENERS_LOCK = threading.Lock()


def close_listener(app: Admin) -> None:
    """Stop the listener of ``app``'s waiters, if it runs (``skipjack.App.close``)."""
    with _LISTENERS_LOCK:
        listener = _LISTENERS.get(id(app))
    if listener is not None and listener.app is app:
        listener.close()


def _listener(app: Admin) -> Listener:
    with _LISTENERS_LOCK:
        listener = _LISTENERS.get(id(app))
        if listener is None or listener.app is not app:
            listener = _LISTENERS[id(app)] = Listener(app)
        return listener


class Listener:
    """One connection per app LISTENing on its channel for ends, in a daemon thread that
    runs while anyone waits (and closes its connection a few seconds after the last one
    left); it calls each waiter of a job named by a notification.

    Args:
        app: the app whose jobs are awaited.
    """

    IDLE_CLOSE = 5.0  # seconds without waiters before the connection closes
    TICK = 0.2  # seconds between the thread's looks at its waiters and its stop flag

    def __init__(self, app: Admin) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._waiters: dict[int, list[Callable[[], None]]] = {}
        self._listening = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def close(self) -> None:
        """Stop listening and close the connection (waiters then only poll); the next
        waiter starts it again."""
        with self._lock:
            thread = self._thread
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5 * self.TICK + 1)
        self._stop.clear()

    def add(self, job_id: int, wake: Callable[[], None]) -> None:
        """Call ``wake`` (from the listener's thread) whenever ``job_id``'s end is
        announced, until ``remove``."""
        with self._lock:
            self._waiters.setdefault(job_id, []).append(wake)
            if self._thread is None or not self._thread.is_alive():
                self._listening.clear()
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="skipjack-results")
                self._thread.start()

    def remove(self, job_id: int, wake: Callable[[], None]) -> None:
        """Stop calling ``wake`` for ``job_id``."""
        with self._lock:
            waiting = self._waiters.get(job_id, [])
            if wake in waiting:
                waiting.remove(wake)
            if not waiting:
                self._waiters.pop(job_id, None)

    def wait_listening(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the LISTEN to be in place; whether it is."""
        return self._listening.wait(max(0.0, timeout))

    def _run(self) -> None:
        backoff = ReconnectDelay()
        idle_since: float | None = None
        while True:
            try:
                with self.app.db.connect() as conn:
                    conn.execute(listen_statement(done_channel_name(self.app.queries.schema)))
                    self._listening.set()
                    backoff.reset()
                    while True:
                        for note in conn.notifies(timeout=self.TICK):
                            self._wake(note.payload)
                        with self._lock:
                            if self._stop.is_set():
                                self._listening.clear()
                                self._thread = None
                                return
                            if self._waiters:
                                idle_since = None
                            elif idle_since is None:
                                idle_since = time.monotonic()
                            elif time.monotonic() - idle_since > self.IDLE_CLOSE:
                                self._listening.clear()
                                self._thread = None
                                return
            except psycopg.Error as exc:
                self._listening.clear()
                with self._lock:
                    if not self._waiters:  # nobody to tell: end quietly
                        self._thread = None
                        return
                delay = backoff.next()
                log.warning("results: listening for job ends failed: %s (waiters poll; "
                            "retrying in %.1fs)", str(exc).strip(), delay)
                time.sleep(delay)

    def _wake(self, payload: str) -> None:
        try:
            job_id = int(payload)
        except ValueError:
            return
        with self._lock:
            waiting = list(self._waiters.get(job_id, ()))
        for wake in waiting:
            wake()
