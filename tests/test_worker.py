"""Real worker processes (``python -m skipjack worker``) against a real server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import operator
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import psycopg.rows
import pytest
from psycopg import sql

from skipjack import App, Task, current_job
from skipjack.context import Job
from skipjack.hooks import Hooks
from skipjack.outcome import Outcome, error_json
from skipjack.runtime import claim_mode, producer
from skipjack.runtime.completer import Completer
from skipjack.runtime.heartbeat import Leases
from skipjack.runtime.maintenance import rescue
from skipjack.runtime.report import Reporter, WorkerStats
from skipjack.runtime.worker import Worker
from skipjack.sql.claim import claim_params

from support import (
    TESTS,
    Server,
    WorkerProcess,
    create_log_tables,
    exec_counts,
    query,
    states,
    undo_claim,
    wait_until,
)

FAST = ["--lease", "2", "--heartbeat", "0.3", "--rescue-interval", "0.5", "--poll-interval", "0.5"]


@pytest.fixture
def tasks(app: App) -> App:
    """The app with the worker processes' task names registered, and the log tables."""
    create_log_tables(app.dsn, app.schema)
    for name in ("sleep", "async_sleep", "cpu", "cpu_async", "fail", "pooled", "nul",
                 "short_lease", "payload", "stubborn", "misbehave", "held_effect"):
        app.task(name=name)(lambda **kw: None)
    return app


def enqueue(app: App, task: str, n: int = 1, queue: str = "default", **args: Any) -> list[int]:
    t = app.tasks[task].configure(queue=queue)
    with app.connect() as conn:  # a fresh session: tests below terminate the others
        return app.enqueue_many([t.job(**args) for _ in range(n)], conn=conn)


def running(app: App) -> int:
    return states(app.dsn, app.schema).get("running", 0)


def test_eight_processes_drain_2000_jobs_exactly_once(tasks: App, tmp_path: Path) -> None:
    ids = enqueue(tasks, "sleep", 2000, seconds=0.002)
    workers = [WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "4",
                             *FAST, log=tmp_path / f"w{i}.log") for i in range(8)]
    try:
        wait_until(lambda: states(tasks.dsn, tasks.schema).get("succeeded") == 2000,
                   timeout=240, what="2000 jobs succeeded")
    finally:
        for w in workers:
            w.kill()
    starts = exec_counts(tasks.dsn, tasks.schema, "start")
    finishes = exec_counts(tasks.dsn, tasks.schema, "finish")
    assert sorted(starts) == sorted(ids)
    assert set(starts.values()) == {1} and set(finishes.values()) == {1}
    per_worker = query(tasks.dsn, "SELECT pid, count(*) FROM {schema}.exec_log "
                       "WHERE event = 'start' GROUP BY pid", schema=tasks.schema)
    assert len(per_worker) >= 2  # the work was shared


def test_failing_job_retries_then_dead_letter_and_worker_goes_on(tasks: App,
                                                                 tmp_path: Path) -> None:
    bad = tasks.enqueue(tasks.tasks["fail"].configure(max_attempts=3).job(message="bad news"))
    slow = tasks.enqueue(tasks.tasks["fail"].configure(max_attempts=1).job(message="slow",
                                                                           timeout=True))
    unknown = tasks.enqueue(tasks.tasks["sleep"].configure(max_attempts=2).job())
    query(tasks.dsn, "UPDATE {schema}.jobs SET task = 'no.such.task' WHERE id = %s", [unknown],
          schema=tasks.schema)
    good = enqueue(tasks, "sleep", 10)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, "--unknown-task-grace",
                       "1s", log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 10, "discarded": 3},
                   timeout=60, what="all jobs finished")
    job = tasks.get_job(bad)
    assert job is not None and job["attempt"] == 3 and len(job["errors"]) == 3
    assert "RuntimeError: bad news" in job["errors"][-1]["error"]
    assert "Traceback" in job["errors"][-1]["traceback"]
    # the handler's own frames, also for a TimeoutError (which asyncio used to replace),
    # from the handler's first: not the worker's that called it
    for failed in (job, tasks.get_job(slow) or {}):
        assert 'jobs_app.py", line' in failed["errors"][-1]["traceback"]
    # skipjack's frame that called the handler, then the handler's
    frames = [line for line in job["errors"][-1]["traceback"].splitlines()
              if line.startswith('  File "')]
    assert "skipjack" in frames[0] and 'jobs_app.py", line' in frames[1], frames
    assert "TimeoutError: slow" in (tasks.get_job(slow) or {})["errors"][-1]["error"]
    lost = tasks.get_job(unknown)
    assert lost is not None and "unknown task 'no.such.task'" in lost["errors"][-1]["error"]
    assert set(exec_counts(tasks.dsn, tasks.schema, "finish")) == set(good)


def test_fc17_nul_in_error_text_and_result_reaches_a_terminal_state(tasks: App,
                                                                   tmp_path: Path) -> None:
    failing = tasks.enqueue(tasks.tasks["nul"].configure(max_attempts=1).job())
    returning = tasks.enqueue(tasks.tasks["nul"].configure(max_attempts=2).job())
    ok = enqueue(tasks, "sleep", 10)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 11, "discarded": 1},
                   timeout=60, what="terminal states")
    failed = tasks.get_job(failing) or {}
    assert failed["state"] == "discarded"
    assert failed["errors"][-1]["error"] == "RuntimeError: bad\ufffdbyte"
    assert "bad\ufffdbyte" in failed["errors"][-1]["traceback"]
    assert (tasks.get_job(returning) or {})["result"] == "result\ufffdwith nul"
    assert set(exec_counts(tasks.dsn, tasks.schema, "finish")) == {*ok, returning}


def test_fc22_sigterm_releases_unfinished_jobs_at_once(tasks: App, tmp_path: Path) -> None:
    long_ids = enqueue(tasks, "sleep", 2, seconds=60)
    w = WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "2", "--grace",
                      "0.5", *FAST, log=tmp_path / "w.log")
    try:
        wait_until(lambda: len(exec_counts(tasks.dsn, tasks.schema)) == 2, timeout=30,
                   what="both long jobs started")
        short = enqueue(tasks, "sleep", 10, seconds=0.01)
        w.signal(signal.SIGTERM)
        assert w.wait(30) == 0
    finally:
        w.kill()
    rows = query(tasks.dsn, "SELECT id, state, attempt, lease_expires_at FROM {schema}.jobs "
                 "WHERE id = ANY(%s)", [long_ids], schema=tasks.schema)
    assert [(r[1], r[2], r[3]) for r in rows] == [("available", 0, None)] * 2
    assert exec_counts(tasks.dsn, tasks.schema).keys() == set(long_ids)  # claimed nothing new
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "4", *FAST,
                       log=tmp_path / "w2.log"):
        wait_until(lambda: set(exec_counts(tasks.dsn, tasks.schema, "finish")) >= set(short),
                   timeout=30, what="short jobs done by the new worker")
    assert all(exec_counts(tasks.dsn, tasks.schema, "finish")[i] == 1 for i in short)


def test_unknown_task_waits_for_a_worker_that_knows_it_without_using_attempts(
        tasks: App, tmp_path: Path) -> None:
    """A job of a task this worker does not know (a rolling deploy: an old worker sees a new
    task) is released, its attempt not counted, while it is younger than the grace, and its
    error is kept once however often it is released; the worker says which task it does
    not know. Past the grace, the job goes to the dead letter."""
    (job_id,) = enqueue(tasks, "sleep")
    query(tasks.dsn, "UPDATE {schema}.jobs SET task = 'newer.task', max_attempts = 1 "
                     "WHERE id = %s", [job_id], schema=tasks.schema)
    # released for 8 s after its enqueue, each time for half of that
    w = WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, "--unknown-task-grace",
                      "8s", log=tmp_path / "w.log")
    with w:
        job = wait_until(lambda: (j := tasks.get_job(job_id)) and j["errors"] and j,
                         timeout=30, what="the job released once")
        assert job["state"] in ("scheduled", "available") and job["attempt"] == 0
        assert "unknown task 'newer.task'" in job["errors"][-1]["error"]
        assert "unknown task 'newer.task'" in w.log()
        wait_until(lambda: w.log().count(f"job {job_id} released") >= 2, timeout=30,
                   what="a second release")
        again = tasks.get_job(job_id) or {}
        assert again["attempt"] == 0 and len(again["errors"]) == 1
        assert again["errors"][0]["at"] > job["errors"][0]["at"]  # the latest release's
        final = wait_until(lambda: (j := tasks.get_job(job_id)) and j["state"] == "discarded"
                           and j, timeout=30, what="the dead letter after the grace")
    assert final["attempt"] == 1 and len(final["errors"]) == 2
    assert all("unknown task 'newer.task'" in e["error"] for e in final["errors"])


