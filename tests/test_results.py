"""Waiting for outcomes (JobHandle.result) and progress, against real worker processes."""

from __future__ import annotations

import asyncio
import json
import pickle
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from skipjack import App, JobFailed, JobHandle, JobNotFound, ResultTimeout, ValidationError
from skipjack import results as results_module
from skipjack.context import JobContext

from support import TESTS, Server, WorkerProcess, query, wait_until

FAST = ["--lease", "2", "--heartbeat", "0.3", "--poll-interval", "0.5"]


@pytest.fixture
def tasks(app: App) -> App:
    """The app with results_app's task names, and the gates table of its stepwise task."""
    with app.connect() as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.gates (name text PRIMARY KEY)").format(
            sql.Identifier(app.schema)))
    for name in ("add", "add_async", "stepwise"):
        app.task(name=name)(lambda **kw: None)
    app.task(name="held_until", transaction="claim", lease=30.0)(lambda **kw: None)
    app.task(name="flaky_once", max_attempts=3)(lambda **kw: None)
    app.task(name="boom", max_attempts=1)(lambda **kw: None)
    return app


def worker(app: App, tmp_path: Path) -> WorkerProcess:
    return WorkerProcess(app.dsn, app.schema, ["default"], *FAST, app="results_app:app",
                         log=tmp_path / "worker.log")


def test_a_handle_is_the_id(tasks: App) -> None:
    handle = tasks.tasks["add"].configure(queue="nobody").enqueue(a=1, b=2)
    assert isinstance(handle, JobHandle) and isinstance(handle, int)
    assert handle.id == int(handle) and json.dumps({"id": handle}) == f'{{"id": {handle.id}}}'
    assert pickle.loads(pickle.dumps(handle)) == handle.id
    assert str(handle) == f"{handle}" == str(handle.id) and repr(handle) == f"JobHandle({handle})"
    assert query(tasks.dsn, "SELECT id FROM {schema}.jobs WHERE id = %s", (handle,),
                 tasks.schema) == [(handle.id,)]
    assert handle.state() == "available" and handle.progress() is None


def test_result_returns_the_value_woken_by_the_notification(
        tasks: App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # with the fallback reads an hour apart, only the notification can end these waits
    monkeypatch.setattr(results_module, "POLL_INTERVAL", 3600.0)
    with worker(tasks, tmp_path):
        handle = tasks.tasks["add"].enqueue(a=2, b=3)
        assert handle.result(timeout=60) == {"sum": 5}
        later = tasks.tasks["add_async"].enqueue(a=20, b=22)
        assert asyncio.run(later.result_async(timeout=60)) == 42
        # a handle made from a bare id waits the same way, and a finished job answers at once
        assert tasks.job_handle(int(handle)).result(timeout=0) == {"sum": 5}


def test_result_raises_the_error_of_a_discarded_job(tasks: App, tmp_path: Path) -> None:
    with worker(tasks, tmp_path):
        handle = tasks.tasks["boom"].enqueue(message="the disk is full")
        with pytest.raises(JobFailed) as failed:
            handle.result(timeout=60)
    assert failed.value.state == "discarded" and failed.value.job_id == handle.id
    assert "ValueError: the disk is full" in str(failed.value)
    assert failed.value.errors[-1]["type"] == "builtins.ValueError"
    assert "raise ValueError(message)" in str(failed.value.errors[-1]["traceback"])


def test_result_times_out_cleanly_and_changes_nothing(tasks: App) -> None:
    handle = tasks.tasks["add"].configure(queue="nobody").enqueue(a=1, b=1)
    with pytest.raises(ResultTimeout, match=rf"job {handle.id} had not ended within 0.3s"):
        handle.result(timeout=0.3)
    with pytest.raises(ResultTimeout):
        asyncio.run(handle.result_async(timeout=0.3))
    assert query(tasks.dsn, "SELECT state, attempt FROM {schema}.jobs WHERE id = %s",
                 (handle,), tasks.schema) == [("available", 0)]
    for bad in (-1, "5", float("nan"), True):
        with pytest.raises(ValidationError, match="timeout"):
            handle.result(timeout=bad)  # type: ignore[arg-type]


def test_a_cancel_by_hand_wakes_the_waiter(tasks: App,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results_module, "POLL_INTERVAL", 3600.0)
    handle = tasks.tasks["add"].configure(queue="nobody").enqueue(a=1, b=1)
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            handle.result(timeout=60)
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until(lambda: query(tasks.dsn, "SELECT awaited FROM {schema}.jobs WHERE id = %s",
                             (handle,), tasks.schema) == [(True,)])
    tasks.cancel([handle.id])
    waiter.join(60)
    assert len(raised) == 1 and isinstance(raised[0], JobFailed)
    assert raised[0].state == "cancelled"


def test_without_notifications_the_waiter_polls(tasks: App, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results_module, "POLL_INTERVAL", 0.05)
    monkeypatch.setattr(results_module, "done_channel_name", lambda schema: "nobody_sends")
    with worker(tasks, tmp_path):
        assert tasks.tasks["add"].enqueue(a=4, b=4).result(timeout=60) == {"sum": 8}


def test_no_such_job(tasks: App) -> None:
    with pytest.raises(JobNotFound, match="no job 999999999"):
        tasks.job_handle(999_999_999).result(timeout=5)
    for bad in (1.5, True, 0, -5, 2**63, "7"):  # no handle to job 1 for 1.5 or True
        with pytest.raises(ValidationError, match=r"job_id: .* is not a job id \(an int in "
                                                  r"1\.\.2\^63-1\)"):
            tasks.job_handle(bad)  # type: ignore[arg-type]


def test_progress_is_visible_while_the_job_runs_and_after(tasks: App, tmp_path: Path) -> None:
    with worker(tasks, tmp_path):
        handle = tasks.tasks["stepwise"].enqueue(gate="g1")
        wait_until(lambda: handle.progress() == {"done": 1, "total": 2})
        assert handle.state() == "running"
        assert tasks.get_job(handle.id)["progress"] == {"done": 1, "total": 2}  # type: ignore[index]
        shown = subprocess.run(
            [sys.executable, "-m", "skipjack", "--dsn", tasks.dsn, "--schema", tasks.schema,
             "jobs", "show", str(handle.id)], cwd=TESTS, capture_output=True, text=True,
            check=True)
        assert json.loads(shown.stdout)["progress"] == {"done": 1, "total": 2}
        query(tasks.dsn, "INSERT INTO {schema}.gates VALUES ('g1')", schema=tasks.schema)
        assert handle.result(timeout=60) == "through"
    # the last report, made just before the end, came with the outcome
    assert handle.progress() == {"done": 2, "total": 2}


def test_a_wait_begun_right_after_the_enqueue_never_hides_the_job_from_claims(
        tasks: App, tmp_path: Path) -> None:
    # the waiter's mark locks the job's row for an instant: a claim at that instant skips
    # the job, so the mark wakes the queue again; and a mark that meets a claim's lock is
    # tried again soon. With polls an hour apart, every wait must still end in seconds.
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--poll-interval", "1h",
                       "--stage-interval", "1h", app="results_app:app",
                       log=tmp_path / "worker.log"):
        add = tasks.tasks["add"]
        for i in range(40):
            assert add.enqueue(a=i, b=1).result(timeout=30) == {"sum": i + 1}


