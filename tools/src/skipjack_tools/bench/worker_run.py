"""Running skipjack workers for a benchmark: in this process, or as child processes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from psycopg import sql

from skipjack.app import App
from skipjack.channels import channel_name
from skipjack.runtime import eventloop
from skipjack.runtime.worker import Worker

from .common import QUEUE, connect, free_port, wait_for


class StateCounter:
    """Counts jobs of one state on a connection kept open, cheaply enough to poll while a
    drain runs: while any job is still to run (available, scheduled or running: a probe of
    each state's partial index, one snapshot for all three) it answers 0 without counting.
    Counting the table itself at each poll loads the server the drain measures: a
    ``count(*)`` of 100,000 jobs took 12.6 ms, a quarter of a core at a poll every 50 ms
    during W2's drain of 100,000."""

    def __init__(self, app: App, state: str = "succeeded") -> None:
        self._conn = connect(app.dsn)
        jobs = sql.SQL("{}.jobs").format(sql.Identifier(app.schema))
        self._query = sql.SQL(
            "SELECT CASE WHEN EXISTS (SELECT 1 FROM {jobs} WHERE state = 'available')"
            "              OR EXISTS (SELECT 1 FROM {jobs} WHERE state = 'running')"
            "              OR EXISTS (SELECT 1 FROM {jobs} WHERE state = 'scheduled')"
            "            THEN 0 ELSE (SELECT count(*) FROM {jobs} WHERE state = %s) END"
        ).format(jobs=jobs)
        self._state = state

    def __call__(self) -> int:
        row = self._conn.execute(self._query, [self._state]).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self._conn.close()


def run_worker(app: App, *, concurrency: int, until: Callable[[], Awaitable[Any]],
               timeout: float, **options: Any) -> Worker:
    """Run a :class:`Worker` in this process while ``until()`` runs, then stop it.

    Raises:
        TimeoutError: ``until()`` took longer than ``timeout`` seconds.
    """
    logging.getLogger("skipjack").setLevel(logging.WARNING)
    worker = Worker(app, [QUEUE], concurrency=concurrency, shutdown_grace=5.0, **options)

    async def main() -> None:
        running = asyncio.create_task(worker.run_async())
        try:
            await asyncio.wait_for(until(), timeout)
        finally:
            worker.stop()
            await running
            await app.close_async()  # an async pool opened on this loop must close on it

    with asyncio.Runner(loop_factory=eventloop.new_event_loop) as runner:  # as Worker.run
        runner.run(main())
    return worker


def drain_with_process(app: App, jobs: int, *extra: str, timeout: float,
                       metrics: bool = False) -> None:
    """Run one ``skipjack worker`` process (its default settings, ``extra`` options, its log
    written to a file) until ``jobs`` jobs succeeded, then stop it (SIGTERM, waited for).

    Raises:
        TimeoutError: the jobs took longer than ``timeout`` seconds.
    """
    workers = WorkerProcesses(app, 1, *extra, metrics=metrics, logged=True)
    counter = StateCounter(app)
    try:
        wait_for(lambda: counter() >= jobs or workers.procs[0].poll() is not None, timeout,
                 what=f"{jobs} jobs done by a worker process")
        if workers.procs[0].poll() is not None:
            raise RuntimeError("the benchmark's worker process exited early")
    finally:
        counter.close()
        workers.stop()


def _metrics_options() -> list[str]:
    return ["--metrics-port", str(free_port()), "--metrics-host", "127.0.0.1"]


class WorkerProcesses:
    """``python -m skipjack worker skipjack_tools.bench.tasks:app`` child processes.

    Args:
        app: the app whose schema they serve (its DSN is theirs too, unless ``place`` says).
        count: how many.
        extra: more options of ``skipjack worker``.
        metrics: serve Prometheus metrics (each on a port of its own).
        place: for process ``i``, a command to run it under (such as ``ip netns exec`` of a
            simulated host, which execs it) and the DSN it connects to.
        logged: each writes its log (skipjack's default: INFO) to a temporary file, as a
            user's worker writes to a file or a journal; else the log is discarded unread
            (the file is removed by ``stop``).
    """

    def __init__(self, app: App, count: int, *extra: str, metrics: bool = False,
                 place: Callable[[int], tuple[Sequence[str], str]] | None = None,
                 logged: bool = False) -> None:
        self.app = app
        self.procs = []
        self._logs = [tempfile.TemporaryFile() for _ in range(count)] if logged else []
        for i in range(count):
            prefix, dsn = place(i) if place else ((), app.dsn)
            env = {**os.environ, "SKIPJACK_SCHEMA": app.schema, "SKIPJACK_DATABASE_URL": dsn}
            cmd = [*prefix, sys.executable, "-m", "skipjack", "--dsn", dsn, "--schema",
                   app.schema, "worker", "skipjack_tools.bench.tasks:app", "--queue", QUEUE,
                   *extra, *(_metrics_options() if metrics else [])]
            self.procs.append(subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=self._logs[i] if logged else subprocess.DEVNULL))

    def wait_listening(self, timeout: float = 60) -> None:
        """Wait until every process listens for notifications (it is then idle and ready)."""
        channel = channel_name(self.app.schema)
        with connect(self.app.dsn) as conn:
            def ready() -> bool:
                if any(p.poll() is not None for p in self.procs):
                    raise RuntimeError("a benchmark worker process exited early")
                # the listener's last statement is a LISTEN on one of the schema's channels
                row = conn.execute("SELECT count(*) FROM pg_stat_activity "
                                   "WHERE starts_with(query, %s)",
                                   [f'LISTEN "{channel}']).fetchone()
                return bool(row and row[0] >= len(self.procs))

            wait_for(ready, timeout, what="worker processes to start")

    def stop(self) -> None:
        """SIGTERM every process and wait; SIGKILL any that outlive 15 s."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log_file in self._logs:
            log_file.close()
