"""Real faults: stalled and killed workers, failing writes, timeouts, restarts, storms."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import psycopg
import pytest

from skipjack import App
from skipjack.channels import channel_name
from skipjack_tools.chaos import ChaosOptions, run_chaos

from support import (
    Server,
    WorkerProcess,
    create_log_tables,
    effect_counts,
    exec_counts,
    query,
    states,
    wait_until,
)

FAST = ["--lease", "1", "--heartbeat", "0.2", "--rescue-interval", "0.3", "--poll-interval",
        "0.5"]
TASKS = ("sleep", "effect", "async_effect", "held_effect", "slow_query", "fail")


@pytest.fixture
def tasks(app: App) -> App:
    create_log_tables(app.dsn, app.schema)
    for name in TASKS:
        app.task(name=name)(lambda **kw: None)
    return app


def enqueue(app: App, task: str, n: int = 1, **args: object) -> list[int]:
    with app.connect() as conn:
        return app.enqueue_many([app.tasks[task].job(**args) for _ in range(n)], conn=conn)


@pytest.mark.parametrize("task", ["effect", "async_effect"])
def test_stalled_worker_is_fenced_and_cancelled(tasks: App, tmp_path: Path, task: str) -> None:
    """A is SIGSTOPped past its lease; B rescues and finishes the job; A resumes and every
    write it attempts for the job is rejected; the effect exists once."""
    (job_id,) = enqueue(tasks, task, seconds=3)
    a = WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "a.log")
    try:
        wait_until(lambda: exec_counts(tasks.dsn, tasks.schema) == {job_id: 1}, timeout=30,
                   what="A started the job")
        a.signal(signal.SIGSTOP)
        with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "b.log"):
            wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=30,
                       what="B finished the rescued job")
            a.signal(signal.SIGCONT)
            # its renewal refused (lease lost) or, first, the lease run out (lease expired)
            wait_until(lambda: any(s in a.log() for s in ("lease lost", "lease expired",
                                                          "stale complete")),
                       timeout=30, what="A noticed it lost the lease")
            if task == "effect":  # the sync handler runs on, then its fenced write is refused
                wait_until(lambda: "stale complete rejected" in a.log(), timeout=30,
                           what="A's completion rejected")
    finally:
        a.kill()
    job = tasks.get_job(job_id) or {}
    assert job["attempt"] == 2  # claimed twice
    assert effect_counts(tasks.dsn, tasks.schema) == {job_id: 1}
    if task == "async_effect":  # A's handler was cancelled: it never finished
        assert exec_counts(tasks.dsn, tasks.schema, "finish") == {job_id: 1}


def test_fc39_lease_is_given_up_while_its_renewal_hangs(tasks: App, tmp_path: Path) -> None:
    """A renewal that hangs (here behind a lock on the jobs table; on a network that drops
    packets silently, for as long as the TCP timeouts allow) does not keep a handler running
    past its lease: the worker takes the job from its handler while the renewal still
    waits. Once the lock is released the job is rescued and runs again; its effect exists
    once."""
    (job_id,) = enqueue(tasks, "async_effect", seconds=60)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST, log=tmp_path / "w.log") as w:
        wait_until(lambda: exec_counts(tasks.dsn, tasks.schema) == {job_id: 1}, timeout=30,
                   what="the job started")
        with psycopg.connect(tasks.dsn) as locker:  # a transaction: the lock is held
            locker.execute(psycopg.sql.SQL("LOCK TABLE {}.jobs IN ACCESS EXCLUSIVE MODE")
                           .format(psycopg.sql.Identifier(tasks.schema)))
            wait_until(lambda: f"job {job_id}: lease expired" in w.log(), timeout=30,
                       what="the handler cancelled while the renewal waits for the lock")
            locker.rollback()
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=30,
                   what="the job rescued and run again")
    assert "cancelling its handler" in w.log()
    assert effect_counts(tasks.dsn, tasks.schema) == {job_id: 1}
    assert exec_counts(tasks.dsn, tasks.schema, "finish") == {job_id: 1}  # attempt 2 only
    assert (tasks.get_job(job_id) or {})["attempt"] == 2


def test_transient_error_on_completion_write_is_retried(tasks: App, tmp_path: Path) -> None:
    """The first three outcome writes fail inside the server; the completer retries on a fresh
    connection and no job stays running or runs twice."""
    query(tasks.dsn, """
        CREATE SEQUENCE {schema}.failures;
        CREATE FUNCTION {schema}.flaky() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.state = 'succeeded' AND nextval(TG_TABLE_SCHEMA || '.failures') <= 3 THEN
                RAISE EXCEPTION 'injected failure of the completion write';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER flaky BEFORE UPDATE ON {schema}.jobs
            FOR EACH ROW EXECUTE FUNCTION {schema}.flaky();
    """, schema=tasks.schema)
    ids = enqueue(tasks, "sleep", 20)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--lease", "5",
                       log=tmp_path / "w.log") as w:
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 20}, timeout=60,
                   what="all recorded")
        assert "injected failure" in w.log()
    assert exec_counts(tasks.dsn, tasks.schema) == dict.fromkeys(ids, 1)


def test_timeouts_set_low_for_the_worker_session(tasks: App, tmp_path: Path) -> None:
    """idle_in_transaction_session_timeout 300 ms, statement_timeout 1 s on every session:
    lease mode never idles in a transaction, and a handler's timed-out statement fails only
    its own job."""
    dsn = psycopg.conninfo.make_conninfo(
        tasks.dsn, options="-c idle_in_transaction_session_timeout=300 -c statement_timeout=1000")
    ok = enqueue(tasks, "sleep", 20, seconds=0.5)
    (slow,) = tasks.enqueue_many([tasks.tasks["slow_query"].configure(max_attempts=1)
                                  .job(seconds=3)])
    with WorkerProcess(dsn, tasks.schema, ["default"], "--concurrency", "8", "--lease", "5",
                       log=tmp_path / "w.log") as w:
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 20, "discarded": 1},
                   timeout=60, what="jobs done")
        assert w.proc.poll() is None
        assert "idle-in-transaction" not in w.log()
    assert exec_counts(tasks.dsn, tasks.schema) == dict.fromkeys([*ok, slow], 1)
    error = (tasks.get_job(slow) or {})["errors"][-1]["error"]
    assert "statement timeout" in error


def test_tcp_timeouts_the_dsn_sets_are_kept(tasks: App) -> None:
    """skipjack's TCP timeouts and keepalives are defaults: a DSN that sets its own (to
    notice a network partition sooner, say) keeps them, on every connection and pool."""
    dsn = psycopg.conninfo.make_conninfo(tasks.dsn, tcp_user_timeout=4000, keepalives_idle=2)
    app = App(dsn, schema=tasks.schema)
    try:
        with app.connect() as conn:
            given = conn.info.get_parameters()
        assert (given["tcp_user_timeout"], given["keepalives_idle"]) == ("4000", "2")
        assert given["keepalives_interval"] == "5"  # the DSN does not set it: skipjack's
        assert "tcp_user_timeout" not in app.db.connect_kwargs  # what pools are given
    finally:
        app.close()
    with tasks.connect() as conn:
        assert conn.info.get_parameters()["tcp_user_timeout"] == "30000"


def test_heavy_notification_stream_does_not_starve_pickup(tasks: App, tmp_path: Path) -> None:
    stop = threading.Event()

    def storm() -> None:
        with psycopg.connect(tasks.dsn, autocommit=True) as conn:
            while not stop.is_set():
                conn.execute("SELECT pg_notify(%s, 'default')", [channel_name(tasks.schema)])

    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--lease", "5",
                       "--poll-interval", "1", log=tmp_path / "w.log"):
        storms = [threading.Thread(target=storm) for _ in range(2)]
        for t in storms:
            t.start()
        try:
            later = tasks.enqueue(tasks.tasks["sleep"].configure(delay=1).job())  # no NOTIFY
            now = enqueue(tasks, "sleep", 5)
            wait_until(lambda: set(exec_counts(tasks.dsn, tasks.schema, "finish"))
                       == {later, *now}, timeout=30, what="jobs picked up during the storm")
        finally:
            stop.set()
            for t in storms:
                t.join()


def test_enqueue_across_a_restart_is_all_or_nothing(tasks: App, server: Server) -> None:
    done: list[int] = []
    errors: list[str] = []
    stop = threading.Event()

    def enqueuer() -> None:
        t = tasks.tasks["sleep"]
        while not stop.is_set():
            try:
                with psycopg.connect(tasks.dsn, autocommit=True, connect_timeout=2) as conn:
                    done.extend(tasks.enqueue_many([t.job() for _ in range(50)], conn=conn))
            except psycopg.OperationalError as exc:
                errors.append(str(exc))

    thread = threading.Thread(target=enqueuer)
    thread.start()
    try:
        wait_until(lambda: len(done) >= 500, timeout=30, what="enqueues before the restart")
        server.restart()
        before = len(done)
        wait_until(lambda: len(done) >= before + 500, timeout=60, what="enqueues after")
    finally:
        stop.set()
        thread.join()
    assert errors, "the restart should have failed some enqueues"
    ((rows,),) = query(tasks.dsn, "SELECT count(*) FROM {schema}.jobs", schema=tasks.schema)
    assert rows % 50 == 0 and rows >= len(done)
    assert rows - len(done) <= 50  # at most one call whose commit outlived its reply


def test_held_claim_rolls_back_on_sigkill(tasks: App, tmp_path: Path) -> None:
    """transaction="claim": a killed worker's claim is rolled back by PostgreSQL at once; no
    lease, no rescuer; the next worker runs it and its effect commits once."""
    (job_id,) = enqueue(tasks, "held_effect", seconds=60)
    args = ["--lease", "30", "--heartbeat", "0.5", "--rescue-interval", "60"]
    a = WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args, log=tmp_path / "a.log")
    wait_until(lambda: exec_counts(tasks.dsn, tasks.schema) == {job_id: 1}, timeout=30,
               what="held job started")
    job = tasks.get_job(job_id) or {}
    assert job["state"] == "available" and job["attempt"] == 0  # the claim is not committed
    a.kill()
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args, log=tmp_path / "b.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=30,
                   what="second worker ran it")
    job = tasks.get_job(job_id) or {}
    assert job["attempt"] == 1
    assert effect_counts(tasks.dsn, tasks.schema) == {job_id: 1}
    assert exec_counts(tasks.dsn, tasks.schema) == {job_id: 2}


def test_held_claim_of_a_killed_worker_in_a_statement_is_ended_by_the_server(
        tasks: App, tmp_path: Path) -> None:
    """SIGKILL while the claim's handler waits on a 600 s statement of the claim's
    transaction: the server sees no client until that statement ends, but it cancels it at
    the job's lease (2 s) plus 5 s, the claim is rolled back and the next worker runs the
    job, whose effect commits once. (Before, the job was held for the 600 s.)"""
    (job_id,) = enqueue(tasks, "held_effect", seconds=600, in_statement=True)
    args = ["--lease", "30", "--heartbeat", "0.5", "--rescue-interval", "60"]
    a = WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args, log=tmp_path / "a.log")
    try:
        wait_until(lambda: query(tasks.dsn, "SELECT count(*) FROM pg_stat_activity WHERE "
                                 "datname = current_database() AND query LIKE "
                                 "'SELECT pg_sleep%%'")[0][0] == 1,
                   timeout=30, what="the held job's statement running")
    finally:
        a.kill()
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args, log=tmp_path / "b.log"):
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=60,
                   what="the second worker ran it")
    assert effect_counts(tasks.dsn, tasks.schema) == {job_id: 1}
    assert exec_counts(tasks.dsn, tasks.schema) == {job_id: 2}


def test_held_claim_of_a_stalled_worker_is_ended_by_the_server(tasks: App,
                                                               tmp_path: Path) -> None:
    """SIGSTOP: the session sits idle in its transaction past the job's 2 s lease, the server
    ends it, the job runs elsewhere; the resumed worker cannot commit its effect."""
    (job_id,) = enqueue(tasks, "held_effect", seconds=4)
    args = ["--lease", "30", "--heartbeat", "0.5"]
    a = WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args, log=tmp_path / "a.log")
    try:
        wait_until(lambda: exec_counts(tasks.dsn, tasks.schema) == {job_id: 1}, timeout=30,
                   what="held job started")
        a.signal(signal.SIGSTOP)
        with WorkerProcess(tasks.dsn, tasks.schema, ["default"], *args, log=tmp_path / "b.log"):
            wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 1}, timeout=30,
                       what="another worker ran it")
            a.signal(signal.SIGCONT)
            wait_until(lambda: "claim-mode claim on default failed" in a.log(), timeout=30,
                       what="the stalled worker's transaction failed")
    finally:
        a.kill()
    assert effect_counts(tasks.dsn, tasks.schema) == {job_id: 1}


def test_read_only_database_for_a_while(tasks: App, server: Server, tmp_path: Path) -> None:
    """FC-33: the server turns read-only for ~3 s mid-run; workers back off, stay up, and
    afterwards every job completes with exactly one effect."""
    ids = enqueue(tasks, "effect", 200, seconds=0.05)
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--concurrency", "8", *FAST,
                       log=tmp_path / "w.log") as w:
        wait_until(lambda: len(effect_counts(tasks.dsn, tasks.schema)) >= 20, timeout=30,
                   what="work under way")
        _read_only(server, True)
        try:
            wait_until(lambda: "read-only" in w.log(), timeout=30, what="writes refused")
            wait_until(lambda: w.log().count("read-only") >= 5, timeout=30,
                       what="a few refused writes")
        finally:
            _read_only(server, False)
        wait_until(lambda: states(tasks.dsn, tasks.schema) == {"succeeded": 200}, timeout=90,
                   what="all jobs after recovery")
        assert w.proc.poll() is None
    assert effect_counts(tasks.dsn, tasks.schema) == dict.fromkeys(ids, 1)


def _read_only(server: Server, on: bool) -> None:
    with server.connect() as conn:
        conn.execute("ALTER SYSTEM SET default_transaction_read_only = " + ("on" if on else "off"))
        conn.execute("SELECT pg_reload_conf()")


def test_chaos_audit_finds_nothing_lost_stuck_or_duplicated(tasks: App, server: Server) -> None:
    restart = None
    if server.kind == "local":
        version = sorted(Path("/etc/postgresql").iterdir())[-1].name
        restart = f"pg_ctlcluster --skip-systemctl-redirect {version} main restart -m fast"
    opts = ChaosOptions(jobs=800, workers=3, concurrency=4, duration_ms=20, kill_every=1.0,
                        stall_every=1.5, term_every=1.2, restart_db_every=4.0,
                        terminate_backends_every=2.0,
                        restart_cmd=restart, lease=1.0, seed=7, timeout=180,
                        schema=tasks.schema + "_chaos")
    audit = run_chaos(server.dsn if server.kind == "local" else None, opts)
    query(server.dsn, "DROP SCHEMA IF EXISTS {schema} CASCADE", schema=opts.schema)
    assert audit["ok"], audit
    assert (audit["lost"], audit["stuck"], audit["duplicate_effects"]) == (0, 0, 0)
    assert audit["completed"] == 800
    assert audit["faults"]["kills"] > 0 and audit["faults"]["db_restarts"] > 0
    assert audit["faults"]["graceful_stops"] > 0
    assert (audit["attempts_spent_by_graceful_stops"], audit["graceful_stops_failed"]) == (0, 0)