def test_args_that_do_not_fit_the_handler_go_to_the_dead_letter_at_once(
        tasks: App, tmp_path: Path) -> None:
    """An enqueuer that does not know the handler's signature sent a misspelt argument: the
    worker does not call the handler and discards the job on its first attempt."""
    (misspelt,) = enqueue(tasks, "sleep", secnds=1)  # sleep(seconds=0.0) in jobs_app
    (fine,) = enqueue(tasks, "sleep", seconds=0)
    (array,) = enqueue(tasks, "sleep", seconds=0)  # its args made an array by other code
    query(tasks.dsn, "UPDATE {schema}.jobs SET args = '[1, 2]' WHERE id = %s", [array],
          schema=tasks.schema)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1, "discarded": 2},
                   timeout=30, what="the jobs finished")
    job = tasks.get_job(misspelt) or {}
    assert job["state"] == "discarded" and job["attempt"] == 1
    assert job["errors"][-1]["error"].startswith("ArgumentsError: unexpected argument 'secnds'")
    job = tasks.get_job(array) or {}
    assert job["state"] == "discarded" and job["attempt"] == 1
    assert job["errors"][-1]["error"] == ("ArgumentsError: a job's args must be a JSON object "
                                          "of keyword arguments, not an array")
    assert set(exec_counts(tasks.dsn, tasks.schema)) == {fine}  # never called with them


def _three_claimed(app: App) -> tuple[list[int], dict[int, Job]]:
    """Three jobs of queue "q" enqueued and claimed here: their ids in order, and the jobs."""
    t = app.task(name="t", queue="q")(lambda: None)
    ids = [t.enqueue() for _ in range(3)]
    with app.connect() as conn:
        rows = conn.execute(app.queries.CLAIM, claim_params(
            "q", 3, lease=30.0, worker="w", inline_bytes=1 << 20)).fetchall()
    return ids, {row[0]: Job.from_row(row) for row in rows}


def test_an_outcome_the_database_refuses_is_recorded_without_the_rest_waiting(
        app: App) -> None:
    """One outcome of a batch that the database refuses (a retry delay past its timestamps'
    range) is written again in a form it takes, with the handler's real error; the other
    outcomes of the batch are written as they are."""
    ids, jobs = _three_claimed(app)
    bad = jobs[ids[1]]
    outcomes = [Outcome(jobs[ids[0]].id, jobs[ids[0]].lease_version, "q", "complete"),
                Outcome(bad.id, bad.lease_version, "q", "retry", delay=1e18,
                        error=error_json(bad, RuntimeError("the real error"))),
                Outcome(jobs[ids[2]].id, jobs[ids[2]].lease_version, "q", "complete")]
    stats = WorkerStats()

    async def record() -> None:
        completer = Completer(app.db, Leases(), Reporter(Hooks(), stats).recorded)
        runner = asyncio.create_task(completer.run())
        for o in outcomes:
            completer.submit(o)
        await asyncio.wait_for(completer.flush(), timeout=60)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(record())
    assert states(app.dsn, app.schema) == {"succeeded": 2, "scheduled": 1}
    job = app.get_job(bad.id) or {}
    assert job["errors"][-1]["error"].startswith("RuntimeError: the real error (the outcome")
    assert "refused by the database" in job["errors"][-1]["error"]
    assert (stats.succeeded, stats.retried, stats.stale_writes) == (2, 1, 0)


def test_outcomes_that_arrive_during_a_write_wait_to_share_the_next_statement(
        app: App) -> None:
    """While jobs still run, the outcomes that came in while a batch was being written are
    not sent at once as a statement of their own: they wait (the linger) for more, and go
    out with those. Which outcomes shared a statement shows in finished_at (the time of the
    statement's transaction)."""
    ids, jobs = _three_claimed(app)
    first, during, after = (Outcome(jobs[i].id, jobs[i].lease_version, "q", "complete")
                            for i in ids)
    written: list[int] = []

    def recorded(o: Outcome, state: str | None, run_at: Any) -> None:
        written.append(o.id)

    async def deadline(condition: Any, what: str) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while not condition():
            assert loop.time() < end, f"timed out waiting for {what}"
            await asyncio.sleep(0.001)

    async def record() -> None:
        completer = Completer(app.db, Leases(), recorded, more_coming=lambda: True,
                              wait=lambda: 0.3)
        runner = asyncio.create_task(completer.run())
        # the first outcome's write waits for a row lock held here, so that the second
        # outcome arrives while it is being written
        blocker = await app.db.connect_async(autocommit=False)
        await blocker.execute(sql.SQL("SELECT 1 FROM {}.jobs WHERE id = %s FOR UPDATE").format(
            sql.Identifier(app.schema)), [first.id])
        completer.submit(first)
        await deadline(lambda: completer._writing, "the first write")
        completer.submit(during)
        await blocker.commit()
        await blocker.close()
        await deadline(lambda: written, "the first outcome written")
        completer.submit(after)
        await asyncio.wait_for(completer.flush(), timeout=60)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(record())
    assert written == [first.id, during.id, after.id]
    finished = dict(query(app.dsn, "SELECT id, finished_at FROM {schema}.jobs",
                          schema=app.schema))
    assert finished[during.id] == finished[after.id] != finished[first.id]


def test_the_outcome_of_the_workers_last_job_ends_the_linger(app: App) -> None:
    """A small batch waits for more outcomes while jobs still run (the linger, here 10
    minutes); the outcome of the last job the worker holds (nothing running or buffered any
    more) ends that wait: both outcomes go out at once, in one statement."""
    ids, jobs = _three_claimed(app)
    first, last = (Outcome(jobs[i].id, jobs[i].lease_version, "q", "complete")
                   for i in ids[:2])
    running = [2]
    lingering: list[bool] = []
    written: list[int] = []

    def linger() -> float:
        lingering.append(True)
        return 600.0

    async def record() -> None:
        completer = Completer(app.db, Leases(), lambda o, *_: written.append(o.id),
                              more_coming=lambda: running[0] > 0, wait=linger,
                              drained=lambda: running[0] == 0)
        runner = asyncio.create_task(completer.run())
        running[0] -= 1
        completer.submit(first)
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while not lingering:  # the completer waits for more once it has run up to its wait
            assert loop.time() < end, "timed out waiting for the linger"
            await asyncio.sleep(0.001)
        running[0] -= 1
        completer.submit(last)
        while len(written) < 2:
            assert loop.time() < end, "timed out waiting for the batch to be written"
            await asyncio.sleep(0.001)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(record())
    assert sorted(written) == sorted([first.id, last.id])
    finished = dict(query(app.dsn, "SELECT id, finished_at FROM {schema}.jobs",
                          schema=app.schema))
    assert finished[first.id] == finished[last.id] is not None


@pytest.mark.parametrize(("task", "how", "seconds"), [
    ("claim_misbehaves", "COMMIT", 3.0),  # longer than its 2 s lease: must not be rescued
    ("claim_misbehaves", "ROLLBACK", 0.0),
    ("claim_misbehaves", "abort", 0.0),
    ("claim_misbehaves", "COMMIT_BEGIN", 3.0),
    ("claim_misbehaves", "ROLLBACK_BEGIN", 0.0),
    ("complete_misbehaves", "COMMIT", 0.0),
    ("complete_misbehaves", "ROLLBACK", 0.0),
    ("complete_misbehaves", "abort", 0.0),
    ("complete_misbehaves", "COMMIT_BEGIN", 0.0),
    ("complete_misbehaves", "ROLLBACK_BEGIN", 0.0),
])
def test_a_handler_that_ends_its_jobs_transaction_fails_its_attempt(
        tasks: App, tmp_path: Path, task: str, how: str, seconds: float) -> None:
    """A transaction="claim" or "complete" handler that sends COMMIT or ROLLBACK on the
    connection it was given, or goes on after a failed statement: its attempt fails with an
    error that says so, and its next attempt succeeds. A claim-mode job whose handler
    committed its claim is renewed meanwhile, so it is never run twice at once."""
    tasks.task(name=task, max_attempts=2)(lambda **kw: None)
    (job_id,) = enqueue(tasks, task, how=how, seconds=seconds)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=60,
                   what="the job done on its second attempt")
    job = tasks.get_job(job_id) or {}
    undone = (task, how[:8]) == ("claim_misbehaves", "ROLLBACK")
    if undone and not job["errors"]:
        # the ROLLBACK undid the claim: another claim took the job at once and succeeded
        # before the failed attempt's outcome was written, which its fencing then refused
        return
    assert len(job["errors"]) == 1, job["errors"]
    # a ROLLBACK undid the claim: a claim that came before the failed attempt was counted
    # ran the job again at once, and only the error is added
    assert job["attempt"] == 2 or undone, job
    error = job["errors"][0]["error"]
    assert error.startswith("HandlerTransactionError: "), error
    assert ("went on" in error) if how == "abort" else ("ended the job's transaction" in error)
    events = query(tasks.dsn, "SELECT event FROM {schema}.exec_log ORDER BY at",
                   schema=tasks.schema)
    if not undone:  # it may start again at once
        assert [e for (e,) in events] == ["start", "finish", "start", "finish"]  # one at a time


def test_a_committed_claim_mode_job_is_renewed_by_its_task_s_lease(
        tasks: App, tmp_path: Path) -> None:
    """A claim-mode job with no lease of its own, whose handler committed its claim, is
    renewed by the heartbeat for its task's lease (2 s), the lease it was claimed with, not
    for the worker's (30 s): a worker that dies then gives it back to the rescuer after 2 s."""
    tasks.task(name="claim_misbehaves", max_attempts=2)(lambda **kw: None)
    (job_id,) = enqueue(tasks, "claim_misbehaves", how="COMMIT_BEGIN", seconds=3.0)
    query(tasks.dsn, "UPDATE {schema}.jobs SET lease_seconds = NULL WHERE id = %s", [job_id],
          schema=tasks.schema)
    renewed = ("SELECT extract(epoch FROM lease_expires_at - now())::float8 FROM {schema}.jobs"
               " WHERE id = %s AND state = 'running'"
               " AND lease_expires_at > attempted_at + interval '2.05 s'")
    left: list[float] = []  # seconds from the renewal's read to the lease's end

    def renewal() -> bool:
        left.extend(r[0] for r in query(tasks.dsn, renewed, [job_id], schema=tasks.schema))
        return bool(left)

    args = ["--lease", "30", "--heartbeat", "0.3", "--rescue-interval", "0.5"]
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args, log=tmp_path / "w.log"):
        wait_until(renewal, timeout=30, what="a renewal of the committed claim")
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=60,
                   what="the job done on its second attempt")
    assert 0 < left[0] <= 2.0, left


