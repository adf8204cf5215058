"""Shared pieces of the benchmarks: settings, fresh databases and schemas, statistics.

Every scenario runs in a schema (skipjack) or a database (the peers) created for it alone and
dropped afterwards, so a benchmark never reads or removes anything it did not create.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import statistics
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from skipjack.app import App

from ..sql import AUTOVACUUMS, CHECKPOINT, DROP_SCHEMA, render

QUEUE = "bench"
# W1 bulk: calls of the whole batch per run, their median the run's figure (one call of
# 10,000 jobs spread by half within a run: docs/performance-runs.md, run J)
BULK_CALLS = 5
log = logging.getLogger("skipjack.bench")
BENCH_DB_PREFIX = "skipjack_bench_"


@contextlib.contextmanager
def quiet_job_failures() -> Iterator[None]:
    """Within the block, skipjack's log of failed jobs (``skipjack.jobs``) shows errors
    only: for scenarios whose jobs fail on purpose (W7, W9), whose warnings of each failure
    would bury the bench's own output."""
    jobs_log = logging.getLogger("skipjack.jobs")
    level = jobs_log.level
    jobs_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        jobs_log.setLevel(level)


@dataclass
class Settings:
    """What one ``skipjack bench`` invocation runs.

    Args:
        dsn: the server's connection URI (a maintenance database such as ``postgres``).
        scale: multiplies every job count (1.0 = the sizes in docs/performance.md).
        runs: repetitions of the compared scenarios; medians are reported.
        quick: the seconds-long smoke mode: tiny sizes, one run, short waits.
        metrics: run skipjack's workers with Prometheus metrics on (W2, W4), to measure
            what they cost.
        soak_rate: jobs/s the soak enqueues (None: half of W2 at concurrency 10).
        log: called with one line of progress.
    """

    dsn: str
    scale: float = 1.0
    runs: int = 3
    quick: bool = False
    metrics: bool = False
    soak_rate: float | None = None
    log: Callable[[str], None] = field(default=lambda line: None)

    def n(self, full: int, minimum: int = 10) -> int:
        """A job count: ``full`` times the scale, at least ``minimum``."""
        return max(minimum, round(full * self.scale))

    def seconds(self, full: float, quick: float) -> float:
        """A duration: ``full`` seconds, or ``quick`` seconds in quick mode."""
        return quick if self.quick else full


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """An autocommit connection that identifies itself as the benchmark."""
    return psycopg.connect(dsn, autocommit=True, application_name="skipjack-bench", **kwargs)


def with_dbname(dsn: str, dbname: str) -> str:
    """The same server and credentials, another database (a URI stays a URI)."""
    parts = urllib.parse.urlsplit(dsn)
    if parts.scheme in ("postgres", "postgresql"):
        return urllib.parse.urlunsplit(parts._replace(path="/" + urllib.parse.quote(dbname)))
    return make_conninfo(dsn, dbname=dbname)


