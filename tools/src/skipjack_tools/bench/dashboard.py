"""D1: the dashboard's pages on a big table.

The table gets 5,000,000 finished jobs (succeeded, with 1% discarded and 0.4% cancelled, all
with an error entry where they failed), spread over the last two days across five queues,
and 100,000 waiting ones (90,000 available, 10,000 scheduled), then ``VACUUM ANALYZE`` (what
autovacuum does on its own). The throughput rollup is brought up to date, and ``skipjack
dashboard`` runs in its own process; each page is fetched over HTTP a number of times and its
response times reported (p50, p95, max), against the 200 ms target.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from psycopg import sql

from skipjack.app import App

from .common import Settings, connect, free_port, fresh_app, percentiles, wait_for

TARGET_MS = 200.0
QUEUES = 5

FILL = """
INSERT INTO {t} (queue, task, args, args_bytes, state, attempt, max_attempts, run_at,
                 created_at, attempted_at, finished_at, errors)
SELECT 'q' || (g %% {queues}), CASE WHEN g %% 997 = 0 THEN 'bench.rare' ELSE 'bench.send' END,
       jsonb_build_object('to', 'user' || g || '@example.com', 'n', g), 60,
       s.state, 1, 3, f - interval '50 ms', f - interval '60 ms', f - interval '20 ms',
       CASE WHEN s.state IN ('succeeded', 'discarded', 'cancelled') THEN f END,
       CASE WHEN s.state = 'discarded' THEN jsonb_build_array(jsonb_build_object(
            'attempt', 3, 'error', 'TimeoutError: upstream took longer than 10 s',
            'traceback', 'Traceback (most recent call last): ...', 'at', f, 'worker', 'w1'))
            ELSE '[]' END
  FROM generate_series(%(start)s, %(stop)s) AS g,
       LATERAL (SELECT now() - (%(total)s - g) * %(spacing)s * interval '1 ms' AS f) AS t,
       LATERAL (SELECT CASE WHEN g %% 100 = 7 THEN 'discarded'
                            WHEN g %% 250 = 3 THEN 'cancelled'
                            ELSE 'succeeded' END AS state) AS s
"""

WAITING = """
INSERT INTO {t} (queue, task, args, args_bytes, state, run_at)
SELECT 'q' || (g %% {queues}), 'bench.send', jsonb_build_object('n', g), 20,
       CASE WHEN g %% 10 = 0 THEN 'scheduled' ELSE 'available' END,
       CASE WHEN g %% 10 = 0 THEN now() + interval '1 day' ELSE now() - interval '1 s' END
  FROM generate_series(1, %(n)s) AS g
"""


def _fill(app: App, finished: int, waiting: int, log: Any) -> None:
    table = sql.Identifier(app.schema, "jobs")
    spacing = 2 * 86_400_000 / max(1, finished)  # ms between finishes: two days in all
    with connect(app.dsn) as conn:
        fill = sql.SQL(FILL).format(t=table, queues=sql.Literal(QUEUES))
        for start in range(1, finished + 1, 250_000):
            stop = min(finished, start + 249_999)
            conn.execute(fill, {"start": start, "stop": stop, "total": finished,
                                "spacing": spacing})
            log(f"  D1 filled {stop:,} of {finished:,} finished jobs")
        conn.execute(sql.SQL(WAITING).format(t=table, queues=sql.Literal(QUEUES)),
                     {"n": waiting})
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table))
        # the rollup counts from a day back (its watermark starts there)
        while app.rollup():
            pass


def _fetch(url: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        response.read()
        status = response.status
    return status, (time.perf_counter() - t0) * 1000


# What ``skipjack dashboard`` imports from skipjack's ``dashboard`` extra.
EXTRA = ("starlette", "jinja2", "uvicorn", "multipart")


def run(settings: Settings) -> dict[str, Any]:
    """D1 (see the module's doc); ``{"skipped": why}`` when skipjack's dashboard extra is
    not installed."""
    missing = [name for name in EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        why = (f"the dashboard needs skipjack's extra ({', '.join(missing)} missing): "
               "pip install 'skipjack[dashboard]'")
        settings.log(f"dashboard skipped: {why}")
        return {"skipped": why}
    finished = max(1000, int(5_000_000 * settings.scale))
    waiting = max(100, int(100_000 * settings.scale))
    repeats = 3 if settings.quick else 15
    with fresh_app(settings.dsn, "dashboard") as app:
        t0 = time.monotonic()
        _fill(app, finished, waiting, settings.log)
        fill_s = time.monotonic() - t0
        with connect(app.dsn) as conn:
            row = conn.execute(sql.SQL("SELECT min(id), max(id) FROM {}").format(
                sql.Identifier(app.schema, "jobs"))).fetchone()
            assert row is not None
            low, high = row
            dead = conn.execute(sql.SQL(
                "SELECT id FROM {} WHERE state = 'discarded' ORDER BY id DESC LIMIT 1").format(
                    sql.Identifier(app.schema, "jobs"))).fetchone()
        port = free_port()
        errors = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            [sys.executable, "-m", "skipjack", "--dsn", app.dsn, "--schema", app.schema, "-q",
             "dashboard", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=errors, env=dict(os.environ))
        base = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _answers(base) or proc.poll() is not None, timeout=60)
            if proc.poll() is not None:
                errors.seek(0)
                raise RuntimeError(f"skipjack dashboard exited with status {proc.returncode}: "
                                   + errors.read().decode(errors="replace").strip()[-2000:])
            since = time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() - 3600))
            pages = {
                "overview": "/",
                "overview (live refresh)": "/live/overview",
                "jobs, newest": "/jobs",
                "jobs, deep page (keyset)": f"/jobs?before={(low + high) // 2}",
                "dead letter": "/jobs?state=discarded",
                "dead letter of one queue": "/jobs?state=discarded&queue=q1",
                "dead letter by error text": "/jobs?state=discarded&error=upstream",
                "dead letter since an hour": f"/jobs?state=discarded&time=finished&since={since}",
                "available of one queue": "/jobs?state=available&queue=q2",
                "one task (1 in 997)": "/jobs?task=bench.rare",
                "job detail": f"/jobs/{dead[0] if dead else high}",
                "queues": "/queues",
                "workers": "/workers",
                "cron": "/cron",
            }
            results: dict[str, Any] = {}
            for name, path in pages.items():
                _fetch(base + path)  # warm: the first request plans and caches
                times = []
                for _ in range(repeats):
                    status, ms = _fetch(base + path)
                    if status != 200:
                        raise RuntimeError(f"{path}: HTTP {status}")
                    times.append(ms)
                results[name] = {"path": path, **percentiles(times, (50, 95))}
                settings.log(f"  D1 {name}: p50 {results[name]['p50']:.1f} ms, "
                             f"p95 {results[name]['p95']:.1f} ms")
        finally:
            proc.terminate()
            proc.wait(30)
            errors.close()
    slowest = max(r["p95"] for r in results.values())
    return {"finished_jobs": finished, "waiting_jobs": waiting, "fill_seconds": round(fill_s, 1),
            "repeats": repeats, "pages_ms": results, "slowest_p95_ms": slowest,
            "target_ms": TARGET_MS, "met": slowest < TARGET_MS}


def _answers(base: str) -> bool:
    try:
        return _fetch(base + "/static/dashboard.css")[0] == 200
    except OSError:
        return False