def test_a_short_idle_timeout_of_the_role_does_not_end_complete_handlers(
        tasks: App, tmp_path: Path) -> None:
    """The database's idle_in_transaction_session_timeout (here 300 ms, set for the worker's
    sessions) is shorter than the handler's run: its transaction still commits."""
    tasks.task(name="complete_misbehaves", max_attempts=2)(lambda **kw: None)
    (job_id,) = enqueue(tasks, "complete_misbehaves", how="none", seconds=1.0)
    query(tasks.dsn, "UPDATE {schema}.jobs SET attempt = 1, max_attempts = 3 WHERE id = %s",
          [job_id], schema=tasks.schema)  # past the first attempt: it only sleeps
    dsn = tasks.dsn + ("&" if "?" in tasks.dsn else "?") + \
        "options=-c%20idle_in_transaction_session_timeout%3D300"
    with WorkerProcess(dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=60,
                   what="the job done")
    assert (tasks.get_job(job_id) or {})["errors"] == []


def test_fc35_a_job_the_claim_fails_on_holds_up_no_other(tasks: App, tmp_path: Path) -> None:
    """A trigger of the application's makes the claim statement fail for one job, which every
    batch of 50 would include: the 199 others run while the fault is there, the worker stays
    up and backs off on that job (no spinning), and runs it once the fault is gone."""
    ids = enqueue(tasks, "sleep", 200)
    poison = ids[0]  # the first in claim order: in the first batch, and in every later one
    _trigger(tasks, poison, "running")
    w = WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--batch-size", "50", *FAST,
                      log=tmp_path / "w.log")
    with w:
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 199,
                                                               "available": 1},
                   timeout=60, what="every job but the poisoned one done")
        assert w.proc.poll() is None
        tries = w.log().count(f"job {poison}: claiming it fails")
        assert 1 <= tries <= 8, tries  # skipped, backing off: 1 s, 2 s, 4 s ...
        query(tasks.dsn, "DROP TRIGGER refuse ON {schema}.jobs", schema=tasks.schema)
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 200},
                   timeout=90, what="the poisoned job run once the fault is gone")
    assert (tasks.get_job(poison) or {})["attempt"] == 1


def _trigger(app: App, job_id: int, state: str) -> None:
    """Make every update of ``job_id`` to ``state`` fail (a trigger of the application's)."""
    query(app.dsn, """
        CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.id = %s AND NEW.state = '%t' THEN
                RAISE EXCEPTION 'job % may not become %t', NEW.id;
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse BEFORE UPDATE ON {schema}.jobs
            FOR EACH ROW EXECUTE FUNCTION {schema}.refuse();
    """.replace("%s", str(job_id)).replace("%t", state), schema=app.schema)


def test_fc35_a_claim_mode_job_the_claim_fails_on_holds_up_no_other(
        tasks: App, tmp_path: Path) -> None:
    ids = enqueue(tasks, "held_effect", 6)
    _trigger(tasks, ids[0], "running")
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 5,
                                                               "available": 1},
                   timeout=60, what="every claim-mode job but the poisoned one done")
        query(tasks.dsn, "DROP TRIGGER refuse ON {schema}.jobs", schema=tasks.schema)
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 6}, timeout=90,
                   what="the poisoned job run once the fault is gone")


def test_a_claim_mode_job_whose_transaction_cannot_commit_uses_its_attempts(
        tasks: App, tmp_path: Path) -> None:
    """The database refuses a claim-mode job's outcome (here a trigger; a deferred constraint
    does the same at commit): its transaction rolls back, claim and all, so the failed
    attempt is counted on its own; the job ends in the dead letter with the real error
    instead of running forever, and the other jobs run."""
    ids = enqueue(tasks, "held_effect", 6)
    query(tasks.dsn, "UPDATE {schema}.jobs SET max_attempts = 2 WHERE id = %s", [ids[0]],
          schema=tasks.schema)
    _trigger(tasks, ids[0], "succeeded")
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 5,
                                                               "discarded": 1},
                   timeout=60, what="the others done, the refused one in the dead letter")
    job = tasks.get_job(ids[0]) or {}
    assert job["attempt"] == 2 and len(job["errors"]) == 2
    assert "may not become succeeded" in job["errors"][-1]["error"]
    assert exec_counts(tasks.dsn, tasks.schema)[ids[0]] == 2


def test_a_claim_mode_failure_the_database_refuses_is_written_again_in_the_claim(
        tasks: App, tmp_path: Path) -> None:
    """A claim-mode handler fails (it discards its job) and the database refuses that
    outcome (a trigger): the refusal is written instead, as a retry, in the claim's own
    transaction, the claim kept, so no other claim can take the job before its attempt is
    counted. Before, the refusal rolled back the whole claim and the attempt was counted
    afterwards in a transaction of its own, with the job claimable in between."""
    tasks.task(name="claim_discards")(lambda: None)
    job_id, = enqueue(tasks, "claim_discards", 1)
    _trigger(tasks, job_id, "discarded")
    log = tmp_path / "w.log"
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=log):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=60,
                   what="the job retried after its refused dead letter, then done")
    job = tasks.get_job(job_id) or {}
    assert job["attempt"] == 2 and len(job["errors"]) == 1
    assert "may not become discarded" in job["errors"][0]["error"]
    text = log.read_text()
    assert "its outcome was refused by the database" in text
    assert "could not commit" not in text


def test_fc22_sigterm_during_claims_strands_no_job(tasks: App, tmp_path: Path) -> None:
    """SIGTERM lands while claims are in flight (32 slots, a deep queue of 1 ms jobs, the
    signal sent at a different point of each of 8 runs): after every exit no job is running,
    none took a second attempt, none started twice; the worker's own summary counts the
    jobs it released."""
    enqueue(tasks, "sleep", 2000, seconds=0.001)

    def succeeded() -> int:
        return states(tasks.dsn, tasks.schema).get("succeeded", 0)

    for run in range(8):
        target = succeeded() + 40 * (run + 1)  # a later point of the drain each run
        log = tmp_path / f"w{run}.log"
        with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "32",
                           *FAST, log=log) as w:
            wait_until(lambda t=target: succeeded() >= t, timeout=60,  # type: ignore[misc]
                       what="the worker running jobs")
            w.signal(signal.SIGTERM)
            assert w.wait(60) == 0
        now = states(tasks.dsn, tasks.schema)
        assert now.get("running", 0) == 0, (run, now)
        extra = query(tasks.dsn, "SELECT count(*) FROM {schema}.jobs WHERE attempt > 1 "
                                 "OR (state <> 'succeeded' AND attempt > 0)",
                      schema=tasks.schema)[0][0]
        assert extra == 0, run
        assert max(exec_counts(tasks.dsn, tasks.schema).values()) == 1
        assert re.search(r"stopped: claimed \d+, succeeded \d+", w.log())
        if now.get("available", 0) < 1000:
            enqueue(tasks, "sleep", 1000, seconds=0.001)


@pytest.mark.parametrize("variant", ["same_name", "other_name"])
def test_fc01_sigkilled_worker_jobs_are_rescued(tasks: App, tmp_path: Path,
                                                variant: str) -> None:
    ids = enqueue(tasks, "sleep", 10, seconds=60)
    w1 = WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "10",
                       "--name", "w", *FAST, log=tmp_path / "w1.log")
    wait_until(lambda: len(exec_counts(tasks.dsn, tasks.schema)) == 10, timeout=30,
               what="10 handlers started")
    w1.kill()
    query(tasks.dsn, "UPDATE {schema}.jobs SET args = '{{\"seconds\": 0}}'", schema=tasks.schema)
    name = "w" if variant == "same_name" else "w2"
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "10",
                       "--name", name, *FAST, log=tmp_path / "w2.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 10}, timeout=60,
                   what="rescued jobs finished")
    starts = exec_counts(tasks.dsn, tasks.schema, "start")
    finishes = exec_counts(tasks.dsn, tasks.schema, "finish")
    assert all(starts[i] == 2 and finishes[i] == 1 for i in ids)
    attempts = query(tasks.dsn, "SELECT DISTINCT attempt FROM {schema}.jobs", schema=tasks.schema)
    assert attempts == [(2,)]


def test_fc01_sigkill_on_last_attempt_goes_to_dead_letter(tasks: App, tmp_path: Path) -> None:
    job_id = tasks.enqueue(tasks.tasks["sleep"].configure(max_attempts=1).job(seconds=60))
    w1 = WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w1.log")
    wait_until(lambda: exec_counts(tasks.dsn, tasks.schema) == {job_id: 1}, timeout=30,
               what="handler started")
    w1.kill()
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w2.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"discarded": 1}, timeout=30,
                   what="discarded after lease expiry")
    assert "lease expired" in (tasks.get_job(job_id) or {})["errors"][-1]["error"]


