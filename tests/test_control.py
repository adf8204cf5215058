"""Scheduling and job control on a real server: delays, priorities, fairness, unique keys,
cancellation, timeouts, snooze, paused and limited queues, retention."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from skipjack import App, DuplicateJobError
from skipjack.admin import RetryResult
from skipjack.runtime.maintenance import Maintenance, rescue, schedule_due, stage
from skipjack.runtime.skips import SkipList
from test_claim_fencing import claim, claim_params, expire

from support import (
    TESTS,
    WorkerProcess,
    create_log_tables,
    exec_counts,
    query,
    states,
    wait_until,
)

FAST = ["--lease", "2", "--heartbeat", "0.3", "--rescue-interval", "0.5", "--poll-interval",
        "0.5"]
TASKS = ("sleep", "async_sleep", "slow_async", "slow_sync", "sync_wait", "snooze_once", "fail",
         "hang")


@pytest.fixture
def tasks(app: App) -> App:
    create_log_tables(app.dsn, app.schema)
    for name in (*TASKS, "t"):
        app.task(name=name)(lambda **kw: None)
    return app


def enqueue(app: App, task: str, n: int = 1, queue: str = "default", **args: Any) -> list[int]:
    t = app.tasks[task].configure(queue=queue)
    with app.connect() as conn:
        return app.enqueue_many([t.job(**args) for _ in range(n)], conn=conn)


# --- delayed jobs ---------------------------------------------------------------------------

def test_future_jobs_wait_in_scheduled_and_are_staged_when_due(tasks: App) -> None:
    t = tasks.tasks["t"].configure(queue="q")
    later = t.configure(delay=3600).enqueue()
    soon = t.configure(delay=0.2).enqueue()
    assert states(tasks.dsn, tasks.schema) == {"scheduled": 2}
    with tasks.connect() as conn:
        wait_until(lambda: stage(conn, tasks.queries, tasks.schema) == {"q": 1}, timeout=10,
                   what="the due job staged")
    assert (tasks.get_job(soon) or {})["state"] == "available"
    assert (tasks.get_job(later) or {})["state"] == "scheduled"


def test_100k_future_jobs_stay_out_of_the_claims_path(tasks: App) -> None:
    """100,000 high-priority future jobs and one due low-priority job: the claim plan reads
    the partial index only (no sequential scan) and touches one row, not 100,000."""
    t = tasks.tasks["t"].configure(queue="q")
    tasks.enqueue_many([t.configure(delay=3600, priority=100).job() for _ in range(100_000)])
    due = t.configure(priority=-100).enqueue()
    query(tasks.dsn, "ANALYZE {schema}.jobs", schema=tasks.schema)
    with tasks.connect() as conn, conn.transaction():
        plan = [r[0] for r in conn.execute(
            b"EXPLAIN (ANALYZE, COSTS OFF) " + tasks.queries.CLAIM,
            claim_params(inline_bytes=1)).fetchall()]
        conn.execute("ROLLBACK")  # EXPLAIN ANALYZE ran the claim: undo it
    text = "\n".join(plan)
    assert "Seq Scan on jobs" not in text, text
    assert "jobs_claim_idx" in text, text
    scan = next(line for line in plan if "jobs_claim_idx" in line)
    assert re.search(r"rows=1(\.00)? ", scan), text
    assert (tasks.get_job(due) or {})["state"] == "available"


# --- priorities -----------------------------------------------------------------------------

def test_rescued_priority_job_is_claimed_before_lower_priorities(tasks: App) -> None:
    t = tasks.tasks["t"].configure(queue="q")
    urgent = t.configure(priority=50).enqueue()
    claim(tasks, limit=1)  # a worker took it, then died
    normal = [t.enqueue() for _ in range(5)]
    expire(tasks, urgent)
    with tasks.connect() as conn:
        assert rescue(conn, tasks.queries) == [(urgent, "available")]
    assert [r[0] for r in claim(tasks, limit=6)] == [urgent, *normal]


def test_oldest_first_claim_reaches_low_priorities(tasks: App) -> None:
    t = tasks.tasks["t"].configure(queue="q")
    old_low = t.configure(priority=-100).enqueue()
    [t.configure(priority=100).enqueue() for _ in range(3)]
    with tasks.connect() as conn:
        rows = conn.execute(tasks.queries.CLAIM_OLDEST, claim_params(limit=1)).fetchall()
    assert [r[0] for r in rows] == [old_low]


def test_oldest_first_claim_takes_the_priority_that_waited_longest_and_skips_locked_rows(
        tasks: App) -> None:
    # the oldest-first claim walks the claim index one priority at a time: it takes, in age
    # order, the jobs of the priority whose oldest job is the queue's oldest, leaving out rows
    # another claim holds and the skip list, and locks nothing it does not take
    t = tasks.tasks["t"].configure(queue="q")
    rng = random.Random(7)
    for _ in range(90):
        t.configure(priority=rng.choice([-5, 0, 0, 7, 30])).enqueue()
    with tasks.connect() as conn:
        conn.execute(f'UPDATE "{tasks.schema}".jobs SET run_at = now() - '
                     "make_interval(secs => (random() * 6)::int * 10)")  # ties too: by id
        by_age = conn.execute(f'SELECT id, priority FROM "{tasks.schema}".jobs '
                              "ORDER BY run_at, id").fetchall()
    skipped = by_age[0][0]  # the oldest: its priority is chosen by the next oldest
    level = by_age[1][1]
    in_level = [i for i, p in by_age if p == level and i != skipped]
    held = in_level[1:3]
    with tasks.connect() as other, other.transaction():
        other.execute(f'SELECT id FROM "{tasks.schema}".jobs WHERE id = ANY(%s) FOR UPDATE',
                      [held])
        with tasks.connect() as conn, conn.transaction():
            rows = conn.execute(tasks.queries.CLAIM_OLDEST,
                                {**claim_params(limit=8), "skip": [skipped]}).fetchall()
            with tasks.connect() as third:  # every other available job is still free
                free = third.execute(
                    f'SELECT count(*) FROM (SELECT id FROM "{tasks.schema}".jobs '
                    "WHERE state = 'available' FOR UPDATE SKIP LOCKED) AS f").fetchone()
    assert sorted(r[0] for r in rows) == sorted([i for i in in_level if i not in held][:8])
    assert free == (90 - len(rows) - len(held),)


# --- unique jobs ----------------------------------------------------------------------------

@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_fc11_one_key_five_transactions_four_roll_back(tasks: App, isolation: str) -> None:
    t = tasks.tasks["t"].configure(queue="q")
    level = psycopg.IsolationLevel.REPEATABLE_READ if isolation == "repeatable read" \
        else psycopg.IsolationLevel.READ_COMMITTED
    rng = random.Random(11)
    for round_ in range(15):
        key = f"k{round_}"
        results: dict[int, Any] = {}
        barrier = threading.Barrier(5)

        def caller(i: int, key: str = key, barrier: threading.Barrier = barrier,
                   results: dict[int, Any] = results) -> None:
            with psycopg.connect(tasks.dsn) as conn:
                conn.isolation_level = level
                conn.execute("SELECT 1")  # take the snapshot first, as a real caller would
                barrier.wait()
                if i == 4:
                    time.sleep(rng.uniform(0.0, 0.1))
                try:
                    job_id = tasks.enqueue(t.configure(idempotency_key=key).job(), conn=conn)
                except (DuplicateJobError, psycopg.errors.SerializationFailure) as exc:
                    results[i] = exc
                    conn.rollback()
                    return
                results[i] = job_id
                if i == 4:
                    conn.commit()
                else:
                    time.sleep(rng.uniform(0.05, 0.2))
                    conn.rollback()

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(5)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        rows = query(tasks.dsn, "SELECT id FROM {schema}.jobs WHERE idempotency_key = %s",
                     [key], schema=tasks.schema)
        assert len(rows) == 1, (round_, results)
        assert all(isinstance(v, int | DuplicateJobError | psycopg.errors.SerializationFailure)
                   for v in results.values())
        assert all(v is not None for v in results.values())
        if isinstance(results[4], int):
            assert results[4] == rows[0][0]


def test_unique_while_waiting_allows_a_new_job_after_the_first_finished(tasks: App) -> None:
    t = tasks.tasks["t"].configure(queue="q", idempotency_key="sync-user-7",
                                   unique_while=("scheduled", "available", "running"))
    first = t.enqueue()
    assert t.enqueue() == first
    claim(tasks, limit=1)
    running = tasks.get_job(first)
    assert t.enqueue() == first  # re-enqueueing never touches the running job
    assert tasks.get_job(first) == running
    query(tasks.dsn, "UPDATE {schema}.jobs SET state = 'succeeded' WHERE id = %s", [first],
          schema=tasks.schema)
    second = t.enqueue()
    assert second != first


# --- cancellation, timeouts, snooze ---------------------------------------------------------

@pytest.mark.parametrize("task", ["async_sleep", "sync_wait"])
def test_cancel_waiting_and_running_jobs(tasks: App, tmp_path: Path, task: str) -> None:
    waiting = enqueue(tasks, "sleep", 3, queue="other")
    (running,) = enqueue(tasks, task, seconds=30)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log"):
        wait_until(lambda: exec_counts(tasks.dsn, tasks.schema) == {running: 1}, timeout=30,
                   what="running")
        assert tasks.cancel(waiting) == {"cancelled": 3, "requested": 0}
        assert tasks.cancel([running]) == {"cancelled": 0, "requested": 1}
        wait_until(lambda: (tasks.get_job(running) or {})["state"] == "cancelled", timeout=30,
                   what="running job cancelled")
    assert states(tasks.dsn, tasks.schema) == {"cancelled": 4}


def test_timeouts_fail_the_attempt(tasks: App, tmp_path: Path) -> None:
    async_job = tasks.enqueue(tasks.tasks["slow_async"].configure(max_attempts=2)
                              .job(seconds=30))
    sync_job = tasks.enqueue(tasks.tasks["slow_sync"].configure(max_attempts=1).job(seconds=30))
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"discarded": 2}, timeout=30,
                   what="both timed out")
    for job_id, attempts in ((async_job, 2), (sync_job, 1)):
        job = tasks.get_job(job_id) or {}
        assert job["attempt"] == attempts
        assert "timed out after 0.5s" in job["errors"][-1]["error"]


def test_snooze_runs_again_later_without_using_an_attempt(tasks: App, tmp_path: Path) -> None:
    (job_id,) = enqueue(tasks, "snooze_once")
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=30,
                   what="snoozed job done")
    job = tasks.get_job(job_id) or {}
    assert job["attempt"] == 1 and exec_counts(tasks.dsn, tasks.schema) == {job_id: 2}


# --- queue controls -------------------------------------------------------------------------

def test_pause_and_resume_across_workers(tasks: App, tmp_path: Path) -> None:
    tasks.pause_queue("default")
    ids = enqueue(tasks, "sleep", 5)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default", "other"], *FAST,
                       log=tmp_path / "w.log"):
        other = enqueue(tasks, "sleep", 1, queue="other")
        wait_until(lambda: exec_counts(tasks.dsn, tasks.schema, "finish").keys() == set(other),
                   timeout=30, what="the unpaused queue served")
        assert states(tasks.dsn, tasks.schema).get("available") == 5
        tasks.resume_queue("default")
        wait_until(lambda: set(ids) <= exec_counts(tasks.dsn, tasks.schema, "finish").keys(),
                   timeout=30, what="resumed queue drained")


def test_global_concurrency_limit_holds_with_a_sigkill(tasks: App, tmp_path: Path) -> None:
    """Limit 2 across 3 worker processes (concurrency 4 each); one is SIGKILLed mid-run."""
    tasks.set_queue_limits("default", concurrency=2)
    enqueue(tasks, "sleep", 30, seconds=0.2)
    peak = 0
    workers = [WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "4", *FAST,
                             log=tmp_path / f"w{i}.log") for i in range(3)]
    try:
        deadline = time.monotonic() + 120
        killed = False
        while states(tasks.dsn, tasks.schema).get("succeeded", 0) < 30:
            assert time.monotonic() < deadline, "limited queue did not drain"
            live = query(tasks.dsn, "SELECT count(*) FROM {schema}.jobs WHERE state = "
                         "'running' AND lease_expires_at > now()", schema=tasks.schema)[0][0]
            peak = max(peak, live)
            if not killed and len(exec_counts(tasks.dsn, tasks.schema, "finish")) >= 8:
                workers[0].kill()
                killed = True
            time.sleep(0.01)
    finally:
        for w in workers:
            w.kill()
    assert 1 <= peak <= 2
    spans = query(tasks.dsn, """
        SELECT s.at, f.at FROM {schema}.exec_log s JOIN {schema}.exec_log f
          ON f.job_id = s.job_id AND f.attempt = s.attempt AND f.event = 'finish'
         WHERE s.event = 'start'""", schema=tasks.schema)
    for start, _ in spans:  # handlers overlapping any moment: never more than the limit
        assert sum(1 for s, f in spans if s <= start < f) <= 2


def test_rate_limit_spreads_starts(tasks: App, tmp_path: Path) -> None:
    tasks.set_queue_limits("default", rate=5, period=1.0)
    enqueue(tasks, "sleep", 12)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "10", *FAST,
                       log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 12}, timeout=60,
                   what="rate-limited queue drained")
    starts = sorted(r[0] for r in query(tasks.dsn, "SELECT attempted_at FROM {schema}.jobs",
                                        schema=tasks.schema))
    assert (starts[-1] - starts[0]).total_seconds() >= 2.0  # 12 starts need three windows


def test_fc20_small_queue_is_not_starved_by_a_big_one(tasks: App, tmp_path: Path) -> None:
    big = enqueue(tasks, "sleep", 200, queue="big", seconds=0.2)
    small = enqueue(tasks, "sleep", 5, queue="small", seconds=0.2)
    with WorkerProcess(tasks.dsn, tasks.schema, ["big", "small"], "--concurrency", "4", *FAST,
                       log=tmp_path / "w.log"):
        wait_until(lambda: set(small) <= exec_counts(tasks.dsn, tasks.schema, "finish").keys(),
                   timeout=60, what="small queue done")
        done_big = set(big) & exec_counts(tasks.dsn, tasks.schema, "finish").keys()
    assert len(done_big) < 20


# --- retention ------------------------------------------------------------------------------

def test_fc26_pruners_workers_and_bulk_cancel_together(tasks: App, tmp_path: Path) -> None:
    """3 pruners, 4 workers and a bulk cancel at once: no deadlock, no lost or doubled row."""
    query(tasks.dsn, """
        INSERT INTO {schema}.jobs (queue, task, state, finished_at, attempt)
        SELECT 'old', 't', 'succeeded', now() - interval '2 days', 1
          FROM generate_series(1, 20000)""", schema=tasks.schema)
    q_jobs = enqueue(tasks, "sleep", 1500, queue="q", seconds=0.001)
    errors: list[BaseException] = []
    pruned: list[int] = []

    def pruner() -> None:
        try:
            pruned.append(tasks.prune(retention=86400, batch=500))
        except BaseException as exc:
            errors.append(exc)

    workers = [WorkerProcess(tasks.dsn, tasks.schema, ["q"], "--concurrency", "8", *FAST,
                             log=tmp_path / f"w{i}.log") for i in range(4)]
    try:
        threads = [threading.Thread(target=pruner) for _ in range(3)]
        for th in threads:
            th.start()
        wait_until(lambda: len(exec_counts(tasks.dsn, tasks.schema)) >= 100, timeout=60,
                   what="workers under way")
        cancelled = tasks.cancel(queue="q")
        for th in threads:
            th.join(120)
        wait_until(lambda: not {"available", "running", "scheduled"}
                   & states(tasks.dsn, tasks.schema).keys(), timeout=60, what="queue settled")
    finally:
        for w in workers:
            w.kill()
    assert errors == []
    assert sum(pruned) == 20000
    final = dict(query(tasks.dsn, "SELECT state, count(*) FROM {schema}.jobs WHERE queue = 'q' "
                       "GROUP BY state", schema=tasks.schema))
    assert sum(final.values()) == len(q_jobs)
    assert set(final) <= {"succeeded", "cancelled"}
    assert final.get("cancelled", 0) >= cancelled["cancelled"]
    for log_file in tmp_path.glob("w*.log"):
        assert "deadlock" not in log_file.read_text()


def test_worker_prunes_with_retention(tasks: App, tmp_path: Path) -> None:
    query(tasks.dsn, """
        INSERT INTO {schema}.jobs (queue, task, state, finished_at, attempt)
        SELECT 'old', 't', s, now() - interval '2 hours', 1
          FROM unnest(ARRAY['succeeded', 'cancelled', 'discarded']) AS s""", schema=tasks.schema)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, "--retention", "1h",
                       log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"discarded": 1}, timeout=60,
                   what="succeeded and cancelled pruned, discarded kept longer")


def test_a_worker_prunes_by_default_after_7_days_and_70_for_the_dead_letter(
        tasks: App, tmp_path: Path) -> None:
    """No --retention: succeeded and cancelled jobs older than 7 days go, the dead letter
    after 70; younger ones stay."""
    query(tasks.dsn, """
        INSERT INTO {schema}.jobs (queue, task, state, finished_at, attempt)
        SELECT 'old', 't', s, now() - make_interval(days => d), 1
          FROM unnest(ARRAY['succeeded', 'cancelled', 'succeeded', 'discarded', 'discarded'],
                      ARRAY[8, 8, 6, 69, 71]) AS x(s, d)""", schema=tasks.schema)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1, "discarded": 1},
                   timeout=60, what="the jobs past the default retention pruned")
    assert query(tasks.dsn, "SELECT state, extract(day FROM now() - finished_at)::int "
                            "FROM {schema}.jobs ORDER BY 1", schema=tasks.schema) == [
        ("discarded", 69), ("succeeded", 6)]


def test_the_pruner_keeps_up_with_a_busy_queue(tasks: App, tmp_path: Path) -> None:
    """20,000 jobs past their retention (a busy hour's worth) are pruned in one go, batch
    after batch, not one batch of 1,000 per 10 s interval: that kept at most 100 jobs/s, so
    a queue busier than that grew without end."""
    query(tasks.dsn, """
        INSERT INTO {schema}.jobs (queue, task, state, finished_at, attempt)
        SELECT 'old', 't', 'succeeded', now() - interval '2 hours', 1
          FROM generate_series(1, 20000)""", schema=tasks.schema)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, "--retention", "1h",
                       log=tmp_path / "w.log"):
        # one batch per interval would have taken 200 s
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {}, timeout=60,
                   what="every job past its retention pruned")


def test_a_prune_the_database_refuses_holds_up_no_other_duty(
        app: App, caplog: pytest.LogCaptureFixture) -> None:
    """An application row references an old finished job with ON DELETE RESTRICT, so every
    prune fails. That is the statement's failure, not the connection's: the maintenance
    thread keeps its connection and the stager goes on, instead of reconnecting and waiting
    out backoffs that hold up the stager and the rescuer."""
    query(app.dsn, "INSERT INTO {schema}.jobs (queue, task, state, finished_at, attempt) "
                   "VALUES ('old', 't', 'succeeded', now() - interval '2 days', 1)",
          schema=app.schema)
    query(app.dsn, "CREATE TABLE {schema}.refs (job_id bigint REFERENCES {schema}.jobs (id) "
                   "ON DELETE RESTRICT)", schema=app.schema)
    query(app.dsn, "INSERT INTO {schema}.refs SELECT id FROM {schema}.jobs", schema=app.schema)
    t = app.task(name="t", queue="q")(lambda: None)
    staged: list[str] = []
    m = Maintenance(app.db, stage_interval=0.1, rescue_interval=0.1, retention=3600.0,
                    discarded_retention=None, on_staged=staged.append)
    m.start()
    try:
        wait_until(lambda: caplog.text.count("pruner:") >= 1, timeout=60, what="a prune")
        conn = m._conn
        t.configure(delay=0.2).enqueue()
        wait_until(lambda: "q" in staged, timeout=30, what="the delayed job staged")
        wait_until(lambda: caplog.text.count("pruner:") >= 2, timeout=60, what="a 2nd prune")
        assert m._conn is conn and conn is not None and not conn.closed
    finally:
        m.stop()
        m.join(30)
    assert "foreign key constraint" in caplog.text
    assert states(app.dsn, app.schema) == {"succeeded": 1, "available": 1}


# --- regressions ----------------------------------------------------------------------------

def test_a_thread_stuck_past_its_timeout_keeps_its_slot(tasks: App, tmp_path: Path) -> None:
    """Concurrency 1: the timed-out handler's thread still runs, so the next job waits for it
    instead of being claimed, timing out unstarted and dead-lettered."""
    stuck = tasks.enqueue(tasks.tasks["hang"].configure(max_attempts=1).job(seconds=3))
    (quick,) = enqueue(tasks, "sleep", 1)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "1",
                       "--prefetch", "0", *FAST, log=tmp_path / "w.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"discarded": 1, "succeeded": 1},
                   timeout=30, what="both ended")
    assert (tasks.get_job(stuck) or {})["state"] == "discarded"
    job = tasks.get_job(quick) or {}
    assert job["state"] == "succeeded" and job["attempt"] == 1


def test_cancel_request_survives_a_rescue(tasks: App) -> None:
    job_id = tasks.tasks["t"].configure(queue="q").enqueue()
    claim(tasks, limit=1)
    assert tasks.cancel([job_id], timeout=1) == {"cancelled": 0, "requested": 1}
    expire(tasks, job_id)
    with tasks.connect() as conn:
        assert rescue(conn, tasks.queries) == [(job_id, "cancelled")]


def test_retry_of_a_discarded_job_whose_key_was_reused_is_skipped(tasks: App) -> None:
    t = tasks.tasks["t"].configure(queue="q", idempotency_key="k",
                                   unique_while=("scheduled", "available", "running"))
    first = t.enqueue()
    assert tasks.discard([first]) == [first]
    second = t.enqueue()
    assert second != first
    assert tasks.retry_discarded([first]) == []


def test_fc25_finished_history_stays_off_the_claims_path(tasks: App) -> None:
    """200,000 finished jobs (and a long-open snapshot) in the table: the claim still reads
    only the partial index of runnable rows, one row for one runnable job."""
    query(tasks.dsn, """
        INSERT INTO {schema}.jobs (queue, task, state, finished_at, attempt)
        SELECT 'q', 't', (ARRAY['succeeded', 'discarded', 'cancelled'])[1 + g % 3], now(), 1
          FROM generate_series(1, 200000) AS g""", schema=tasks.schema)
    due = tasks.tasks["t"].configure(queue="q").enqueue()
    query(tasks.dsn, "ANALYZE {schema}.jobs", schema=tasks.schema)
    with psycopg.connect(tasks.dsn) as snapshot:  # another session's long-open snapshot
        snapshot.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        snapshot.execute("SELECT 1")
        with tasks.connect() as conn, conn.transaction():
            plan = [r[0] for r in conn.execute(
                b"EXPLAIN (ANALYZE, COSTS OFF) " + tasks.queries.CLAIM,
                claim_params(inline_bytes=1)).fetchall()]
            conn.execute("ROLLBACK")
    text = "\n".join(plan)
    assert "Seq Scan on jobs" not in text and "jobs_claim_idx" in text, text
    scan = next(line for line in plan if "jobs_claim_idx" in line)
    assert re.search(r"rows=1(\.00)? ", scan), text
    assert (tasks.get_job(due) or {})["state"] == "available"


WAITING = ("scheduled", "available", "running")


def _cli(app: App, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "skipjack", "--dsn", app.dsn, "--schema",
                           app.schema, *args], cwd=TESTS, capture_output=True, text=True,
                          timeout=120)


def test_fc36_retry_leaves_a_job_whose_key_a_live_job_holds_and_retries_the_rest(
        tasks: App, caplog: pytest.LogCaptureFixture) -> None:
    """A held key k while waiting or running, was discarded, and B now holds k; C and D are
    plain discarded jobs. Retrying A, C and D (the CLI, then the App) while the maintenance
    thread rescues and schedules cron: C and D are retried, A is left alone with an answer
    that names the key and its holder, nothing fails. A holder that commits while a retry
    waits for it does not fail the retry either."""
    t = tasks.tasks["t"].configure(queue="q")
    a = t.configure(idempotency_key="k", unique_while=WAITING).enqueue()
    c, d = enqueue(tasks, "t", 2, queue="q")
    assert sorted(tasks.discard([a, c, d])) == sorted([a, c, d])
    b = t.configure(idempotency_key="k").enqueue()
    assert b != a
    (lost,) = enqueue(tasks, "t", 1, queue="r")  # for the rescuer
    claim(tasks, queue="r", limit=1)
    expire(tasks, lost)
    tasks.cron("* * * * *", name="tick")(tasks.tasks["t"])
    m = Maintenance(tasks.db, stage_interval=0.1, rescue_interval=0.1, retention=None,
                    discarded_retention=None, on_staged=lambda queue: None,
                    cron=lambda conn: schedule_due(tasks, conn))
    m.start()
    try:
        done = _cli(tasks, "jobs", "retry", str(a), str(c), str(d))
        assert done.returncode == 1, done.stderr
        assert done.stdout == (f"{a}\tleft alone: its idempotency key 'k' is held by job {b} "
                               f"(available)\n{c}\tretried\n{d}\tretried\n")
        assert "2 jobs retried; 1 left alone: 1 idempotency key held by another job." \
            in done.stderr and "Traceback" not in done.stderr

        assert sorted(tasks.discard([c, d])) == sorted([c, d])
        with caplog.at_level("INFO", logger="skipjack.admin"):
            assert tasks.retry_discarded([a, c, d]) == [c, d]
        assert f"job {a} left alone: its idempotency key 'k' is held by job {b}" in caplog.text

        assert sorted(tasks.discard([c, d])) == sorted([c, d])
        assert tasks.retry_discarded_each([a, c, d, c, b, 10**12]) == [
            RetryResult(a, "key_held", "discarded", "k", b, "available"),
            RetryResult(c, "retried", "available"),
            RetryResult(d, "retried", "available"),
            RetryResult(b, "not_discarded", "available", "k"),
            RetryResult(10**12, "not_found"),
        ]
        assert [(tasks.get_job(i) or {})["state"] for i in (a, b, c, d)] == [
            "discarded", "available", "available", "available"]

        # a job taking A2's key is inserted by a transaction that commits while the retry
        # waits for it
        a2 = t.configure(idempotency_key="k2", unique_while=WAITING).enqueue()
        (e,) = enqueue(tasks, "t", 1, queue="q")
        assert sorted(tasks.discard([a2, e])) == sorted([a2, e])
        with ThreadPoolExecutor(1) as pool, tasks.connect(autocommit=False) as holder:
            b2 = tasks.enqueue(t.configure(idempotency_key="k2").job(), conn=holder)
            retrying = pool.submit(tasks.retry_discarded_each, [a2, e])
            wait_until(lambda: query(tasks.dsn, "SELECT count(*) FROM pg_stat_activity WHERE "
                                     "%s = ANY(pg_blocking_pids(pid))",
                                     [holder.info.backend_pid])[0][0],
                       timeout=60, what="the retry waiting for the new holder of k2")
            holder.commit()
            assert retrying.result(timeout=60) == [
                RetryResult(a2, "key_held", "discarded", "k2", b2, "available"),
                RetryResult(e, "retried", "available")]

        # the maintenance duties went on meanwhile
        wait_until(lambda: (tasks.get_job(lost) or {})["state"] == "available", timeout=60,
                   what="the expired job rescued")
        wait_until(lambda: query(tasks.dsn, "SELECT count(*) FROM {schema}.jobs WHERE "
                                 "idempotency_key LIKE 'cron:tick:%%'", schema=tasks.schema)[0][0],
                   timeout=60, what="the cron slot enqueued")
        assert m.is_alive()
    finally:
        m.stop()
        m.join(30)


def test_fc36_discarded_jobs_sharing_a_key_retry_the_newest_and_a_dry_run_says_so(
        tasks: App) -> None:
    """Two discarded jobs hold one key (their unique_while leaves out 'discarded'): a retry
    of both, or of every discarded job, retries the newest and leaves the other alone, held
    by it, instead of failing on the unique index; a dry run gives the same answers first
    and changes nothing."""
    t = tasks.tasks["t"].configure(queue="q", idempotency_key="shared", unique_while=WAITING)
    older = t.enqueue()
    assert tasks.discard([older]) == [older]
    newer = t.enqueue()
    assert newer != older and tasks.discard([newer]) == [newer]
    (plain,) = enqueue(tasks, "t", 1, queue="q")
    assert tasks.discard([plain]) == [plain]
    expected = (f"{older}\tleft alone: its idempotency key 'shared' is held by job {newer} "
                "(available)\n")
    dry = _cli(tasks, "jobs", "retry", str(older), str(newer), str(plain), "--dry-run")
    assert dry.stdout == expected + f"{newer}\twould be retried\n{plain}\twould be retried\n"
    assert [(tasks.get_job(i) or {})["state"] for i in (older, newer, plain)] == [
        "discarded"] * 3
    done = _cli(tasks, "jobs", "retry", "--all")  # a filter: what it left alone is no error
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert expected in done.stdout and f"{newer}\tretried\n" in done.stdout
    assert [(tasks.get_job(i) or {})["state"] for i in (older, newer, plain)] == [
        "discarded", "available", "available"]


def test_fc38_pruning_keeps_each_schedules_latest_slot_and_copes_with_foreign_keys(
        app: App) -> None:
    """A schedule every minute, a job per slot, each job finished and pruned with a retention
    of 1 s while the application's rows reference it (ON DELETE SET NULL and CASCADE): every
    prune succeeds. Cron history younger than the longest grace (7 days) stays; older history
    goes except each schedule's latest slot, so a scheduler restarted with a grace of 600 s
    resumes after it and enqueues no slot twice. An ON DELETE RESTRICT reference makes the
    batch fail (the worker's pruner logs it and goes on: see the test above)."""
    fks = query(app.dsn, "SELECT conname FROM pg_constraint c JOIN pg_namespace n ON n.oid = "
                         "c.connamespace WHERE c.contype = 'f' AND n.nspname = %s", [app.schema])
    assert fks == []  # no foreign key between skipjack's own tables
    query(app.dsn, """
        CREATE TABLE {schema}.nulled (job_id bigint REFERENCES {schema}.jobs ON DELETE SET NULL);
        CREATE TABLE {schema}.cascaded (job_id bigint REFERENCES {schema}.jobs ON DELETE CASCADE);
    """, schema=app.schema)

    def scheduler(a: App) -> App:
        a.cron("* * * * *", name="tick", grace=600)(a.task(name="tick")(lambda: None))
        return a

    def finish_and_reference() -> None:
        query(app.dsn, """
            UPDATE {schema}.jobs SET state = 'succeeded', finished_at = now() - interval '1 h'
             WHERE state = 'available';
            INSERT INTO {schema}.nulled SELECT id FROM {schema}.jobs;
            INSERT INTO {schema}.cascaded SELECT id FROM {schema}.jobs;
        """, schema=app.schema)

    def slots() -> list[datetime]:
        return [s for (s,) in query(app.dsn, "SELECT slot FROM {schema}.cron_slots ORDER BY 1",
                                    schema=app.schema)]

    keys: list[str] = []

    def new_keys() -> None:
        keys.extend(k for (k,) in query(app.dsn, "SELECT idempotency_key FROM {schema}.jobs "
                                                 "WHERE state = 'available'", schema=app.schema))

    start = datetime(2030, 1, 1, 12, tzinfo=UTC)
    scheduler(app)
    with app.connect() as conn:
        for minute in range(10):
            assert schedule_due(app, conn, now=start + timedelta(minutes=minute, seconds=5)) == 1
            new_keys()
            finish_and_reference()
            assert app.prune(retention=1.0) == 1
        assert query(app.dsn, "SELECT count(*), count(job_id) FROM {schema}.nulled",
                     schema=app.schema) == [(10, 0)]
        assert query(app.dsn, "SELECT count(*) FROM {schema}.cascaded",
                     schema=app.schema) == [(0,)]
        every_slot = [start + timedelta(minutes=i) for i in range(10)]
        assert slots() == every_slot

        query(app.dsn, "UPDATE {schema}.cron_slots SET recorded_at = now() - interval '2 days'",
              schema=app.schema)
        app.prune(retention=1.0)
        assert slots() == every_slot  # inside the longest grace a schedule may have
        query(app.dsn, "UPDATE {schema}.cron_slots SET recorded_at = now() - interval '8 days'",
              schema=app.schema)
        app.prune(retention=1.0)
        assert slots() == every_slot[-1:]  # the scheduler resumes after the latest

        restarted = scheduler(App(app.dsn, schema=app.schema))
        for seconds in (30, 50):  # 12:09's job is pruned; 12:00-12:08 are within the grace
            assert schedule_due(restarted, conn, now=every_slot[-1] + timedelta(
                seconds=seconds)) == 0
        assert schedule_due(restarted, conn, now=start + timedelta(minutes=10, seconds=5)) == 1
        new_keys()
        restarted.close()
    assert len(keys) == len(set(keys)) == 11  # one job per slot, 12:00 to 12:10

    finish_and_reference()
    for table, action, refused in (("restricted", "ON DELETE RESTRICT", ("23001", "23503")),
                                   ("unspecified", "", ("23503",))):  # NO ACTION, the default
        query(app.dsn, f"CREATE TABLE {{schema}}.{table} (job_id bigint REFERENCES "
                       f"{{schema}}.jobs {action}); "
                       f"INSERT INTO {{schema}}.{table} SELECT id FROM {{schema}}.jobs",
              schema=app.schema)
        with pytest.raises(psycopg.IntegrityError, match=f"foreign key constraint .{table}_"):
            app.prune(retention=1.0)
        done = _cli(app, "prune", "--retention", "1s")
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        # RESTRICT is restrict_violation (23001) on PostgreSQL 18, foreign_key_violation on 15
        assert done.stderr.splitlines()[1].startswith(tuple(  # after the database line
            f"error: the database refused a statement ({code}): " for code in refused))
        assert states(app.dsn, app.schema) == {"succeeded": 1}
        query(app.dsn, f"DROP TABLE {{schema}}.{table}", schema=app.schema)


def test_fc35_one_job_the_stager_or_the_rescuer_fails_on_holds_up_no_other(app: App) -> None:
    """A trigger of the application's refuses every move of one job: the stager stages the
    other due jobs and the rescuer rescues the other expired ones, skipping that one (the
    maintenance thread's skip lists), and both take it again once the trigger is gone."""
    t = app.task(name="t", queue="q")(lambda: None)
    delayed = [t.configure(delay=0.05).enqueue() for _ in range(5)]
    query(app.dsn, """
        CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.id = %s AND NEW.state <> OLD.state THEN
                RAISE EXCEPTION 'job % may not move', NEW.id;
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse BEFORE UPDATE ON {schema}.jobs
            FOR EACH ROW EXECUTE FUNCTION {schema}.refuse();
    """.replace("%s", str(delayed[0])), schema=app.schema)
    staging, rescuing = SkipList(), SkipList()
    staged: Counter[str] = Counter()  # the five fall due over the few ms their enqueues took
    with app.connect() as conn:
        wait_until(lambda: staged.update(stage(conn, app.queries, app.schema,
                                               skipped=staging)) or staged == {"q": 4},
                   timeout=10, what="the four other delayed jobs staged")
        assert staging.ids() == [delayed[0]]
        running = claim(app, "q", 10)
        assert len(running) == 4
        for row in running:
            expire(app, row[0])
        query(app.dsn, "CREATE OR REPLACE FUNCTION {schema}.refuse() RETURNS trigger "
                       "LANGUAGE plpgsql AS $$ BEGIN IF NEW.id = %s AND OLD.state = 'running' "
                       "THEN RAISE EXCEPTION 'no'; END IF; RETURN NEW; END $$"
              .replace("%s", str(running[0][0])), schema=app.schema)
        rescued = rescue(conn, app.queries, skipped=rescuing)
        assert sorted(r[0] for r in rescued) == sorted(r[0] for r in running[1:])
        assert rescuing.ids() == [running[0][0]]
        query(app.dsn, "DROP TRIGGER refuse ON {schema}.jobs", schema=app.schema)
        wait_until(lambda: stage(conn, app.queries, app.schema, skipped=staging) == {"q": 1},
                   timeout=10, what="the refused job staged once the fault is gone")
        wait_until(lambda: rescue(conn, app.queries, skipped=rescuing), timeout=10,
                   what="the refused job rescued once the fault is gone")
    assert states(app.dsn, app.schema) == {"available": 5}