def test_progress_the_database_cannot_store_is_dropped_and_leases_are_renewed(
        server: Server, tmp_path: Path) -> None:
    # a LATIN1 database has no check mark: that report cannot be written, and must neither
    # stop the renewals nor hold back other reports. The lease is 10 s, renewed every 0.3 s:
    # with a 2 s lease the job once ran twice in a loaded run of the whole suite (two test
    # processes on two cores), where a stall of 2 s lets a lease expire.
    name = "latin1_" + secrets.token_hex(4)
    with server.connect() as conn:
        conn.autocommit = True
        conn.execute(sql.SQL("CREATE DATABASE {} ENCODING 'LATIN1' TEMPLATE template0 "
                             "LC_COLLATE 'C' LC_CTYPE 'C'").format(sql.Identifier(name)))
    dsn = make_conninfo(server.dsn, dbname=name)
    app = App(dsn, schema="skipjack")
    try:
        app.migrate()
        with app.connect() as conn:
            conn.execute("CREATE TABLE skipjack.gates (name text PRIMARY KEY)")
        task = app.task(name="reports_then_waits")(lambda **kw: None)
        with pytest.raises(ValidationError, match="LATIN1|latin-1|iso8859"):
            task.enqueue(mark="\u2713", gate="g")  # refused before anything is written
        bad = task.enqueue(mark=True, gate="g")
        good = task.enqueue(mark=False, gate="g")
        # a character LATIN1 has goes there and back
        echoed = app.task(name="echo")(lambda **kw: None).enqueue(value="caf\u00e9")
        with WorkerProcess(dsn, "skipjack", ["default"], "--lease", "10", "--heartbeat", "0.3",
                           "--poll-interval", "0.5", app="results_app:app",
                           log=tmp_path / "worker.log") as w:
            wait_until(lambda: good.progress() == "step 1", what="the other job's report")
            wait_until(lambda: f"progress of job {bad} could not be written" in w.log(),
                       what="the report dropped")
            claimed = query(dsn, "SELECT lease_expires_at FROM skipjack.jobs WHERE id = %s",
                            (bad.id,))[0][0]
            wait_until(lambda: query(dsn, "SELECT lease_expires_at FROM skipjack.jobs "
                                          "WHERE id = %s", (bad.id,))[0][0] > claimed,
                       what="a renewal after the dropped report")
            query(dsn, "INSERT INTO skipjack.gates VALUES ('g')")
            assert good.result(timeout=60) == "waited"
            assert echoed.result(timeout=60) == "caf\u00e9"
            # its outcome carries the report too: written without it (and without its
            # result), with a note of the refusal, rather than never
            wait_until(lambda: bad.state() == "succeeded", what="the other job's outcome")
        rows = query(dsn, "SELECT attempt, progress, errors FROM skipjack.jobs WHERE id = %s",
                     (bad.id,))
        assert rows[0][:2] == (1, None) and "refused" in rows[0][2][-1]["error"]
        assert query(dsn, "SELECT attempt FROM skipjack.jobs ORDER BY id") == [(1,)] * 3
    finally:
        app.close()
        with server.connect() as conn:
            conn.autocommit = True
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def test_progress_refuses_what_is_not_json() -> None:
    ctx = JobContext(job=None)  # type: ignore[arg-type]
    for bad in (float("nan"), {1, 2}, "x" * 70_000, "a\x00b", "\ud800"):
        with pytest.raises(ValidationError, match="progress"):
            ctx.progress(bad)
    ctx.progress("\\u0000")  # a backslash, then "u0000": no NUL
    ctx.progress({"done": 3})
    assert ctx.reported == '{"done":3}'