def test_fc01c_per_task_lease_rescues_long_before_the_worker_lease(tasks: App,
                                                                   tmp_path: Path) -> None:
    """Worker lease 1 h, but the task declares 2 s: a SIGKILLed worker's job comes back
    after about 2 s, not 1 h."""
    job_id = tasks.enqueue(tasks.tasks["short_lease"].configure(lease=2.0).job(seconds=60))
    args = ["--lease", "3600", "--heartbeat", "0.3", "--rescue-interval", "0.5"]
    w1 = WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args, log=tmp_path / "w1.log")
    wait_until(lambda: exec_counts(tasks.dsn, tasks.schema) == {job_id: 1}, timeout=30,
               what="handler started")
    (expiry,) = query(tasks.dsn, "SELECT lease_expires_at - attempted_at FROM {schema}.jobs",
                      schema=tasks.schema)[0]
    assert expiry.total_seconds() <= 2.0
    w1.kill()
    query(tasks.dsn, "UPDATE {schema}.jobs SET args = '{{}}'", schema=tasks.schema)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args, log=tmp_path / "w2.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=30,
                   what="rescued and finished")
    assert exec_counts(tasks.dsn, tasks.schema) == {job_id: 2}


def test_task_lease_too_short_for_heartbeat_is_refused(tasks: App, tmp_path: Path) -> None:
    w = WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--lease", "30", "--heartbeat", "5",
                      log=tmp_path / "w.log")
    assert w.wait(60) == 2
    assert "task 'short_lease': lease 2.0s cannot be kept alive by a 5.0s heartbeat" in w.log()


def test_fc08_big_payloads_are_loaded_per_job_within_a_memory_budget(tasks: App,
                                                                    tmp_path: Path) -> None:
    """30 jobs of 20 MB args (compressible), batch 30: all complete, and the worker's peak
    RSS stays far below the 30 x 20 MB the batch would take if fetched with the claim."""
    big = tasks.tasks["payload"].job(data="a" * 20_000_000)
    with tasks.connect() as conn:
        for _ in range(3):
            tasks.enqueue_many([big] * 10, conn=conn)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "30", *FAST,
                       log=tmp_path / "w.log") as w:
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 30}, timeout=180,
                   what="big jobs done")
        status = Path(f"/proc/{w.pid}/status").read_text()
    peak_kb = int(next(line.split()[1] for line in status.splitlines()
                       if line.startswith("VmHWM")))
    assert peak_kb < 600_000, f"peak RSS {peak_kb} kB"


@pytest.mark.parametrize("task", ["sleep", "cpu", "cpu_async"])
def test_fc04_heartbeat_keeps_long_jobs_single(tasks: App, tmp_path: Path, task: str) -> None:
    """A 5 s job under a 1 s lease: renewed throughout (also while the handler holds the GIL
    or blocks the event loop), so it is claimed once and runs once."""
    (job_id,) = enqueue(tasks, task, seconds=5)
    args = ["--lease", "1", "--heartbeat", "0.2", "--rescue-interval", "0.3",
            "--poll-interval", "0.3"]
    workers = [WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args,
                             log=tmp_path / f"w{i}.log") for i in range(4)]
    try:
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=60,
                   what="long job finished")
    finally:
        for w in workers:
            w.kill()
    job = tasks.get_job(job_id)
    assert job is not None and job["attempt"] == 1  # claimed once
    assert exec_counts(tasks.dsn, tasks.schema) == {job_id: 1}


def test_fc30_handlers_exhausting_their_pool_do_not_starve_leases(tasks: App,
                                                                   tmp_path: Path) -> None:
    """Pool of 4, concurrency 10, each handler holds a pooled transaction for 0.3 s."""
    ids = enqueue(tasks, "pooled", 40, seconds=0.3)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "10",
                       "--lease", "1", "--heartbeat", "0.2", "--rescue-interval", "0.3",
                       log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 40}, timeout=120,
                   what="pooled jobs done")
    assert exec_counts(tasks.dsn, tasks.schema) == dict.fromkeys(ids, 1)
    assert query(tasks.dsn, "SELECT max(attempt) FROM {schema}.jobs",
                 schema=tasks.schema) == [(1,)]  # no job claimed twice


def test_worker_refuses_schema_newer_than_code(tasks: App, tmp_path: Path) -> None:
    query(tasks.dsn, "INSERT INTO {schema}.migrations (version, name) VALUES (9999, 'future')",
          schema=tasks.schema)
    w = WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log")
    assert w.wait(60) == 2
    assert "newer than this skipjack" in w.log()


def test_fc05_listener_and_all_sessions_terminated(tasks: App, server: Server,
                                                   tmp_path: Path) -> None:
    """Poll interval 60 s: pickup must come from a re-established LISTEN."""
    args = ["--lease", "5", "--heartbeat", "0.5", "--poll-interval", "60"]
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args, log=tmp_path / "w.log") as w:
        first = enqueue(tasks, "sleep")
        wait_until(lambda: exec_counts(tasks.dsn, tasks.schema, "finish").keys() == set(first),
                   timeout=30, what="first job")
        for target in ("LISTEN%", "%"):
            query(server.dsn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                  "WHERE application_name = %s AND query ILIKE %s", [w.application_name, target])
            wait_until(lambda: _listeners(server, w) == 1, timeout=30, what="one LISTEN again")
            more = enqueue(tasks, "sleep", 5)
            wait_until(lambda m=more: set(m) <= exec_counts(tasks.dsn, tasks.schema,
                                                            "finish").keys(),
                       timeout=20, what="jobs after reconnect")
        assert w.proc.poll() is None


def _listeners(server: Server, w: WorkerProcess) -> int:
    return int(query(server.dsn, "SELECT count(*) FROM pg_stat_activity WHERE "
                     "application_name = %s AND query ILIKE 'LISTEN%%'",
                     [w.application_name])[0][0])


def test_fc05_worker_survives_server_restart(tasks: App, server: Server,
                                             tmp_path: Path) -> None:
    args = ["--lease", "5", "--heartbeat", "0.5", "--poll-interval", "60"]
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args, log=tmp_path / "w.log") as w:
        before = enqueue(tasks, "sleep", 3)
        wait_until(lambda: exec_counts(tasks.dsn, tasks.schema, "finish").keys() == set(before),
                   timeout=30, what="jobs before restart")
        server.restart()
        wait_until(lambda: _listeners(server, w) == 1, timeout=60, what="LISTEN re-established")
        after = enqueue(tasks, "sleep", 5)
        wait_until(lambda: set(after) <= exec_counts(tasks.dsn, tasks.schema, "finish").keys(),
                   timeout=30, what="jobs after restart")
        assert w.proc.poll() is None
        assert "reconnecting" in w.log() or "retrying" in w.log()


# --- regressions: handlers that misbehave ---------------------------------------------------

def test_misbehaving_handlers_fail_only_their_own_job(tasks: App, tmp_path: Path) -> None:
    """sys.exit(), an exception whose __str__ raises, a handler raising CancelledError itself,
    and a 2 MiB result: each ends its own job; the worker and other jobs go on."""
    m = tasks.tasks["misbehave"].configure(max_attempts=1)
    ids = {how: tasks.enqueue(m.job(how=how))
           for how in ("exit", "bad_str", "cancelled", "huge_result")}
    ok = enqueue(tasks, "sleep", 5)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log") as w:
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 6, "discarded": 3},
                   timeout=60, what="all jobs ended")
        assert w.proc.poll() is None
    errors = {how: (tasks.get_job(i) or {})["errors"] for how, i in ids.items()}
    assert "SystemExit: 3" in errors["exit"][-1]["error"]
    assert "BadStr: <unprintable BadStr>" in errors["bad_str"][-1]["error"]
    assert "CancelledError" in errors["cancelled"][-1]["error"]
    huge = tasks.get_job(ids["huge_result"]) or {}
    assert huge["state"] == "succeeded" and "result not stored" in huge["result"]
    assert set(exec_counts(tasks.dsn, tasks.schema, "finish")) == set(ok)


def test_a_handler_s_base_exception_fails_its_attempt_in_every_mode(
        tasks: App, tmp_path: Path) -> None:
    """SystemExit, KeyboardInterrupt, GeneratorExit and a library's own BaseException (none
    of them an Exception) raised by an async, a sync or a claim-mode handler: each fails its
    attempt (its last: the dead letter) and no more. Before, the last two left an async or
    sync job running for the worker's life, and in claim mode the first two ended the
    worker."""
    ways = {"exit": "SystemExit: 3", "keyboard": "KeyboardInterrupt",
            "generator_exit": "GeneratorExit", "library_abort": "LibraryAbort: aborted"}
    for name in ("misbehave_sync", "misbehave_claim"):
        tasks.task(name=name)(lambda **kw: None)
    ids = {(name, how): tasks.enqueue(tasks.tasks[name].configure(max_attempts=1).job(how=how))
           for name in ("misbehave", "misbehave_sync", "misbehave_claim") for how in ways}
    ok = enqueue(tasks, "sleep", 5)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log") as w:
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 5,
                                                               "discarded": len(ids)},
                   timeout=60, what="every job ended")
        assert w.proc.poll() is None
    for (name, how), job_id in ids.items():
        job = tasks.get_job(job_id) or {}
        assert (job["attempt"], len(job["errors"])) == (1, 1), (name, how, job)
        assert ways[how] in job["errors"][-1]["error"], (name, how, job["errors"])
    assert set(exec_counts(tasks.dsn, tasks.schema, "finish")) == set(ok)
    assert sorted(exec_counts(tasks.dsn, tasks.schema, "start").values()) == [1] * (len(ids) + 5)


