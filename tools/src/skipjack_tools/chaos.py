"""``skipjack chaos``: run a workload while injecting real faults, then audit the outcome.

Worker processes (``python -m skipjack worker skipjack_tools.chaos:app``) run ``chaos.effect`` jobs:
each logs its start on a connection of its own, sleeps ``--duration-ms``, and writes one row to
``chaos_effects`` in the transaction that records its fenced completion
(``transaction="complete"``). Meanwhile the controller SIGKILLs workers and starts
replacements, SIGSTOPs workers past their lease and resumes them, restarts PostgreSQL, and
terminates the workers' backends. The audit counts lost, stuck and duplicated work.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from skipjack import embedded
from skipjack.app import App
from skipjack.context import current_job
from skipjack.db import resolve_dsn

from .sql import (
    CHAOS_AUDIT,
    CHAOS_EFFECT,
    CHAOS_FINISHED,
    CHAOS_GRACEFUL_LOSSES,
    CHAOS_START,
    CHAOS_TABLES,
    DROP_SCHEMA,
    TERMINATE_BACKENDS,
    render,
)

app = App(schema=os.environ.get("SKIPJACK_SCHEMA", "skipjack_chaos"))
_log_pool: ConnectionPool[psycopg.Connection[Any]] | None = None
_log_lock = threading.Lock()


def _log_start(params: dict[str, Any]) -> None:
    """Record a start on a small pool of its own: it must survive the job's rollback."""
    global _log_pool
    with _log_lock:
        if _log_pool is None:
            _log_pool = ConnectionPool(app.dsn, min_size=1, max_size=2,
                                       kwargs=app.db.connect_kwargs, open=True)
    with _log_pool.connection() as conn:
        conn.execute(render(CHAOS_START, app.schema), params)


@app.task(name="chaos.effect", queue="chaos", transaction="complete")
def effect(ms: float) -> None:
    """Log the start, work ``ms`` milliseconds, write the effect in the completion's
    transaction."""
    job = current_job().job
    _log_start({"job_id": job.id, "attempt": job.attempt, "lease_version": job.lease_version,
                "pid": os.getpid()})
    time.sleep(ms / 1000)
    current_job().conn.execute(render(CHAOS_EFFECT, app.schema),
                               {"job_id": job.id, "pid": os.getpid()})


@dataclass
class ChaosOptions:
    """Settings of one chaos run; intervals in seconds, 0 disables a fault."""

    jobs: int = 2000
    workers: int = 4
    concurrency: int = 16
    duration_ms: float = 10.0
    kill_every: float = 0.0
    stall_every: float = 0.0
    term_every: float = 0.0
    restart_db_every: float = 0.0
    terminate_backends_every: float = 0.0
    restart_cmd: str | None = None
    lease: float = 2.0
    seed: int | None = None
    timeout: float = 600.0
    schema: str = "skipjack_chaos"


