"""The ceiling on this machine: skipjack's own claim and completion SQL with no framework.

A bare psycopg loop claims 100 jobs with skipjack's claim statement and completes them with
one batched outcome statement, until the queue is empty, on 1 and on 4 connections (threads);
then pgbench runs the same two statements (``-M prepared``) with 1, 4 and 8 clients. Every
other throughput can be read as a fraction of these.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import threading
from typing import Any

import psycopg
from psycopg import sql

from skipjack.app import App
from skipjack.outcome import Outcome, outcome_params
from skipjack.sql.claim import claim_params

from .common import Settings, connect, drain_span, fresh_app, median, rate

BATCH = 100
FILL = ("INSERT INTO {t} (queue, task, args) SELECT 'bench', 'bench.noop', "
        "jsonb_build_object('i', g) FROM generate_series(1, %s) g")
CLAIM_PARAMS = claim_params("bench", BATCH, lease=30.0, worker="bench")


def _fill(app: App, jobs: int) -> None:
    with connect(app.dsn) as conn:
        conn.execute(sql.SQL(FILL).format(t=sql.Identifier(app.schema, "jobs")), [jobs])
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(app.schema, "jobs")))


def _loop(app: App) -> None:
    q = app.queries
    with connect(app.dsn) as conn:
        while rows := conn.execute(q.CLAIM, CLAIM_PARAMS).fetchall():
            conn.execute(q.record_outcomes(len(rows)), outcome_params(
                [Outcome(r[0], r[7], r[1], "complete") for r in rows]),
                prepare=q.prepare_outcomes(len(rows)))


def _bare_once(settings: Settings, jobs: int, connections: int) -> float | None:
    with fresh_app(settings.dsn, "ceil") as app:
        _fill(app, jobs)
        threads = [threading.Thread(target=_loop, args=(app,)) for _ in range(connections)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done, span = drain_span(app)
    return rate(done, span)


def pgbench_script(app: App, conn: psycopg.Connection[Any]) -> str:
    """skipjack's claim and completion statements as a pgbench script (prepared mode)."""
    claim = app.queries.CLAIM.decode()
    for name, value in (("queue", "'bench'"), ("limit", str(BATCH)), ("lease", "30.0"),
                        ("worker", "'pgbench'"), ("inline_bytes", str(256 * 1024)),
                        ("min_lease", "0"), ("claim_mode_tasks", "'{}'"), ("claim_mode", "false"),
                        ("skip", "'{}'")):
        claim = claim.replace(f"%({name})s", value)
    claim = re.sub(r"--[^\n]*", "", claim)  # pgbench takes one statement per line, and
    record = app.queries.record_outcomes(BATCH).decode().replace(
        "%(outcomes)s", ":outcomes").replace("%(count)s", ":count")
    gather = (f"WITH c AS ({claim.strip()})\n"
              "SELECT coalesce(json_agg(json_build_object('id', id, 'lease_version', "
              "lease_version, 'kind', 'complete', 'delay', 0)), '[]')::text AS outcomes,\n"
              "       count(*) AS count FROM c \\gset\n")
    record = re.sub(r"--[^\n]*", "", record)  # a comment would swallow the rest of the line
    return " ".join(gather.split("\n")) + "\n" + " ".join(record.split()) + ";\n"


def _pgbench_once(settings: Settings, exe: str, jobs: int, clients: int) -> dict[str, Any]:
    with fresh_app(settings.dsn, "pgb") as app:
        _fill(app, jobs)
        with connect(app.dsn) as conn, tempfile.NamedTemporaryFile(
                "w", suffix=".sql", delete=False) as script:
            script.write(pgbench_script(app, conn))
        per_client = max(1, jobs // (BATCH * clients))
        proc = subprocess.run(
            [exe, "-n", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 2)),
             "-t", str(per_client), "-f", script.name, app.dsn],
            capture_output=True, text=True, timeout=300)
        done, span = drain_span(app)
    m = re.search(r"tps = ([\d.]+)", proc.stdout)
    if proc.returncode != 0 or not m:
        return {"error": (proc.stderr or proc.stdout).strip()[-500:]}
    return {"jobs_per_s": rate(done, span),
            "pgbench_tps_x_batch": round(float(m.group(1)) * BATCH, 1)}


def run(settings: Settings) -> dict[str, Any]:
    """The bare loop (medians of ``settings.runs``) and pgbench (single runs)."""
    jobs = settings.n(50_000, minimum=2000)
    out: dict[str, Any] = {"jobs": jobs, "batch": BATCH, "bare_loop": {}, "pgbench": {}}
    for connections in (1, 4):
        settings.log(f"ceiling: bare loop, {connections} connection(s), {jobs} jobs")
        runs = [_bare_once(settings, jobs, connections) for _ in range(settings.runs)]
        out["bare_loop"][str(connections)] = {"jobs_per_s": median(runs), "runs": runs}
    exe = shutil.which("pgbench")
    if exe is None:
        out["pgbench"] = {"skipped": "pgbench is not installed"}
        return out
    for clients in (1, 4, 8):
        settings.log(f"ceiling: pgbench -c {clients}, {jobs} jobs")
        out["pgbench"][str(clients)] = _pgbench_once(settings, exe, jobs, clients)
    return out