@pytest.mark.parametrize("how", ["terminate", "close"])
def test_a_claim_whose_session_is_lost_counts_its_attempt_and_holds_back_no_other_job(
        tasks: App, tmp_path: Path, how: str) -> None:
    """A claim-mode handler that ends its claim's session (terminates its backend, closes its
    connection): the server rolls the claim back, and the worker counts the attempt all the
    same, so that the job is retried after its backoff and ends in the dead letter after
    its attempts. Before, it was claimed again at once, ahead of its queue's other jobs,
    without using attempts, and with one slot those never ran."""
    for name in ("claim_loses_session", "claim_ok"):
        tasks.task(name=name)(lambda **kw: None)
    bad = tasks.tasks["claim_loses_session"].configure(max_attempts=2).enqueue(how=how)
    ok = enqueue(tasks, "claim_ok", 5)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "1", *FAST,
                       log=tmp_path / "w.log") as w:
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 5, "discarded": 1},
                   timeout=60, what="every job ended")
        assert w.proc.poll() is None
    job = tasks.get_job(bad) or {}
    assert (job["attempt"], len(job["errors"])) == (2, 2), job
    assert exec_counts(tasks.dsn, tasks.schema)[bad] == 2
    assert set(ok) <= set(exec_counts(tasks.dsn, tasks.schema, "finish"))
    assert f"job {bad}: its claim's session was lost while its handler ran" in w.log()
    assert f"job {bad} failed: claim_loses_session on default, attempt 1/2" in w.log()


def test_an_async_handler_that_ignores_its_timeout_is_recorded_and_left_running(
        tasks: App, tmp_path: Path) -> None:
    """An async handler past its timeout that catches the CancelledError and goes on: its
    attempt fails all the same (here its last: the dead letter), CANCEL_GRACE seconds after
    the cancellation, as a sync handler's does; it runs on in its slot, and the worker's
    other slot goes on running jobs. Before, it held its job running, and its slot, for as
    long as it ran."""
    deaf = tasks.task(name="deaf", max_attempts=1)(lambda **kw: None).enqueue(seconds=3600)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "2", *FAST,
                       log=tmp_path / "w.log") as w:
        job = wait_until(lambda: (j := tasks.get_job(deaf)) and j["state"] == "discarded"
                         and j, timeout=60, what="the deaf handler's attempt recorded")
        assert job["errors"][-1]["error"] == "TimeoutError: timed out after 0.5s"
        assert f"job {deaf}: its async handler (deaf) went on for 5s after its cancellation" \
            in w.log()
        ok = enqueue(tasks, "sleep", 3)
        wait_until(lambda: set(ok) <= exec_counts(tasks.dsn, tasks.schema, "finish").keys(),
                   timeout=30, what="the other slot's jobs")
        assert exec_counts(tasks.dsn, tasks.schema, "cancel ignored") == {deaf: 1}
        assert deaf not in exec_counts(tasks.dsn, tasks.schema, "finish")  # it runs on
    assert f"job {deaf}: stale" not in w.log()


@pytest.mark.parametrize(("task", "seconds", "said"), [
    ("stubborn", None, "ignored cancellation"),  # an async handler that swallows it
    ("sleep", 120, "1 sync handler threads are still running"),  # a thread cannot be stopped
])
def test_sigterm_with_a_handler_that_does_not_stop(tasks: App, tmp_path: Path, task: str,
                                                   seconds: float | None, said: str) -> None:
    """The job is released, the worker says why, and the CLI exits without waiting."""
    (job_id,) = enqueue(tasks, task, **({} if seconds is None else {"seconds": seconds}))
    w = WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, "--grace", "0.5",
                      log=tmp_path / "w.log")
    try:
        wait_until(lambda: exec_counts(tasks.dsn, tasks.schema) == {job_id: 1}, timeout=30,
                   what="started")
        w.signal(signal.SIGTERM)
        assert w.wait(30) == 0
    finally:
        w.kill()
    job = tasks.get_job(job_id) or {}
    assert job["state"] == "available" and job["attempt"] == 0
    assert said in w.log()


def test_outcomes_the_database_does_not_take_stop_the_claims(tasks: App,
                                                             tmp_path: Path) -> None:
    """Another session holds a row lock on a finished job, so the completer's write waits:
    the worker must stop claiming once 1,000 outcomes wait (not run the whole queue with
    nothing recorded), and go on when the lock goes."""
    (locked,) = enqueue(tasks, "sleep", seconds=0.3)
    # a fixed prefetch of 10 keeps the bound small: 10 x 10 slots + 2 x 10, at least 1,000
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, "--concurrency", "10",
                       "--prefetch", "10", "--lease", "30", "--heartbeat", "0.5",
                       log=tmp_path / "w.log") as w, \
            psycopg.connect(tasks.dsn) as holder:
        wait_until(lambda: locked in exec_counts(tasks.dsn, tasks.schema), timeout=30,
                   what="the first job started")
        holder.execute(sql.SQL("SELECT 1 FROM {}.jobs WHERE id = %s FOR UPDATE")
                       .format(sql.Identifier(tasks.schema)), [locked])
        wait_until(lambda: locked in exec_counts(tasks.dsn, tasks.schema, "finish"),
                   timeout=30, what="the first job ended (its outcome now waits on the lock)")
        rest = enqueue(tasks, "sleep", 3000)
        wait_until(lambda: "claiming paused" in w.log(), timeout=60, what="claims paused")
        counts = states(tasks.dsn, tasks.schema)
        assert counts.get("available", 0) > 0  # the claims stopped before the queue emptied
        assert counts.get("running", 0) <= 1000 + 10 + 10 + 20  # bound + slots + buffer + claim
        holder.rollback()
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 3001},
                   timeout=120, what="every job done")
        assert "claiming again" in w.log()
    assert exec_counts(tasks.dsn, tasks.schema) == dict.fromkeys([locked, *rest], 1)


def test_a_job_buffered_while_held_claims_fill_the_slots_starts_when_they_end(
        tasks: App, tmp_path: Path) -> None:
    """Concurrency 1: a claim-mode job holds the slot while a lease-mode job is claimed into
    the prefetch buffer; when the held runner ends, the buffered job must start."""
    (held,) = enqueue(tasks, "held_effect", seconds=1.0)
    (plain,) = enqueue(tasks, "sleep")
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, "--concurrency", "1",
                       "--prefetch", "1", "--poll-interval", "60", log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 2}, timeout=30,
                   what="both jobs done")
    assert exec_counts(tasks.dsn, tasks.schema) == {held: 1, plain: 1}


def test_job_lease_shorter_than_the_heartbeat_is_raised_to_what_it_can_keep(
        tasks: App, tmp_path: Path) -> None:
    job_id = tasks.enqueue(tasks.tasks["sleep"].configure(lease=0.2).job(seconds=3))
    workers = [WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST,
                             log=tmp_path / f"w{i}.log") for i in range(2)]
    try:
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=30,
                   what="done")
    finally:
        for w in workers:
            w.kill()
    job = tasks.get_job(job_id) or {}
    assert job["attempt"] == 1 and exec_counts(tasks.dsn, tasks.schema) == {job_id: 1}


def test_enqueue_on_a_connection_with_another_row_factory(tasks: App) -> None:
    t = tasks.tasks["sleep"]
    with psycopg.connect(tasks.dsn, row_factory=psycopg.rows.dict_row) as conn:
        ids = tasks.enqueue_many([t.job(), t.configure(idempotency_key="k").job()], conn=conn)
        assert tasks.enqueue(t.configure(idempotency_key="k").job(), conn=conn) == ids[1]
    assert len(set(ids)) == 2