class _Workers:
    """The worker processes of one run, each logging to its own file."""

    def __init__(self, dsn: str, opts: ChaosOptions, logs: Path, app_name: str) -> None:
        self.dsn, self.opts, self.logs = dsn, opts, logs
        self.env = {**os.environ, "SKIPJACK_SCHEMA": opts.schema,
                    "SKIPJACK_APPLICATION_NAME": app_name, "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stalled: dict[int, float] = {}  # pid -> when to resume
        self.last_stalled: dict[int, float] = {}  # pid -> when it was last stalled
        self.stopping: list[subprocess.Popen[bytes]] = []  # SIGTERMed, draining
        self.log_of: dict[int, Path] = {}  # pid -> its log file
        self.stopped: list[tuple[int, float, int]] = []  # (pid, SIGTERM at epoch, status)
        self.started = 0

    def start(self) -> None:
        o = self.opts
        cmd = [sys.executable, "-m", "skipjack", "--dsn", self.dsn, "--schema", o.schema,
               "worker", "skipjack_tools.chaos:app", "--queue", "chaos",
               "--concurrency", str(o.concurrency), "--lease", str(o.lease),
               "--heartbeat", str(o.lease / 6), "--rescue-interval", str(o.lease / 4),
               "--poll-interval", "1", "--grace", "1"]
        self.started += 1
        log = self.logs / f"worker-{self.started}.log"
        out = open(log, "wb")
        proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        self.procs.append(proc)
        self.log_of[proc.pid] = log

    def serving(self, p: subprocess.Popen[bytes]) -> bool:
        """Whether the worker has started (it logs "serving" once it claims)."""
        return " serving " in self.log_of[p.pid].read_text(errors="replace")

    def kill_one(self, rng: random.Random) -> None:
        # a stalled worker is left to resume, so that its stale writes meet the fence
        victim = rng.choice([p for p in self.procs if p.pid not in self.stalled])
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        self.procs.remove(victim)
        self.stalled.pop(victim.pid, None)
        self.start()

    def term_one(self, rng: random.Random) -> bool:
        """SIGTERM a worker and start its replacement at once, as a rolling deploy does;
        False when no worker qualifies: it must be serving (one still starting holds no job
        and may not have its signal handlers yet) and awake, and not stalled within the last
        two leases (it could still hold leases that its stall let expire)."""
        now = time.monotonic()
        ready = [p for p in self.procs if p.pid not in self.stalled
                 and now - self.last_stalled.get(p.pid, -1e9) > 2 * self.opts.lease + 1
                 and self.serving(p)]
        if not ready:
            return False
        victim = rng.choice(ready)
        victim.send_signal(signal.SIGTERM)
        self.procs.remove(victim)
        self.stopping.append(victim)
        self.stopped.append((victim.pid, time.time(), -1))
        self.start()
        return True

    def reap(self) -> None:
        """Record the exit status of SIGTERMed workers that have exited."""
        for p in list(self.stopping):
            status = p.poll()
            if status is not None:
                self.stopping.remove(p)
                self.stopped = [(pid, at, status if pid == p.pid else st)
                                for pid, at, st in self.stopped]

    def stall_one(self, rng: random.Random, seconds: float) -> bool:
        """SIGSTOP a worker; False (nothing done) when that would leave none awake."""
        awake = [p for p in self.procs if p.pid not in self.stalled]
        if len(awake) <= 1:
            return False
        victim = rng.choice(awake)
        victim.send_signal(signal.SIGSTOP)
        self.stalled[victim.pid] = time.monotonic() + seconds
        self.last_stalled[victim.pid] = time.monotonic() + seconds
        return True

    def resume_due(self, everyone: bool = False) -> None:
        now = time.monotonic()
        for p in self.procs:
            if p.pid in self.stalled and (everyone or self.stalled[p.pid] <= now):
                p.send_signal(signal.SIGCONT)
                del self.stalled[p.pid]

    def stop(self) -> None:
        self.resume_due(everyone=True)
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs + self.stopping:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.reap()

    def count_in_logs(self, pattern: str) -> int:
        regex = re.compile(pattern)
        return sum(len(regex.findall(f.read_text(errors="replace")))
                   for f in self.logs.glob("worker-*.log"))


def run_chaos(dsn: str | None, opts: ChaosOptions, echo: Any = None) -> dict[str, Any]:
    """Run the workload with the faults of ``opts`` and return the audit.

    Args:
        dsn: database URI; None for the configured or embedded server.
        opts: workload and fault settings.
        echo: called with a line of progress text, or None for silence.

    Returns:
        The audit: enqueued, completed, discarded, unfinished (still waiting or running when
        the run ended), lost (enqueued jobs whose row vanished), stuck (running with an
        expired lease after one more lease period), duplicate_effects, missing_effects,
        duplicate_starts (re-runs the faults caused), stale_writes_rejected, leases_lost,
        attempts_spent_by_graceful_stops (a job rescued from a worker after it was SIGTERMed:
        a graceful stop must run or release every job it holds), graceful_stops_failed
        (SIGTERMed workers that did not exit 0), faults injected, elapsed seconds and ``ok``:
        nothing lost, stuck, unfinished,
        discarded, duplicated or missing (the workload never fails by itself).

    Raises:
        ValueError: a database restart is asked for on an external server without
            ``restart_cmd``.
    """
    say = echo or (lambda _line: None)
    embedded_server = dsn is None and not (os.environ.get("SKIPJACK_DATABASE_URL")
                                           or os.environ.get("DATABASE_URL"))
    if opts.restart_db_every and not embedded_server and not opts.restart_cmd:
        raise ValueError("restart_db_every: an external server needs --restart-cmd "
                         "(e.g. 'pg_ctlcluster 15 main restart -m fast')")
    dsn = resolve_dsn(dsn)
    rng = random.Random(opts.seed)
    run = App(dsn, schema=opts.schema)
    with run.connect() as conn:
        conn.execute(render(DROP_SCHEMA, run.schema))
    run.migrate()
    with run.connect() as conn:
        conn.execute(render(CHAOS_TABLES, run.schema))
    app_name = f"skipjack-chaos-{os.getpid()}"
    logs = Path(tempfile.mkdtemp(prefix="skipjack-chaos-"))
    workers = _Workers(dsn, opts, logs, app_name)
    faults = {"kills": 0, "stalls": 0, "graceful_stops": 0, "db_restarts": 0,
              "backend_terminations": 0}
    every = {"kills": opts.kill_every, "stalls": opts.stall_every,
             "graceful_stops": opts.term_every,
             "db_restarts": opts.restart_db_every,
             "backend_terminations": opts.terminate_backends_every}
    started = time.monotonic()
    for _ in range(opts.workers):
        workers.start()
    job = effect.configure(queue="chaos")
    specs = [job.configure(idempotency_key=f"chaos-{i}").job(ms=opts.duration_ms)
             for i in range(opts.jobs)]  # keys make a retried enqueue safe
    for i in range(0, len(specs), 5000):
        _retrying(lambda chunk=specs[i:i + 5000]: run.enqueue_many(chunk))
    say(f"enqueued {opts.jobs} jobs; {opts.workers} workers; logs in {logs}")
    # each fault first strikes at a random point of its first interval, then at every interval
    next_at = {k: time.monotonic() + v * rng.uniform(0.2, 0.6) for k, v in every.items() if v}
    deadline = started + opts.timeout
    finished = 0
    try:
        while time.monotonic() < deadline:
            workers.resume_due()
            workers.reap()
            now = time.monotonic()
            for kind, at in list(next_at.items()):
                if now >= at:
                    if _inject(kind, workers, rng, opts, dsn, embedded_server, app_name, say):
                        faults[kind] += 1
                    next_at[kind] = now + every[kind]
            finished = _retrying(lambda: _count_finished(run), default=finished)
            if finished >= opts.jobs:
                break
            time.sleep(0.05)
    finally:
        workers.resume_due(everyone=True)
    say(f"finished {finished}/{opts.jobs}; waiting one lease and rescue interval")
    time.sleep(opts.lease * 1.5)  # let rescuers act on anything a fault left behind
    with run.connect() as conn:
        audit = dict(zip(("rows", "completed", "discarded", "unfinished", "stuck",
                          "duplicate_effects", "missing_effects", "duplicate_starts",
                          "max_attempt"),
                         conn.execute(render(CHAOS_AUDIT, run.schema)).fetchone() or (),
                         strict=True))
    workers.stop()
    with run.connect() as conn:
        row = conn.execute(render(CHAOS_GRACEFUL_LOSSES, run.schema), {
            "pids": [pid for pid, _, _ in workers.stopped],
            "stopped_at": [at for _, at, _ in workers.stopped]}).fetchone()
    graceful_losses = int(row[0]) if row else 0
    result = {
        "enqueued": opts.jobs,
        "completed": audit["completed"],
        "discarded": audit["discarded"],
        "unfinished": audit["unfinished"],
        "lost": opts.jobs - audit["completed"] - audit["discarded"] - audit["unfinished"],
        "stuck": audit["stuck"],
        "duplicate_effects": audit["duplicate_effects"],
        "missing_effects": audit["missing_effects"],
        "duplicate_starts": audit["duplicate_starts"],
        "stale_writes_rejected": workers.count_in_logs(r"stale \w+ rejected"),
        "leases_lost": workers.count_in_logs(r"lease (?:lost|expired):"),
        "max_attempt": audit["max_attempt"],
        "attempts_spent_by_graceful_stops": graceful_losses,
        # killed by the signal (not handled) or failed (1); 2 is a start that found no
        # database (a restart under way), which is no fault of the stop
        "graceful_stops_failed": sum(1 for _, _, status in workers.stopped
                                     if status < 0 or status == 1),
        "faults": faults,
        "elapsed_s": round(time.monotonic() - started, 2),
        "logs": str(logs),
    }
    # the workload never fails by itself: a discarded job means faults exhausted its attempts
    result["ok"] = not (result["lost"] or result["stuck"] or result["duplicate_effects"]
                        or result["missing_effects"] or result["discarded"]
                        or result["unfinished"] or graceful_losses
                        or result["graceful_stops_failed"])
    run.close()
    return result


def _inject(kind: str, workers: _Workers, rng: random.Random, opts: ChaosOptions, dsn: str,
            embedded_server: bool, app_name: str, say: Any) -> bool:
    """Inject one fault; False when it could not be (a stall needs two awake workers)."""
    if kind == "kills":
        workers.kill_one(rng)
    elif kind == "stalls":
        return workers.stall_one(rng, opts.lease * 2)
    elif kind == "graceful_stops":
        return workers.term_one(rng)
    elif kind == "db_restarts":
        say("restarting PostgreSQL")
        if embedded_server:
            embedded.run_pg_ctl("restart")
        else:
            subprocess.run(shlex.split(opts.restart_cmd or ""), check=True, timeout=120,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elif kind == "backend_terminations":
        _retrying(lambda: _terminate(dsn, app_name))
    return True


def _terminate(dsn: str, app_name: str) -> None:
    run = App(dsn)
    with run.connect(application_name="skipjack-chaos-controller") as conn:
        conn.execute(render(TERMINATE_BACKENDS, run.schema), {"application_name": app_name})


def _count_finished(run: App) -> int:
    with run.connect(application_name="skipjack-chaos-controller") as conn:
        row = conn.execute(render(CHAOS_FINISHED, run.schema)).fetchone()
    return int(row[0]) if row else 0


def _retrying(fn: Any, default: Any = None, attempts: int = 100) -> Any:
    """Call ``fn`` until the database answers (the controller rides out its own faults)."""
    for _ in range(attempts):
        try:
            return fn()
        except psycopg.OperationalError:
            time.sleep(0.2)
    if default is not None:
        return default
    return fn()
