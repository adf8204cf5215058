"""Soak: a steady rate for a long time (20 minutes at scale 1), to show that nothing degrades.

One ``skipjack worker`` process with its default settings (concurrency 10, the adaptive
prefetch) serves jobs enqueued at half of the W2 drain rate at concurrency 10 measured in
the same run (or measured here first; ``--soak-rate`` sets another rate), in batches every
100 ms from this process. The
worker's retention is a quarter of the run (5 minutes at scale 1) instead of the default 7
days, so the table reaches its steady size (the retention window) within the run and the
last three quarters show whether it then stops growing.

Measured:

- the claim latency a client sees, from a probe claiming one job every 50 ms with
  skipjack's own claim statement, in a process of its own (see ``scaling.ClaimProbe``):
  p50 and p99 per 30 s, and the p99 of the first and of the last window (a quarter of the
  run) with their ratio (target: the last within 1.2x of the first);
- every 10 s: the jobs table's size and its indexes' (bytes), live and dead rows, the
  runnable backlog, the jobs enqueued so far, and autovacuum's runs on the table;
- every 10 s also: the server's WAL written since the start (bytes) and its checkpoints,
  those started because the WAL reached ``max_wal_size`` (1 GB by default) counted apart
  from the timed ones; the run's WAL bytes per job enqueued;
- growth: the table + index size at the end over its size at half time (1.0: flat);
- whether the worker kept up: the backlog of the last window under one second's jobs.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from psycopg import sql

from skipjack.app import App

from . import drain
from .common import Settings, connect, fresh_app, percentiles
from .raw import WAL_SINCE
from .scaling import ClaimProbe
from .tasks import register
from .worker_run import WorkerProcesses

DURATION = 1200.0  # seconds at scale 1
TICK = 0.1  # seconds between enqueue batches
SAMPLE_EVERY = 10.0  # seconds between size samples
BIN = 30.0  # seconds per claim-latency point of the series
SIZES = """
SELECT pg_table_size(c.oid), pg_indexes_size(c.oid), s.n_live_tup, s.n_dead_tup,
       s.autovacuum_count,
       (SELECT count(*) FROM {jobs} WHERE state = 'available')
  FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
 WHERE c.oid = %s::regclass
"""
# The server's checkpoints so far: (timed, requested: by WAL volume or by a command), from
# pg_stat_checkpointer since PostgreSQL 17, pg_stat_bgwriter before.
CHECKPOINTS = "SELECT num_timed, num_requested FROM pg_stat_checkpointer"
CHECKPOINTS_BEFORE_17 = "SELECT checkpoints_timed, checkpoints_req FROM pg_stat_bgwriter"
WAL_LSN = "SELECT pg_current_wal_lsn()"


def _enqueue_steadily(app: App, per_second: float, seconds: float, stop: threading.Event,
                      sent: list[int]) -> None:
    """Enqueue ``per_second`` no-op jobs a second for ``seconds``, one batch every TICK; a
    batch that falls behind is made up by the next (the offered load stays steady)."""
    noop = app.tasks["bench.noop"]
    started = time.monotonic()
    total = 0
    while not stop.is_set() and (elapsed := time.monotonic() - started) < seconds:
        due = round(per_second * min(elapsed + TICK, seconds)) - total
        if due > 0:
            app.enqueue_many([noop.job() for _ in range(due)])
            total += due
            sent[0] = total
        stop.wait(max(0.0, started + elapsed + TICK - time.monotonic()))


def _sample_sizes(app: App, started: float, stop: threading.Event, sent: list[int],
                  out: list[dict[str, Any]]) -> None:
    """Every SAMPLE_EVERY seconds until ``stop``: the table's sizes and rows (see SIZES)."""
    query = sql.SQL(SIZES).format(jobs=sql.Identifier(app.schema, "jobs"))
    with connect(app.dsn) as conn:
        table = sql.Identifier(app.schema, "jobs").as_string(conn)
        checkpoints = (CHECKPOINTS if conn.info.server_version >= 170000
                       else CHECKPOINTS_BEFORE_17)
        timed0, requested0 = conn.execute(checkpoints).fetchone() or (0, 0)
        lsn = (conn.execute(WAL_LSN).fetchone() or [None])[0]
        while True:
            row = conn.execute(query, [table]).fetchone()
            timed, requested = conn.execute(checkpoints).fetchone() or (0, 0)
            wal = (conn.execute(WAL_SINCE, [lsn]).fetchone() or [None])[0]
            if row:
                out.append({"t": round(time.monotonic() - started, 1), "table_bytes": row[0],
                            "index_bytes": row[1], "live_rows": row[2], "dead_rows": row[3],
                            "autovacuum_runs": row[4], "backlog": row[5],
                            "enqueued": sent[0], "wal_bytes": wal,
                            "checkpoints_timed": timed - timed0,
                            "checkpoints_requested": requested - requested0})
            if stop.wait(SAMPLE_EVERY):
                return