def test_schema_from_the_environment(tasks: App, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKIPJACK_SCHEMA", tasks.schema)
    assert App(tasks.dsn).schema == tasks.schema


@pytest.mark.parametrize("how", ["rescued", "claim undone"])
def test_job_claimed_again_by_the_same_worker_stops_its_stale_run(app: App, how: str) -> None:
    """A run is still going when this same worker claims its job again: the job was rescued
    after the run outlived its lease (a stalled worker), or a server crash undid the claim
    (claims commit without waiting for their flush; the row is reset here as the crash would
    leave it). The first run is told it lost the job, only the second run's outcome counts,
    and the worker keeps tracking and renewing the second run after the first one ended."""
    tokens: list[int] = []
    stale_cancelled = threading.Event()
    release = threading.Event()

    @app.task(name="twice", queue="q")
    async def twice() -> None:
        tokens.append(current_job().job.lease_version)
        if len(tokens) == 1:
            try:
                await asyncio.Event().wait()  # until cancelled
            except asyncio.CancelledError:
                stale_cancelled.set()
                raise
        while not release.is_set():  # still running when the first run has ended
            await asyncio.sleep(0.01)

    worker = Worker(app, ["q"], concurrency=2, lease=60, heartbeat=20, poll_interval=0.2)
    thread = threading.Thread(target=lambda: asyncio.run(worker.run_async()))
    thread.start()
    try:
        job_id = twice.enqueue()
        wait_until(lambda: len(tokens) == 1)
        if how == "rescued":
            query(app.dsn, "UPDATE {schema}.jobs SET lease_expires_at = now() - interval '1s' "
                           "WHERE id = %s", [job_id], schema=app.schema)
            with app.connect() as conn:
                assert rescue(conn, app.queries) == [(job_id, "available")]
        else:
            undo_claim(app.dsn, app.schema, job_id)
        wait_until(lambda: len(tokens) == 2 and stale_cancelled.is_set())
        assert tokens[0] != tokens[1]
        assert worker._slots.busy() == 1  # the second run is still tracked
        wait_until(lambda: job_id in worker._leases.by_id)  # and its lease still renewed
        assert worker._leases.by_id[job_id].lease_version == tokens[1]
        release.set()
        wait_until(lambda: (app.get_job(job_id) or {}).get("state") == "succeeded")
        job = app.get_job(job_id)
        assert job is not None and job["lease_version"] == tokens[1]
        assert worker.stats.leases_lost == 1 and worker.stats.succeeded == 1
        assert worker.stats.stale_writes == 0  # the stale run wrote nothing
        wait_until(lambda: worker._slots.busy() == 0)  # the stale run's slot is free again
    finally:
        release.set()
        worker.stop()
        thread.join(30)
    assert not thread.is_alive()


@pytest.mark.skipif("embedded" not in os.environ.get("SKIPJACK_TEST_SERVERS", "embedded"),
                    reason="embedded server not selected by SKIPJACK_TEST_SERVERS")
def test_cli_worker_on_the_embedded_server_stops_it_when_it_exits(tmp_path: Path) -> None:
    """The CLI ends with os._exit, which skips the embedded server's atexit hook: the worker
    was the server's last user, yet left it running for good."""
    data = Path.home() / ".cache" / "skipjack-tests" / f"exit-{secrets.token_hex(4)}"
    env = {k: v for k, v in os.environ.items()
           if k not in ("SKIPJACK_DATABASE_URL", "DATABASE_URL")}
    env.update(SKIPJACK_EMBEDDED_DIR=str(data), SKIPJACK_SCHEMA="exit_test",
               PYTHONUNBUFFERED="1")
    log = tmp_path / "w.log"
    pidfile = data / "postmaster.pid"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "skipjack", "worker", "jobs_app:app",
                                 "--migrate", *FAST], cwd=TESTS, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: (pidfile.exists() and "serving" in log.read_text())
                   or proc.poll() is not None, timeout=180, what="a worker on a new server")
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        wait_until(lambda: not pidfile.exists(), timeout=60, what="the embedded server stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
        if pidfile.exists():  # stop it by hand (SIGINT: fast shutdown)
            os.kill(int(pidfile.read_text().split()[0]), signal.SIGINT)
            wait_until(lambda: not pidfile.exists(), timeout=60, what="server stopped by hand")
        shutil.rmtree(data, ignore_errors=True)


def test_worker_warns_when_it_serves_no_queue_of_the_apps_tasks(
        app: App, caplog: pytest.LogCaptureFixture) -> None:
    app.task(name="send", queue="emails")(lambda: None)
    for queues, warned, near_miss in (
            (["default"], True, False), (["default", "emails"], False, False),
            (["bulk"], False, False),  # jobs may reach a queue by configure(queue=)
            (["email"], False, True)):  # but a near miss of a task's queue is a typo
        caplog.clear()
        worker = Worker(app, queues, poll_interval=0.2)
        thread = threading.Thread(target=lambda w=worker: asyncio.run(w.run_async()))
        with caplog.at_level(logging.INFO, logger="skipjack.worker"):
            thread.start()
            try:
                wait_until(lambda: "serving" in caplog.text, what="the worker started")
            finally:
                worker.stop()
                thread.join(30)
        assert ("serving only the queue 'default'" in caplog.text) is warned
        assert ("serving the queue 'email', which no task of this app has as its queue "
                "(did you mean 'emails'?)" in caplog.text) is near_miss


def test_jobs_that_came_without_a_wake_up_are_claimed_at_every_poll(app: App) -> None:
    """Jobs inserted without the enqueue's wake-up (no notification) are found by the poll
    alone, at each poll interval in turn, not only at the first (the claim loop's poll
    timer is set again after each)."""
    ran: list[int] = []

    @app.task(name="rec", queue="q")
    def rec(n: int) -> None:
        ran.append(n)

    worker = Worker(app, ["q"], concurrency=1, poll_interval=0.2)
    with _running(worker):
        for n in (1, 2, 3):  # 2 and 3 come after the worker's first claims, in turn
            query(app.dsn, "INSERT INTO {schema}.jobs (queue, task, args) "
                  "VALUES ('q', 'rec', jsonb_build_object('n', %s::int))", [n],
                  schema=app.schema)
            wait_until(functools.partial(operator.contains, ran, n), timeout=30,
                       what=f"job {n} run after a poll")
    assert ran == [1, 2, 3]


def _stuck_thread_tasks(app: App, release: threading.Event) -> tuple[Task, Task]:
    """Tasks ``hang`` (a sync handler that ignores its 0.3 s timeout: its thread holds a slot
    until ``release`` is set; one attempt) and ``later`` (does nothing), both on queue "q"."""

    @app.task(name="hang", queue="q", timeout=0.3, max_attempts=1)
    def hang() -> None:
        release.wait(60)

    @app.task(name="later", queue="q")
    def later() -> None:
        pass

    return hang, later


def test_fc22_a_worker_stopped_while_only_a_stuck_thread_runs_releases_its_buffer(
        app: App) -> None:
    """Stopping while the only busy slot is a handler thread stuck past its timeout (no
    job's task runs): the worker stops without an error and releases the jobs it had
    claimed ahead, unstarted, rather than leaving them running with an attempt spent."""
    release = threading.Event()
    hang, later = _stuck_thread_tasks(app, release)

    stuck = hang.enqueue()
    worker = Worker(app, ["q"], concurrency=1, prefetch=4, poll_interval=0.2)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(worker.run_async())
        except BaseException as exc:  # what ends the worker's run is the test's outcome
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_until(lambda: (app.get_job(stuck) or {}).get("state") == "discarded",
                   what="the hanging job timed out")
        app.enqueue_many(later.job() for _ in range(3))
        wait_until(lambda: worker.gauges()["buffered"] == 3, what="three jobs claimed ahead")
    finally:
        worker.stop()
        thread.join(30)
        release.set()
    assert failures == []
    assert states(app.dsn, app.schema) == {"discarded": 1, "available": 3}
    assert query(app.dsn, "SELECT max(attempt) FROM {schema}.jobs WHERE task = 'later'",
                 schema=app.schema) == [(0,)]


def test_claim_mode_runners_do_not_pile_up_while_no_slot_is_free(app: App) -> None:
    """A queue with a transaction="claim" task gets one claim-mode runner at a time while no
    slot is free: with a handler thread stuck past its timeout in the only slot, the polls
    (every 0.2 s) start no more runners beside the one that waits for that slot, and the
    jobs that come meanwhile are claimed ahead into the buffer."""
    release = threading.Event()
    hang, later = _stuck_thread_tasks(app, release)

    @app.task(name="in_claim", queue="q", transaction="claim")
    def in_claim() -> None:
        pass

    stuck = hang.enqueue()
    worker = Worker(app, ["q"], concurrency=1, prefetch=3, poll_interval=0.2)
    polls = [0]
    mark_all_due = worker._producer.mark_all_due

    def counted() -> None:
        polls[0] += 1
        mark_all_due()

    worker._producer.mark_all_due = counted  # type: ignore[method-assign]
    thread = threading.Thread(target=lambda: asyncio.run(worker.run_async()))
    thread.start()
    try:
        wait_until(lambda: (app.get_job(stuck) or {}).get("state") == "discarded",
                   what="the hanging job timed out")
        app.enqueue_many(later.job() for _ in range(3))
        # concurrency 1 + prefetch 3 - the stuck thread (a runner's slot counts as free for
        # claims: it gives it back after its job while claimed jobs wait)
        wait_until(lambda: worker.gauges()["buffered"] == 3, what="three jobs claimed ahead")
        seen = polls[0]
        wait_until(lambda: polls[0] >= seen + 5, what="five more polls")
        assert worker._claim_mode.per_queue["q"] == 1
        assert worker._slots.busy() == 2  # the stuck thread and the waiting runner
        release.set()
        wait_until(lambda: states(app.dsn, app.schema) == {"discarded": 1, "succeeded": 3},
                   what="the jobs run once the thread returned")
    finally:
        release.set()
        worker.stop()
        thread.join(30)


def test_a_claim_mode_job_takes_the_next_slot_ahead_of_a_buffered_backlog(app: App) -> None:
    """Every slot busy and a backlog of another queue's jobs buffered: a claim-mode job
    enqueued meanwhile gets a runner that waits for the next slot, and runs there, before
    the backlog (which would otherwise take each slot as it frees, and keep it); the
    concurrency (1) is never exceeded."""
    go = threading.Event()
    order: list[str] = []

    @app.task(name="first", queue="a")
    async def first() -> None:
        order.append("first")
        await asyncio.get_running_loop().run_in_executor(None, go.wait, 60)
        order.append("first ended")

    @app.task(name="quick", queue="a")
    async def quick() -> None:
        order.append("quick")

    @app.task(name="in_claim", queue="b", transaction="claim")
    def in_claim() -> None:
        order.append("in_claim")

    first.enqueue()
    app.enqueue_many(quick.job() for _ in range(10))
    worker = Worker(app, ["a", "b"], concurrency=1, prefetch=100, poll_interval=600)
    thread = threading.Thread(target=lambda: asyncio.run(worker.run_async()))
    thread.start()
    try:
        wait_until(lambda: order == ["first"] and worker.gauges()["buffered"] == 10,
                   what="the first job running, the rest buffered")
        in_claim.enqueue()
        wait_until(lambda: worker._claim_mode.per_queue["b"] == 1,
                   what="a runner for the claim-mode job")
        go.set()
        wait_until(lambda: states(app.dsn, app.schema) == {"succeeded": 12},
                   what="every job done")
    finally:
        go.set()
        worker.stop()
        thread.join(30)
    assert order == ["first", "first ended", "in_claim"] + ["quick"] * 10


@pytest.mark.parametrize("prefetch", [0, 10])
def test_fc20_a_stream_of_claim_mode_jobs_holds_back_no_other_queue(app: App,
                                                                   prefetch: int) -> None:
    """Claim-mode runners holding every slot (concurrency 2) with a backlog of 1,000
    claim-mode jobs of 10 ms: jobs of another queue enqueued meanwhile run before that
    backlog is done (a runner gives its slot back after a job while other work waits: jobs
    claimed ahead, or, with no prefetch, a queue the worker had no room to claim from), and
    the concurrency holds throughout."""
    lock = threading.Lock()
    running_now, peak = [0], [0]

    def enter() -> None:
        with lock:
            running_now[0] += 1
            peak[0] = max(peak[0], running_now[0])

    def leave() -> None:
        with lock:
            running_now[0] -= 1

    @app.task(name="stream", queue="c", transaction="claim")
    def stream() -> None:
        enter()
        time.sleep(0.01)
        leave()

    @app.task(name="other", queue="l")
    async def other() -> None:
        enter()
        await asyncio.sleep(0.01)
        leave()

    app.enqueue_many(stream.job() for _ in range(1000))
    worker = Worker(app, ["c", "l"], concurrency=2, prefetch=prefetch, poll_interval=0.2)
    thread = threading.Thread(target=lambda: asyncio.run(worker.run_async()))
    thread.start()

    def done(task: str) -> int:
        return query(app.dsn, "SELECT count(*) FROM {schema}.jobs WHERE task = %s AND state "
                     "= 'succeeded'", (task,), schema=app.schema)[0][0]

    try:
        wait_until(lambda: done("stream") >= 20, what="the claim-mode stream running")
        app.enqueue_many(other.job() for _ in range(5))
        wait_until(lambda: done("other") == 5, timeout=120, what="the other queue's jobs run")
        left = 1000 - done("stream")
    finally:
        worker.stop()
        thread.join(30)
    assert left > 0  # they did not wait for the stream to end
    assert peak == [2]


@pytest.mark.parametrize("prefetch", [0, None])
def test_claim_mode_jobs_and_others_share_the_slots(app: App, prefetch: int | None) -> None:
    """Backlogs of claim-mode jobs and of other jobs (10 ms each), concurrency 4, no
    prefetch or the adaptive one: once 100 of the other jobs have run, the claim-mode
    runners hold two slots and the other jobs two, and both backlogs are still there."""

    @app.task(name="stream", queue="c", transaction="claim")
    def stream() -> None:
        time.sleep(0.01)

    @app.task(name="other", queue="l")
    async def other() -> None:
        await asyncio.sleep(0.01)

    app.enqueue_many(stream.job() for _ in range(2000))
    app.enqueue_many(other.job() for _ in range(2000))
    worker = Worker(app, ["c", "l"], concurrency=4, prefetch=prefetch, poll_interval=0.2)
    slots = worker._slots
    with _running(worker):
        wait_until(lambda: worker.stats.succeeded >= 100 and query(
            app.dsn, "SELECT count(*) FROM {schema}.jobs WHERE task = 'other' AND state = "
            "'succeeded'", schema=app.schema)[0][0] >= 100, timeout=60,
            what="100 of the other jobs run")
        wait_until(lambda: (slots.claim_mode, len(slots.running)) == (2, 2),
                   what="two slots each")
        left = states(app.dsn, app.schema).get("available", 0)
    assert left > 1000  # neither backlog had been run through first


@pytest.mark.parametrize("busy", ["idle", "in a statement"])
def test_a_claim_mode_handler_past_its_lease_uses_its_attempt(app: App, busy: str) -> None:
    """A claim-mode handler still running at its job's lease (1 s), idle in the claim's
    transaction or in a statement of it: the worker ends the claim's session and counts the
    attempt as timed out, so the job runs once an attempt and is discarded after its last.
    (Before, the server's idle timeout undid an idle handler's claim with no attempt counted,
    and the job was claimed again at once while the first handler still ran, for ever; a
    handler in a long statement was not bounded at all.)"""
    from skipjack import Backoff

    starts: list[float] = []

    @app.task(name="overdue", queue="q", transaction="claim", lease=1, max_attempts=2,
              backoff=Backoff(base=0.05, cap=0.1, jitter=False))
    def overdue() -> None:
        starts.append(time.monotonic())
        if busy == "idle":
            time.sleep(3)
        else:
            current_job().conn.execute("SELECT pg_sleep(60)")

    job = overdue.enqueue()
    worker = Worker(app, ["q"], concurrency=2, heartbeat=0.3, poll_interval=0.2,
                    stage_interval=0.2)
    with _running(worker):
        final = wait_until(lambda: (j := app.get_job(job)) and j["state"] == "discarded" and j,
                           timeout=45, what="the job discarded after its two attempts")
    assert final["attempt"] == 2
    assert len(starts) == 2
    assert all("past its lease of 1s" in e["error"] for e in final["errors"]), final["errors"]
    assert worker.stats.discarded == 1 and worker.stats.retried == 1


def test_a_claim_mode_job_s_own_longer_lease_holds_off_the_server_s_idle_timeout(
        app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim-mode job enqueued with a lease of 5 s, longer than its task's 1 s (which sets
    the session's idle timeout to 2 s before the claim, with a margin of 1 s): its handler,
    idle for 3 s in the claim's transaction, runs once and succeeds; the server does not end
    the claim at 2 s (which undid it with no attempt counted, and the job ran again and
    again)."""
    monkeypatch.setattr(claim_mode, "SERVER_TIMEOUT_MARGIN", 1.0)
    starts: list[float] = []

    @app.task(name="longer", queue="q", transaction="claim", lease=1)
    def longer() -> None:
        starts.append(time.monotonic())
        time.sleep(3)

    job = longer.configure(lease=5).enqueue()
    worker = Worker(app, ["q"], concurrency=2, heartbeat=0.3, poll_interval=0.2)
    with _running(worker):
        final = wait_until(lambda: (j := app.get_job(job)) and j["state"] != "available" and j,
                           what="the job ended")
    assert (final["state"], final["attempt"], len(starts)) == ("succeeded", 1, 1)


def test_a_claim_mode_handler_outlives_a_shorter_transaction_timeout_of_the_server(
        app: App) -> None:
    """PostgreSQL 17 and later: connections whose transaction_timeout (500 ms) is shorter
    than a claim-mode handler's run (1 s, within its 5 s lease): the claim's transaction gets
    the lease plus the margin instead, and the job runs once and succeeds. (Before, the
    server ended the claim every time, with no attempt counted, and the job ran again and
    again.)"""
    if int(query(app.dsn, "SHOW server_version_num")[0][0]) < 170000:
        pytest.skip("transaction_timeout is new in PostgreSQL 17")
    timed = App(psycopg.conninfo.make_conninfo(app.dsn, options="-c transaction_timeout=500"),
                schema=app.schema)
    starts: list[float] = []

    @timed.task(name="slow", queue="q", transaction="claim", lease=5)
    def slow() -> None:
        starts.append(time.monotonic())
        time.sleep(1)

    job = slow.enqueue()
    worker = Worker(timed, ["q"], concurrency=1, heartbeat=0.3, poll_interval=0.2)
    with _running(worker):
        final = wait_until(lambda: (j := app.get_job(job)) and j["state"] != "available" and j,
                           what="the job ended")
    assert (final["state"], final["attempt"], len(starts)) == ("succeeded", 1, 1)


def test_a_limited_queue_has_one_retry_pending_at_a_time(
        app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    """A limited queue whose claim came back short is claimed again LIMITED_RETRY seconds
    later, by one retry at a time: the short claims after each of 20 finished jobs do not
    each start a retry of their own (20 retries, each claiming again every LIMITED_RETRY
    seconds for as long as the limit holds)."""
    monkeypatch.setattr(producer, "LIMITED_RETRY", 0.1)
    holding, go = threading.Event(), threading.Event()

    @app.task(name="quick", queue="q")
    async def quick() -> None:
        pass

    @app.task(name="hold", queue="q")
    async def hold() -> None:
        holding.set()
        await asyncio.get_running_loop().run_in_executor(None, go.wait, 60)

    app.set_queue_limits("q", concurrency=1)
    app.enqueue_many(quick.job() for _ in range(20))
    hold.enqueue()  # claimed after those (same priority, higher id)
    app.enqueue_many(quick.job() for _ in range(5))  # held back by the limit meanwhile
    worker = Worker(app, ["q"], concurrency=4, poll_interval=600)
    retries: list[float] = []  # when a retry made the queue due while the hold job ran
    retry = worker._producer._retry

    def timed(queue: str) -> None:
        if holding.is_set():
            retries.append(time.monotonic())
        retry(queue)

    worker._producer._retry = timed  # type: ignore[method-assign]
    thread = threading.Thread(target=lambda: asyncio.run(worker.run_async()))
    thread.start()
    try:
        wait_until(lambda: len(retries) >= 8, what="eight retries while the limit holds")
        go.set()
        wait_until(lambda: states(app.dsn, app.schema) == {"succeeded": 26},
                   what="every job done")
    finally:
        go.set()
        worker.stop()
        thread.join(30)
    gaps = [b - a for a, b in itertools.pairwise(retries)]
    assert min(gaps) >= 0.09, gaps  # one retry at a time: each LIMITED_RETRY after the last


def test_a_limited_queue_s_retries_start_no_claim_mode_runner(
        app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    """Limits do not apply to claim-mode jobs, so the retries of a limited queue at its limit
    (every LIMITED_RETRY seconds, here 0.05) claim its lease-mode jobs only: they start no
    claim-mode runner, each of which would open a transaction to claim."""
    monkeypatch.setattr(producer, "LIMITED_RETRY", 0.05)
    go = threading.Event()

    @app.task(name="in_claim", queue="q", transaction="claim")
    def in_claim() -> None:
        pass

    @app.task(name="hold", queue="q")
    async def hold() -> None:
        await asyncio.get_running_loop().run_in_executor(None, go.wait, 60)

    app.set_queue_limits("q", concurrency=1)
    app.enqueue_many(hold.job() for _ in range(2))  # one runs, the other is held back
    worker = Worker(app, ["q"], concurrency=2, poll_interval=600)
    retries, spawns = [0], [0]
    retry, spawn = worker._producer._retry, worker._claim_mode.spawn

    def counted_retry(queue: str) -> None:
        retries[0] += 1
        retry(queue)

    def counted_spawn(queue: str) -> None:
        spawns[0] += 1
        spawn(queue)

    worker._producer._retry = counted_retry  # type: ignore[method-assign]
    worker._claim_mode.spawn = counted_spawn  # type: ignore[method-assign]
    try:
        with _running(worker):
            wait_until(lambda: retries[0] >= 3, what="three retries of the limited queue")
            seen = spawns[0]  # the start's (every queue due at first, and once listening)
            wait_until(lambda: retries[0] >= 13, what="ten more retries")
            go.set()
    finally:
        go.set()
    assert spawns[0] == seen


def test_an_emptied_limited_queue_is_not_claimed_again_until_woken(
        app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    """A limited queue whose claim took every job it had is not claimed again
    LIMITED_RETRY seconds later (here 600, so that a retry would still be pending): only a
    queue whose limits held jobs back is. Before, an empty limited queue was claimed every
    0.05-0.5 s by every worker, each claim a row lock on the queue written to the WAL."""
    monkeypatch.setattr(producer, "LIMITED_RETRY", 600)

    @app.task(name="quick", queue="q")
    async def quick() -> None:
        pass

    app.set_queue_limits("q", concurrency=2)
    jobs = app.enqueue_many(quick.job() for _ in range(2))
    worker = Worker(app, ["q"], concurrency=4, poll_interval=600)
    with _running(worker):
        wait_until(lambda: worker.stats.succeeded == 2, what="both jobs run")
        assert worker._producer._retrying == set()
        app.enqueue_many(quick.job() for _ in range(2))  # the notification wakes the queue
        wait_until(lambda: worker.stats.succeeded == 4, what="the next two run")
    assert all((app.get_job(j) or {})["state"] == "succeeded" for j in jobs)


def test_fairness_reaches_low_priorities_on_a_limited_queue(app: App) -> None:
    """Concurrency limit 1 and no prefetch: one job per claim, and the claims that find the
    limit reached (the finished job's outcome not yet written) do not take a turn."""
    order: list[int] = []

    @app.task(name="rec", queue="q")
    def rec(n: int) -> None:
        order.append(n)

    app.set_queue_limits("q", concurrency=1)
    rec.configure(priority=-100).enqueue(n=0)  # the oldest job, the lowest priority
    for n in (1, 2, 3, 4):
        rec.configure(priority=100).enqueue(n=n)
    worker = Worker(app, ["q"], concurrency=1, prefetch=0, fairness_every=2, poll_interval=0.2)
    with _running(worker):
        wait_until(lambda: len(order) == 5, what="five jobs run")
    assert order == [1, 0, 2, 3, 4]  # claim 2 took the oldest; strict priority: 0 last


def test_a_limited_queue_is_claimed_again_once_an_outcome_is_written(
        app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrency limit 1 and a worker of concurrency 4: a freed slot's claim comes before
    the finished job's outcome is written, so it finds the limit reached; the outcome's
    write makes the queue due again. With the retry after a short claim and the poll both
    10 minutes away, the jobs run one after another all the same."""
    monkeypatch.setattr(producer, "LIMITED_RETRY", 600.0)
    running, peak = [0], [0]  # handlers running now, and the most at once

    @app.task(name="one", queue="q")
    async def one() -> None:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        try:
            await asyncio.sleep(0.05)
        finally:
            running[0] -= 1

    app.set_queue_limits("q", concurrency=1)
    app.enqueue_many(one.job() for _ in range(6))
    worker = Worker(app, ["q"], concurrency=4, poll_interval=600)
    _run_worker_until(worker, lambda: states(app.dsn, app.schema) == {"succeeded": 6})
    assert peak == [1]  # one at a time, as the limit says


def test_a_rate_limited_queue_with_a_short_period_is_claimed_again_each_period(
        app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue limited to 5 jobs per 0.2 s: a claim that the full window cut short is tried
    again after the period (not after LIMITED_RETRY, here 10 minutes, as is the poll), so
    20 jobs run in four windows of at most 5."""
    monkeypatch.setattr(producer, "LIMITED_RETRY", 600.0)

    @app.task(name="quick", queue="q")
    async def quick() -> None:
        pass

    app.set_queue_limits("q", rate=5, period=0.2)
    app.enqueue_many(quick.job() for _ in range(20))
    worker = Worker(app, ["q"], concurrency=10, poll_interval=600)
    _run_worker_until(worker, lambda: states(app.dsn, app.schema) == {"succeeded": 20})
    assert max(_claim_sizes(app)) <= 5


def _claim_sizes(app: App) -> list[int]:
    """Jobs per claim statement: the rows a claim takes share its transaction's
    ``attempted_at``."""
    rows = query(app.dsn, "SELECT count(*) FROM {schema}.jobs GROUP BY attempted_at "
                 "ORDER BY min(id)", schema=app.schema)
    return [n for (n,) in rows]


def _run_worker_until(worker: Worker, done: Any) -> None:
    with _running(worker):
        wait_until(done, timeout=120, what="the jobs done")


@contextlib.contextmanager
def _running(worker: Worker) -> Iterator[None]:
    """Run ``worker`` in a thread of its own for the block; then stop it and wait for it."""
    thread = threading.Thread(target=lambda: asyncio.run(worker.run_async()))
    thread.start()
    try:
        yield
    finally:
        worker.stop()
        thread.join(30)


def test_the_default_prefetch_claims_short_jobs_in_batches_and_long_ones_per_slot(
        app: App) -> None:
    """The adaptive prefetch (the default): 3,000 no-op jobs at concurrency 10 are claimed a
    few hundred or more at a time (a fixed buffer of 10 took 20 per claim), while 0.2 s jobs
    at concurrency 2 are claimed only for free slots, so no worker holds long jobs that
    another could start."""
    @app.task(name="quick", queue="q")
    async def quick() -> None:
        pass

    @app.task(name="slow", queue="q")
    async def slow() -> None:
        await asyncio.sleep(0.2)

    app.enqueue_many(quick.job() for _ in range(3000))
    worker = Worker(app, ["q"], concurrency=10, poll_interval=0.2)
    _run_worker_until(worker, lambda: states(app.dsn, app.schema) == {"succeeded": 3000})
    sizes = _claim_sizes(app)
    assert sizes[0] == 10  # nothing known yet: the free slots only
    assert len(sizes) <= 30 and max(sizes) >= 500, sizes
    assert worker.gauges()["prefetch"] >= 500

    query(app.dsn, "DELETE FROM {schema}.jobs", schema=app.schema)
    app.enqueue_many(slow.job() for _ in range(6))
    worker = Worker(app, ["q"], concurrency=2, poll_interval=0.2)
    _run_worker_until(worker, lambda: states(app.dsn, app.schema) == {"succeeded": 6})
    assert max(_claim_sizes(app)) <= 2 and worker.gauges()["prefetch"] == 0


def test_a_buffer_of_handlers_that_never_wait_runs_one_after_another(app: App) -> None:
    """Handlers that never wait end as their task starts (an eager task, Python 3.12+), each
    starting the next buffered job as its slot frees: 3,000 such jobs on one slot, claimed
    1,000 at a time, run in a loop, not in a recursion as deep as the buffer; the ones that
    raise at once are recorded as failed like any other."""
    @app.task(name="at_once", queue="q", max_attempts=1)
    async def at_once(i: int) -> None:
        if i % 2:
            raise ValueError("odd")

    app.enqueue_many(at_once.job(i=i) for i in range(3000))
    worker = Worker(app, ["q"], concurrency=1, prefetch=2000, poll_interval=0.2)
    _run_worker_until(worker, lambda: states(app.dsn, app.schema)
                      == {"succeeded": 1500, "discarded": 1500})
    assert max(_claim_sizes(app)) == 1000