def server_answers(dsn: str, timeout: float = 90) -> bool:
    """Wait up to ``timeout`` seconds for the server to accept connections (it may be
    restarting: other test suites on the same machine restart it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            connect(dsn, connect_timeout=3).close()
            return True
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def settle(dsn: str, timeout: float = 60) -> None:
    """Start a scenario from a quiet server: a CHECKPOINT (left out where the role may not
    run one), then up to ``timeout`` seconds for autovacuum workers to finish. Every
    scenario of skipjack's and of each peer's starts so, whatever ran before it."""
    with connect(dsn) as conn:
        try:
            conn.execute(CHECKPOINT)
        except psycopg.errors.InsufficientPrivilege:
            pass
        deadline = time.monotonic() + timeout
        while conn.execute(AUTOVACUUMS).fetchone()[0] and time.monotonic() < deadline:  # type: ignore[index]
            time.sleep(0.5)


def _drop(dsn: str, statement: sql.Composed | bytes) -> None:
    """Run a clean-up statement, waiting for the server if it is restarting; a clean-up that
    still fails is logged (what is left behind has the bench's own name), never raised."""
    for attempt in range(3):
        try:
            with connect(dsn) as conn:
                conn.execute(statement)
            return
        except psycopg.OperationalError:
            server_answers(dsn)
        except psycopg.Error as exc:
            if attempt == 2:
                text = statement if isinstance(statement, bytes) else statement.as_bytes(None)
                log.warning("clean-up failed (%s): %s", exc, text.decode())
                return
            time.sleep(2)


@contextlib.contextmanager
def fresh_database(dsn: str, label: str) -> Iterator[str]:
    """Create a database of our own for one run; drop it afterwards (ours alone)."""
    name = f"{BENCH_DB_PREFIX}{label}_{secrets.token_hex(4)}"
    with connect(dsn) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield with_dbname(dsn, name)
    finally:
        _drop(dsn, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


@contextlib.contextmanager
def fresh_app(dsn: str, label: str) -> Iterator[App]:
    """A migrated skipjack :class:`App` in a new schema; the schema is dropped afterwards."""
    app = App(dsn, schema=f"bench_{label}_{secrets.token_hex(4)}")
    app.migrate()
    try:
        yield app
    finally:
        app.close()
        _drop(dsn, render(DROP_SCHEMA, app.schema))


def percentiles(values: Sequence[float], points: Sequence[float] = (50, 95, 99)
                ) -> dict[str, float | None]:
    """Nearest-rank percentiles (and max) of ``values``, rounded to 3 decimals."""
    if not values:
        return {**{f"p{p:g}": None for p in points}, "max": None}
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for p in points:
        out[f"p{p:g}"] = round(ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))],
                               3)
    out["max"] = round(ordered[-1], 3)
    return out


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not None (None if there are none)."""
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def repeat(runs: int, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``fn`` ``runs`` times; every numeric key gets its median, ``runs`` keeps all."""
    results = [fn() for _ in range(runs)]
    summary: dict[str, Any] = {}
    for key, value in results[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            summary[key] = median([r[key] for r in results])
        else:
            summary[key] = value
    summary["runs"] = results
    return summary


def merge_rounds(rounds: Sequence[Any]) -> Any:
    """One result from the results of the same scenario in several rounds (see
    ``runner.run_bench``): numbers become the median of the rounds' (None where none has
    one; the same number in every round stays as it is), a ``runs`` list joins the rounds'
    lists, a dict is merged key by key, anything else is the last round's. A round that
    failed (a dict with ``error``) is left out, unless every round did."""
    good = [r for r in rounds if not (isinstance(r, dict) and "error" in r)] or list(rounds)
    if all(isinstance(r, dict) for r in good):
        keys = list(dict.fromkeys(k for r in good for k in r))
        return {k: ([x for r in good for x in r.get(k, [])] if k == "runs"
                    else merge_rounds([r[k] for r in good if k in r])) for k in keys}
    numbers = [r for r in good if r is None or
               (isinstance(r, int | float) and not isinstance(r, bool))]
    if len(numbers) == len(good) and len(set(numbers)) > 1:  # equal ones (sizes) as they are
        return median(numbers)
    return good[-1]


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.05,
             what: str = "condition") -> None:
    """Poll ``condition`` until true; raise TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"benchmark timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def drain_span(app: App) -> tuple[int, float | None]:
    """(succeeded jobs, seconds from the first start to the last completion) from the table."""
    with connect(app.dsn) as conn:
        row = conn.execute(sql.SQL(
            "SELECT count(*), extract(epoch FROM max(finished_at) - min(attempted_at))::float8"
            "  FROM {}.jobs WHERE state = 'succeeded'").format(sql.Identifier(app.schema))
        ).fetchone()
    assert row is not None
    return int(row[0]), row[1]


def count_state(app: App, state: str) -> int:
    """How many jobs of the app's schema are in ``state``."""
    with connect(app.dsn) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}.jobs WHERE state = %s").format(
            sql.Identifier(app.schema)), [state]).fetchone()
    return int(row[0]) if row else 0


def rate(jobs: int, seconds: float | None) -> float | None:
    """Jobs per second, rounded; None when the span is unknown or zero."""
    return round(jobs / seconds, 1) if seconds else None


def payload(size: int = 2400) -> str:
    """A text of ``size`` ASCII characters (the 2.4 KB payload of W8 and the memory test)."""
    unit = "skipjack-payload-0123456789abcdef"
    return (unit * (size // len(unit) + 1))[:size]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