def test_a_waiter_never_waits_on_a_claim_mode_job_s_row_lock(tasks: App, tmp_path: Path) -> None:
    with worker(tasks, tmp_path):
        handle = tasks.tasks["held_until"].enqueue(gate="g2")
        wait_until(lambda: query(tasks.dsn, "SELECT 1 FROM {schema}.gates WHERE name = %s",
                                 ("g2:started",), tasks.schema) == [(1,)])
        # its row is locked by the claim's open transaction: the timeout still holds
        with pytest.raises(ResultTimeout):
            handle.result(timeout=0.2)
        query(tasks.dsn, "INSERT INTO {schema}.gates VALUES ('g2')", schema=tasks.schema)
        assert handle.result(timeout=60) == "released"


def test_progress_not_written_is_put_back_unless_a_newer_one_came() -> None:
    from skipjack.runtime.heartbeat import Leases

    leases = Leases()
    leases.add(1, 7, 30.0)
    leases.add(2, 8, 30.0)
    leases.report(1, 7, '{"n":1}')
    leases.report(2, 8, '{"n":2}')
    taken = leases.take_progress()
    assert sorted(taken) == [(1, 7, '{"n":1}'), (2, 8, '{"n":2}')]
    assert leases.take_progress() == []
    leases.report(2, 8, '{"n":3}')  # newer than the one not written
    leases.remove(1, 7)
    leases.put_back_progress(taken)
    assert leases.take_progress() == [(2, 8, '{"n":3}')]


def test_the_due_time_notification_says_when_whatever_the_transaction_s_length(
        tasks: App) -> None:
    # it names the soonest run_at itself (the database's clock), so a job enqueued in a
    # transaction that stays open past its due time is staged at once after the commit;
    # seconds counted from the insert would stage it that much later
    from skipjack.channels import due_channel_name

    with tasks.connect() as listener, tasks.connect(autocommit=False) as caller:
        listener.execute(sql.SQL("LISTEN {}").format(
            sql.Identifier(due_channel_name(tasks.schema))))
        caller.execute("SET extra_float_digits = -12")  # no effect on the payload
        handle = tasks.tasks["add"].configure(delay=0.3).enqueue_on(caller, a=1, b=1)
        due = query(tasks.dsn, "SELECT now()")[0][0]  # a clock reading after the insert
        wait_until(lambda: query(tasks.dsn, "SELECT now() > %s::timestamptz + "
                                            "interval '0.5 s'", (due,))[0][0],
                   what="the job's due time passed while its transaction is open")
        caller.commit()
        notes = list(listener.notifies(timeout=10, stop_after=1))
    run_at = query(tasks.dsn, "SELECT extract(epoch FROM run_at)::float8 FROM {schema}.jobs "
                              "WHERE id = %s", (handle.id,), tasks.schema)[0][0]
    assert [float(n.payload) for n in notes] == [pytest.approx(run_at, abs=1e-6)]


def test_delayed_and_retried_jobs_start_on_time_whatever_the_stage_interval(
        tasks: App, tmp_path: Path) -> None:
    # a stager an hour apart: only the due-time notification (a delayed enqueue) and the
    # worker's own retry bring it forward, within the test's deadline
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, "--stage-interval", "1h",
                       app="results_app:app", log=tmp_path / "worker.log"):
        wait_until(lambda: tasks.workers() != [], what="the worker started")
        delayed = tasks.tasks["add"].configure(delay=1.0).enqueue(a=1, b=1)
        assert delayed.state() == "scheduled"
        assert delayed.result(timeout=60) == {"sum": 2}
        retried = tasks.tasks["flaky_once"].enqueue()
        assert retried.result(timeout=60) == 2