def _window_p99(claims: list[tuple[float, float]], start: float, end: float) -> float | None:
    return percentiles([ms for t, ms in claims if start <= t < end])["p99"]


def run(settings: Settings, w2_at_10: float | None = None) -> dict[str, Any]:
    """The soak run (see the module's doc). ``w2_at_10``: the W2 drain rate at concurrency
    10 measured earlier in this run, in jobs/s; measured here when None."""
    seconds = 20.0 if settings.quick else max(60.0, DURATION * settings.scale)
    window = seconds / 4
    if settings.soak_rate:
        per_second, why = round(settings.soak_rate), "as asked"
    else:
        if not w2_at_10:
            settings.log("soak: measuring the W2 drain rate at concurrency 10 first")
            w2_at_10 = drain.drain_rate(settings, settings.n(10_000), 10)
        per_second, why = round((w2_at_10 or 1000.0) / 2), "half of W2 at concurrency 10"
    settings.log(f"soak: {seconds:.0f} s at {per_second:,} jobs/s ({why}), retention "
                 f"{window:.0f} s")
    samples: list[dict[str, Any]] = []
    sent = [0]
    with fresh_app(settings.dsn, "soak") as app:
        register(app)
        workers = WorkerProcesses(app, 1, "--retention", f"{window:g}s")
        stop = threading.Event()
        try:
            workers.wait_listening()
            with ClaimProbe(app, every=0.05) as probe:
                started = time.monotonic()
                helpers = [
                    threading.Thread(target=_enqueue_steadily,
                                     args=(app, per_second, seconds, stop, sent)),
                    threading.Thread(target=_sample_sizes,
                                     args=(app, started, stop, sent, samples)),
                ]
                for helper in helpers:
                    helper.start()
                helpers[0].join()  # the enqueuer ends after ``seconds``
                stop.set()
                helpers[1].join()
                claims = probe.stop(since=started)
            if workers.procs[0].poll() is not None:
                raise RuntimeError("the soak's worker process exited during the run")
        finally:
            stop.set()
            workers.stop()
    first, last = _window_p99(claims, 0, window), _window_p99(claims, seconds - window,
                                                                seconds)
    series = []
    t = 0.0
    while t < seconds:
        values = [ms for at, ms in claims if t <= at < t + BIN]
        p = percentiles(values)
        series.append({"t": t, "p50_ms": p["p50"], "p99_ms": p["p99"], "claims": len(values)})
        t += BIN
    total = [s["table_bytes"] + s["index_bytes"] for s in samples]
    half = next((x for s, x in zip(samples, total, strict=True) if s["t"] >= seconds / 2),
                None)
    late = [x["backlog"] for x in samples if x["t"] >= seconds - window]
    return {
        "seconds": seconds, "jobs_per_s": per_second, "retention_s": window,
        "enqueued": sent[0],
        # the worker kept up: the runnable backlog of the last window stayed under one
        # second's worth of jobs
        "backlog_last_max": max(late, default=None),
        "kept_up": bool(late) and max(late) <= per_second,
        "claim_p99_first_ms": first, "claim_p99_last_ms": last,
        "claim_p99_last_over_first": round(last / first, 2) if first and last else None,
        "size_end_over_half": round(total[-1] / half, 2) if half and total else None,
        "size_end_bytes": total[-1] if total else None,
        # the WAL and checkpoints of the whole server during the run (the worker, the
        # enqueuer, the probe, the pruner and autovacuum)
        "wal_bytes_per_job": (round(samples[-1]["wal_bytes"] / sent[0], 1)
                              if samples and sent[0] and samples[-1]["wal_bytes"] else None),
        "checkpoints_timed": samples[-1]["checkpoints_timed"] if samples else None,
        "checkpoints_requested": samples[-1]["checkpoints_requested"] if samples else None,
        "claim_ms": series, "sizes": samples,
    }
