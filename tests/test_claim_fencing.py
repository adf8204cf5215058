"""Claim order and fencing, driven through skipjack's own statements on a real server."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skipjack import App
from skipjack.outcome import Outcome, outcome_params
from skipjack.runtime.maintenance import GrowthAnalysis, rescue
from skipjack.sql import claim as queries
from skipjack.sql.outcomes import FEW_OUTCOMES, PLANNED_OUTCOMES, PREPARE_HEARTBEAT

from support import query, undo_claim, wait_until


def claim_params(**overrides: Any) -> dict[str, Any]:
    """Bind values of the claim statements, as a lease-mode worker sends them."""
    return {**queries.claim_params("q", 10, lease=30.0, worker="w", inline_bytes=1 << 20),
            **overrides}


def claim(app: App, queue: str = "q", limit: int = 10, lease: float = 30.0,
          worker: str = "w") -> list[tuple[Any, ...]]:
    """The rows of one claim, in the order the worker starts them."""
    with app.connect() as conn:
        return queries.in_claim_order(conn.execute(app.queries.CLAIM, claim_params(
            queue=queue, limit=limit, lease=lease, worker=worker)).fetchall())


def token(rows: list[tuple[Any, ...]]) -> int:
    """The lease_version (fencing token) of the one job a claim returned."""
    assert len(rows) == 1
    return int(rows[0][7])


def record(app: App, job_id: int, version: int, kind: str, delay: float = 0.0,
           error: str | None = None) -> list[tuple[int, str]]:
    """(id, new state) of the rows the outcome statement wrote (its run_at left out)."""
    with app.connect() as conn:
        rows = conn.execute(app.queries.RECORD_OUTCOMES, outcome_params(
            [Outcome(job_id, version, "", kind, delay, None, error)])).fetchall()
    return [(row[0], row[1]) for row in rows]


def heartbeat(app: App, job_id: int, version: int) -> list[tuple[int]]:
    with app.connect() as conn:
        return conn.execute(app.queries.HEARTBEAT, {
            "id": [job_id], "lease_version": [version], "lease": [30.0]}).fetchall()


def expire(app: App, job_id: int) -> None:
    query(app.dsn, "UPDATE {schema}.jobs SET lease_expires_at = now() - interval '1 second' "
                   "WHERE id = %s", [job_id], schema=app.schema)


def row(app: App, job_id: int) -> dict[str, Any]:
    job = app.get_job(job_id)
    assert job is not None
    return job


def _task(app: App) -> Any:
    @app.task(name="t", queue="q")
    def t(**kwargs: Any) -> None:
        pass

    return t


def test_claim_order_priority_then_run_at_then_id(app: App) -> None:
    t = _task(app)
    low = t.configure(priority=-5).enqueue()
    a = t.enqueue()
    b = t.enqueue()
    high = t.configure(priority=10).enqueue()
    older = t.configure(delay=0).enqueue()
    query(app.dsn, "UPDATE {schema}.jobs SET run_at = run_at - interval '1 hour' WHERE id = %s",
          [older], schema=app.schema)
    future = t.configure(delay=3600).enqueue()
    other_queue = t.configure(queue="other").enqueue()
    claimed = [r[0] for r in claim(app)]
    assert claimed == [high, older, a, b, low]
    assert future not in claimed and other_queue not in claimed


def test_claim_sets_lease_and_bumps_token(app: App) -> None:
    job_id = _task(app).enqueue()
    version = token(claim(app, lease=30))
    job = row(app, job_id)
    assert job["state"] == "running" and job["attempt"] == 1 and job["lease_version"] == version
    assert version >= 1  # raised by a random step from 0
    assert job["worker"] == "w"
    assert 29 < (job["lease_expires_at"] - job["attempted_at"]).total_seconds() <= 30
    assert claim(app) == []  # a running job is not claimed twice


@pytest.mark.parametrize("kind", ["complete", "retry", "discard", "release"])
def test_fc03_stale_worker_writes_change_nothing(app: App, kind: str) -> None:
    job_id = _task(app).enqueue()
    a = token(claim(app, worker="A"))
    expire(app, job_id)
    with app.connect() as conn:
        assert rescue(conn, app.queries) == [(job_id, "available")]
    b = token(claim(app, worker="B"))
    assert b > a
    before = row(app, job_id)
    assert record(app, job_id, a, kind, error=json.dumps({"error": "late"})) == []
    assert heartbeat(app, job_id, a) == []
    after = row(app, job_id)
    assert after == before
    assert after["worker"] == "B" and after["lease_version"] == b and after["attempt"] == 2
    assert record(app, job_id, b, "complete") == [(job_id, "succeeded")]
    assert record(app, job_id, b, "complete") == []  # exactly one terminal transition


@pytest.mark.parametrize("count", [FEW_OUTCOMES, FEW_OUTCOMES + 1, 200])
def test_a_batch_of_outcomes_writes_the_current_leases_only(app: App, count: int) -> None:
    # a batch of up to FEW_OUTCOMES and a larger one are written by different statements
    # (rows by primary key, or a join): both must be fenced the same way
    t = _task(app)
    ids = app.enqueue_many([t.job() for _ in range(count)])
    claimed = {r[0]: int(r[7]) for r in claim(app, limit=count)}
    assert sorted(claimed) == sorted(ids)
    stale = set(ids[::3])  # sent with a token that is not current: left as they are
    batch = [Outcome(i, claimed[i] + (1 if i in stale else 0), "", "complete") for i in ids]
    with app.connect() as conn:
        statement = app.queries.record_outcomes(len(batch))
        assert (statement == app.queries.RECORD_OUTCOMES) == (count <= FEW_OUTCOMES)
        written = conn.execute(statement, outcome_params(batch)).fetchall()
    assert sorted(r[0] for r in written) == sorted(set(ids) - stale)
    assert {r[1] for r in written} == {"succeeded"}
    assert {i: row(app, i)["state"] for i in stale} == {i: "running" for i in stale}


@pytest.mark.parametrize("count", [4, FEW_OUTCOMES + 4])
def test_a_batch_of_successes_and_immediate_retries_records_each_as_sent(app: App,
                                                                          count: int) -> None:
    """A plain success is sent with only its id, fencing token and kind; in the same batch a
    retry and a release with no delay (and a success with a result) keep their own values:
    runnable at once, the release's attempt given back, the result stored."""
    t = _task(app)
    ids = app.enqueue_many([t.configure(max_attempts=5).job() for _ in range(count)])
    claimed = {r[0]: int(r[7]) for r in claim(app, limit=count)}
    kinds = ["complete", "retry", "release", "complete"] * (count // 4)
    batch = [Outcome(i, claimed[i], "", kind, 0.0, '{"n": 1}' if n == 3 else None)
             for n, (i, kind) in enumerate(zip(ids, kinds, strict=True))]
    with app.connect() as conn:
        started = conn.execute("SELECT statement_timestamp()").fetchone()[0]  # type: ignore[index]
        written = conn.execute(app.queries.record_outcomes(len(batch)),
                               outcome_params(batch)).fetchall()
    assert sorted(r[0] for r in written) == sorted(ids)
    for n, (i, kind) in enumerate(zip(ids, kinds, strict=True)):
        r = row(app, i)
        if kind == "complete":
            assert r["state"] == "succeeded" and r["attempt"] == 1
            assert r["result"] == ({"n": 1} if n == 3 else None)
        else:  # runnable now: run_at set to the write's time, not left null
            assert r["state"] == "available" and r["run_at"] >= started
            assert r["attempt"] == (1 if kind == "retry" else 0)


@pytest.mark.parametrize("kind", ["complete", "retry", "discard", "release"])
def test_claim_undone_by_a_crash_does_not_hand_its_token_out_again(app: App, kind: str) -> None:
    """Claims commit without waiting for their WAL flush, so a server crash can undo one: the
    job is runnable again with its old token. The next claim must get a token of its own, so
    the first claimer's writes still match nothing."""
    job_id = _task(app).enqueue()
    for _ in range(5):
        a = token(claim(app, worker="A"))
        undo_claim(app.dsn, app.schema, job_id)
        b = token(claim(app, worker="B"))
        assert b != a
        before = row(app, job_id)
        assert record(app, job_id, a, kind, error=json.dumps({"error": "late"})) == []
        assert heartbeat(app, job_id, a) == []
        assert row(app, job_id) == before
        undo_claim(app.dsn, app.schema, job_id)


def test_fc01_rescue_returns_expired_jobs_by_row_only(app: App) -> None:
    t = _task(app)
    ids = [t.enqueue() for _ in range(10)]
    claim(app, worker="w")
    for job_id in ids:
        expire(app, job_id)
    claim(app, worker="w")  # a new worker with the same name inherits nothing
    with app.connect() as conn:
        rescued = rescue(conn, app.queries)
    assert sorted(rescued) == sorted((i, "available") for i in ids)
    job = row(app, ids[0])
    assert job["attempt"] == 1 and job["worker"] is None
    assert "lease expired" in job["errors"][-1]["error"]
    assert sorted(r[0] for r in claim(app)) == ids
    assert {row(app, i)["attempt"] for i in ids} == {2}


def test_fc01_rescue_on_last_attempt_goes_to_dead_letter(app: App) -> None:
    job_id = _task(app).configure(max_attempts=1).enqueue()
    claim(app)
    expire(app, job_id)
    with app.connect() as conn:
        assert rescue(conn, app.queries) == [(job_id, "discarded")]
    job = row(app, job_id)
    assert job["state"] == "discarded" and job["finished_at"] is not None
    assert [j["id"] for j in app.list_jobs(state="discarded")] == [job_id]
    assert app.retry_discarded([job_id]) == [job_id]
    assert row(app, job_id)["state"] == "available"


def test_rescue_leaves_live_leases_alone(app: App) -> None:
    job_id = _task(app).enqueue()
    claim(app, lease=30)
    with app.connect() as conn:
        assert rescue(conn, app.queries) == []
    assert row(app, job_id)["state"] == "running"


@pytest.mark.parametrize("round_", range(20))
def test_fc02_rescuer_never_overwrites_a_completion_that_landed_after_its_read(
        app: App, round_: int) -> None:
    """Step 1 of the rescuer reads the expired job; the worker then completes it; step 2
    must change nothing (it is fenced on state and the token read in step 1)."""
    job_id = _task(app).enqueue()
    v = token(claim(app))
    expire(app, job_id)
    with app.connect() as conn:
        candidates = conn.execute(app.queries.RESCUE_CANDIDATES, {"limit": 10}).fetchall()
        assert candidates == [(job_id, v)]
        if random.random() < 0.5:  # the completion lands between the two steps
            assert record(app, job_id, v, "complete") == [(job_id, "succeeded")]
            done = row(app, job_id)
            moved = conn.execute(app.queries.RESCUE, {
                "id": [job_id], "lease_version": [v]}).fetchall()
            assert moved == []
            assert row(app, job_id) == done
        else:  # or a re-claim by another worker lands there
            query(app.dsn, "UPDATE {schema}.jobs SET lease_version = %s, "
                           "lease_expires_at = now() + interval '30 s' WHERE id = %s",
                  [v + 1, job_id], schema=app.schema)
            moved = conn.execute(app.queries.RESCUE, {
                "id": [job_id], "lease_version": [v]}).fetchall()
            assert moved == []
            assert row(app, job_id)["state"] == "running"


def test_heartbeat_skips_rows_locked_by_others_instead_of_waiting(app: App) -> None:
    """The worker's completer may hold some of its jobs' rows while the heartbeat renews them
    all; the two locking in different orders deadlocked (FC-26's soak saw it). The heartbeat
    must never wait: a locked job comes back as still held but not renewed, the rest renew."""
    t = _task(app)
    ids = [t.enqueue(), t.enqueue()]
    rows = claim(app, limit=2)
    versions = {r[0]: int(r[7]) for r in rows}
    expire(app, ids[0])
    expire(app, ids[1])
    with app.connect() as completer:
        with completer.transaction():  # the completer is writing ids[1] and has not committed
            written = completer.execute(app.queries.RECORD_OUTCOMES, outcome_params(
                [Outcome(ids[1], versions[ids[1]], "", "complete")])).fetchall()
            assert [row[:2] for row in written] == [(ids[1], "succeeded")]
            with app.connect() as conn:
                conn.execute("SET lock_timeout = '10s'")  # the old statement waited here
                beat = conn.execute(app.queries.HEARTBEAT, {
                    "id": ids, "lease_version": [versions[i] for i in ids],
                    "lease": [30.0] * len(ids)}).fetchall()
            assert sorted(beat) == [(ids[0], False), (ids[1], None)]
            renewed = query(app.dsn, "SELECT id FROM {schema}.jobs "
                            "WHERE lease_expires_at > now() ORDER BY id", schema=app.schema)
            assert renewed == [(ids[0],)]
    assert row(app, ids[1])["state"] == "succeeded"
    assert heartbeat(app, ids[1], versions[ids[1]]) == []  # completed: no longer held


def test_a_foreign_key_to_a_job_hides_it_from_nothing(app: App) -> None:
    """An application row that references a job (a foreign key) holds FOR KEY SHARE on the
    job's row until its transaction ends, e.g. a transaction="complete" handler's effect row.
    The queue's own statements must not take that lock as a reason to skip the job: the
    heartbeat renews it, cancel requests reach it, the rescuer returns it, claims take it."""
    t = _task(app)
    running_id, waiting_id = t.enqueue(), t.enqueue(priority=-1)
    version = token(claim(app, limit=1))
    with app.connect() as handler, handler.transaction():
        handler.execute(sql.SQL("SELECT 1 FROM {}.jobs WHERE id = ANY(%s) FOR KEY SHARE")
                        .format(sql.Identifier(app.schema)), [[running_id, waiting_id]])
        assert heartbeat(app, running_id, version) == [(running_id, False)]
        assert app.cancel(ids=[running_id], timeout=2) == {"cancelled": 0, "requested": 1}
        assert heartbeat(app, running_id, version) == [(running_id, True)]
        expire(app, running_id)
        with app.connect() as conn:
            assert rescue(conn, app.queries) == [(running_id, "cancelled")]
        assert [r[0] for r in claim(app)] == [waiting_id]


def test_retry_after_last_attempt_discards_with_error_kept(app: App) -> None:
    job_id = _task(app).configure(max_attempts=2).enqueue()
    v = token(claim(app))
    err = json.dumps({"attempt": 1, "error": "RuntimeError: one"})
    assert record(app, job_id, v, "retry", delay=0.0, error=err) == [(job_id, "available")]
    v = token(claim(app))
    err = json.dumps({"attempt": 2, "error": "RuntimeError: two", "traceback": "tb"})
    assert record(app, job_id, v, "retry", delay=0.0, error=err) == [(job_id, "discarded")]
    job = row(app, job_id)
    assert [e["error"] for e in job["errors"]] == ["RuntimeError: one", "RuntimeError: two"]
    assert job["errors"][-1]["traceback"] == "tb"


def test_release_does_not_count_the_attempt(app: App) -> None:
    job_id = _task(app).enqueue()
    v = token(claim(app))
    assert record(app, job_id, v, "release") == [(job_id, "available")]
    job = row(app, job_id)
    assert job["attempt"] == 0 and job["lease_expires_at"] is None


def test_retry_delay_is_applied_on_database_clock(app: App) -> None:
    job_id = _task(app).enqueue()
    v = token(claim(app))
    record(app, job_id, v, "retry", delay=120.0, error=json.dumps({"error": "x"}))
    ((gap,),) = query(app.dsn, "SELECT extract(epoch FROM run_at - now()) FROM {schema}.jobs",
                      schema=app.schema)
    assert 110 < gap <= 120
    assert claim(app) == []


def test_one_index_of_the_running_jobs_serves_the_rescuer_and_a_limited_claim(
        app: App) -> None:
    """Schema version 9: a claim writes one index entry for the running jobs (besides the
    primary key's), and that index serves both the rescuer's look for expired leases and a
    concurrency-limited queue's count of its running jobs, with history in the table; the
    limited claim finds the rows it takes by primary key, never reading the whole table."""
    t = _task(app)
    app.enqueue_many([t.job() for _ in range(5000)])
    claim(app, limit=50)
    query(app.dsn, "UPDATE {schema}.jobs SET state = 'succeeded', finished_at = now() "
                   "WHERE state = 'available' AND id % 2 = 0", schema=app.schema)
    query(app.dsn, "ANALYZE {schema}.jobs", schema=app.schema)
    running = query(app.dsn, "SELECT indexname FROM pg_indexes WHERE schemaname = %s "
                             "AND tablename = 'jobs' AND indexdef LIKE '%%''running''%%'",
                    [app.schema])
    assert running == [("jobs_running_idx",)]
    ((options,),) = query(app.dsn, "SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
                          [f"{app.schema}.jobs"])
    assert "fillfactor=50" in options
    with app.connect() as conn:
        for statement, params in ((app.queries.RESCUE_CANDIDATES, {"limit": 100}),
                                  (app.queries.CLAIM_LIMITED, claim_params())):
            plan = "\n".join(r[0] for r in conn.execute(b"EXPLAIN " + statement,
                                                         params).fetchall())
            assert "jobs_running_idx" in plan and "Seq Scan on jobs" not in plan, plan


def test_a_rate_window_opens_at_the_first_claim_that_takes_a_job(app: App) -> None:
    """A rate-limited queue's claims that find no job leave its window unopened (and its
    row's version as it was); the first one that takes a job opens it and counts that job;
    the claims the window's limit holds back take nothing and count nothing."""
    t = _task(app)
    app.set_queue_limits("q", rate=2, period=3600)

    def limited_claim() -> int:
        with app.connect() as conn:
            conn.execute(app.queries.LOCK_QUEUE, {"queue": "q"})
            return len(conn.execute(app.queries.CLAIM_LIMITED, claim_params()).fetchall())

    def window() -> list[tuple[Any, ...]]:
        return query(app.dsn, "SELECT window_start IS NOT NULL, window_count, xmin::text "
                              "FROM {schema}.queues WHERE name = 'q'", schema=app.schema)

    (before,) = window()
    assert before[:2] == (False, 0)
    assert limited_claim() == 0
    assert window() == [before]  # the same row version: not updated
    app.enqueue_many([t.job() for _ in range(3)])
    assert limited_claim() == 2
    assert window()[0][:2] == (True, 2)
    assert limited_claim() == 0
    assert window()[0][:2] == (True, 2)


def test_a_claim_planned_on_a_small_table_is_planned_again_once_the_table_has_grown(
        app: App) -> None:
    """A claim run again and again on one connection while the jobs table is small keeps
    the generic plan made for that size; once 300,000 more jobs have run (no ANALYZE:
    autovacuum is kept off the table here) the analysis after growth analyses the table, and
    the next claim on that connection looks its rows up by primary key instead of reading
    the whole table. The plans are read from the server's auto_explain module."""
    t = _task(app)
    query(app.dsn, "ALTER TABLE {schema}.jobs SET (autovacuum_enabled = false)",
          schema=app.schema)
    analysis = GrowthAnalysis(app.queries, app.schema)
    plans: list[str] = []
    with app.connect() as conn, app.connect() as maintenance:
        conn.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
        conn.execute("LOAD 'auto_explain'")
        for setting, value in (("log_min_duration", "0"), ("log_level", "notice"),
                               ("log_nested_statements", "off")):
            conn.execute(f"SET auto_explain.{setting} = {value}")

        def claim_one() -> str:
            app.enqueue(t.job())
            plans.clear()
            rows = conn.execute(app.queries.CLAIM, claim_params()).fetchall()
            assert len(rows) == 1
            query(app.dsn, "UPDATE {schema}.jobs SET state = 'succeeded', finished_at = now() "
                           "WHERE id = %s", [rows[0][0]], schema=app.schema)
            (plan,) = (p for p in plans if "Update on jobs" in p)
            return plan

        for _ in range(12):  # prepared by psycopg after 5, a generic plan after 5 more
            claim_one()
        assert analysis(maintenance) is False  # still small: nothing to do
        query(app.dsn, "INSERT INTO {schema}.jobs (queue, task, state, finished_at) "
                       "SELECT 'q', 't', 'succeeded', now() FROM generate_series(1, 300000)",
              schema=app.schema)
        assert analysis(maintenance) is True
        assert analysis(maintenance) is False  # analysed: not again until it grows again
        plan = claim_one()
    assert "jobs_pkey" in plan and "Seq Scan on jobs j" not in plan, plan


@pytest.mark.parametrize("held", [
    "LOCK TABLE {schema}.jobs IN SHARE UPDATE EXCLUSIVE MODE",  # as a VACUUM running
    "ALTER INDEX {schema}.jobs_pkey SET (fillfactor = 80)",  # DDL on one of its indexes
])
def test_the_analysis_after_growth_skips_its_turn_while_another_session_holds_a_lock(
        app: App, held: str) -> None:
    """While another session's open transaction holds a lock that ANALYZE would wait for,
    on the jobs table or on one of its indexes, the analysis after growth does not queue
    behind it (the maintenance thread's other duties would wait too): it returns without
    analysing, the other transaction goes on, and once nothing is held on the table a later
    turn analyses it. (An ANALYZE stopped at an index's lock has already written the
    table's page count, which PostgreSQL does outside the transaction.)"""
    query(app.dsn, "ALTER TABLE {schema}.jobs SET (autovacuum_enabled = false)",
          schema=app.schema)
    query(app.dsn, "INSERT INTO {schema}.jobs (queue, task, state, finished_at) "
                   "SELECT 'q', 't', 'succeeded', now() FROM generate_series(1, 20000)",
          schema=app.schema)
    pages = "SELECT relpages FROM pg_class WHERE oid = %s::regclass"
    with app.connect() as holder, app.connect() as conn:
        with holder.transaction() as held_open:
            holder.execute(sql.SQL(held).format(schema=sql.Identifier(app.schema)))
            assert GrowthAnalysis(app.queries, app.schema)(conn) is False
            assert holder.execute("SELECT 1").fetchall() == [(1,)]  # not a deadlock victim
            raise psycopg.Rollback(held_open)
        if held.startswith("LOCK TABLE"):
            assert query(app.dsn, pages, [f"{app.schema}.jobs"]) == [(0,)]
            assert GrowthAnalysis(app.queries, app.schema)(conn) is True
            assert query(app.dsn, pages, [f"{app.schema}.jobs"]) != [(0,)]


def test_a_large_claim_from_an_analysed_table_reads_the_claimed_rows_only(app: App) -> None:
    """A claim of 500 from 10,000 analysed jobs, as a prepared (generic) plan: its LIMIT is
    unknown to the planner, which read the whole table into a hash join when the claim
    joined its candidates directly; through the array of their ids it looks each up by
    primary key. The rows, put in the claim's order, come highest priority first."""
    t = _task(app)
    app.enqueue_many([t.configure(priority=i % 3).job() for i in range(10_000)])
    query(app.dsn, "ANALYZE {schema}.jobs", schema=app.schema)
    with app.connect() as conn, conn.transaction():
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        plan = "\n".join(r[0] for r in conn.execute(
            b"EXPLAIN " + app.queries.CLAIM, claim_params(limit=500)).fetchall())
        rows = queries.in_claim_order(
            conn.execute(app.queries.CLAIM, claim_params(limit=500)).fetchall())
    assert "Seq Scan on jobs" not in plan and "jobs_pkey" in plan, plan
    assert len(rows) == 500
    assert {r[4] for r in rows} == {2}  # priority 2: a third of the jobs, all before the rest
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)  # then oldest (lowest id) first


def test_claim_plan_uses_the_partial_index(app: App) -> None:
    t = _task(app)
    app.enqueue_many([t.job() for _ in range(2000)])
    query(app.dsn, "ANALYZE {schema}.jobs", schema=app.schema)
    with app.connect() as conn:
        conn.execute("SET enable_seqscan = off")  # fails loudly if no index can serve it
        plan = "\n".join(r[0] for r in conn.execute(
            b"EXPLAIN " + app.queries.CLAIM,
            claim_params(inline_bytes=1)
        ).fetchall())
    assert "jobs_claim_idx" in plan and "Seq Scan" not in plan


def test_batches_of_outcomes_and_heartbeats_on_a_growing_table_look_rows_up_by_key(
        app: App) -> None:
    """A batch of PLANNED_OUTCOMES outcomes, and a heartbeat, sent again and again on
    one connection while a new jobs table grows and before it is first analysed (autovacuum
    kept off it here): each is planned for the table of the moment, so once the table is
    large each row is looked up by primary key. A plan kept from the first, tiny table read
    the index of the running jobs instead, where every job that has run since leaves an
    entry until a vacuum. The plans are read from the server's auto_explain module."""
    t = _task(app)
    query(app.dsn, "ALTER TABLE {schema}.jobs SET (autovacuum_enabled = false)",
          schema=app.schema)
    q = app.queries
    batch_size = PLANNED_OUTCOMES
    plans: list[str] = []
    with app.connect() as conn:
        conn.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
        conn.execute("LOAD 'auto_explain'")
        for setting, value in (("log_min_duration", "0"), ("log_level", "notice"),
                               ("log_nested_statements", "off")):
            conn.execute(f"SET auto_explain.{setting} = {value}")

        def one_batch() -> tuple[str, str]:
            app.enqueue_many([t.job() for _ in range(batch_size)])
            rows = claim(app, limit=batch_size)
            assert len(rows) == batch_size
            plans.clear()
            beat = conn.execute(q.HEARTBEAT, {
                "id": [r[0] for r in rows], "lease_version": [int(r[7]) for r in rows],
                "lease": [r[12] for r in rows]}, prepare=PREPARE_HEARTBEAT).fetchall()
            assert len(beat) == batch_size
            batch = [Outcome(r[0], int(r[7]), "", "complete") for r in rows]
            written = conn.execute(q.record_outcomes(batch_size), outcome_params(batch),
                                   prepare=q.prepare_outcomes(batch_size)).fetchall()
            assert len(written) == batch_size
            heartbeat_plan, outcomes_plan = (p for p in plans if "Update on jobs" in p)
            return heartbeat_plan, outcomes_plan

        for _ in range(12):  # prepared by psycopg after 5, a generic plan after 5 more
            one_batch()
        for _ in range(3):  # 300,000 jobs run and finished, their entries left in the index
            query(app.dsn, "INSERT INTO {schema}.jobs (queue, task, state) "
                           "SELECT 'q', 't', 'running' FROM generate_series(1, 100000)",
                  schema=app.schema)
            query(app.dsn, "UPDATE {schema}.jobs SET state = 'succeeded', finished_at = now() "
                           "WHERE state = 'running'", schema=app.schema)
        for plan in one_batch():
            assert "jobs_pkey" in plan and "jobs_running_idx" not in plan, plan


def test_no_claim_takes_an_overdue_claim_mode_job_before_its_attempt_is_counted(
        app: App) -> None:
    """A claim-mode job's claim is undone while a session waits for the job's claim lock (as
    the worker does before it ends an overdue claim's session): that session is handed the
    lock with the rollback, so a claim-mode claim made before it has counted the attempt
    passes over the job (before, it took the job, whose run then had the same attempt
    number), and the attempt is counted."""

    @app.task(name="held", queue="q", transaction="claim")
    def held() -> None:
        pass

    job_id = held.enqueue()
    key = queries.claim_lock_key(app.schema)
    params = claim_params(limit=1, claim_mode_tasks=["held"], claim_mode=True, claim_lock=key)
    with app.connect() as claimer, app.connect() as waiter, app.connect() as other:
        with claimer.transaction():
            assert [r[0] for r in claimer.execute(app.queries.CLAIM_IN_TRANSACTION,
                                                  params)] == [job_id]
            waiter.execute("BEGIN")
            taking = threading.Thread(target=waiter.execute, args=(
                app.queries.TAKE_CLAIM_LOCK, {"claim_lock": key, "id": job_id}))
            taking.start()
            wait_until(lambda: other.execute(app.queries.CLAIM_LOCK_AWAITED, {
                "waiter": waiter.info.backend_pid}).fetchone() == (1,),
                what="the waiting session queued for the claim lock")
            raise psycopg.Rollback()  # the claim undone, as when its session is ended
        taking.join(10)
        assert not taking.is_alive()
        with other.transaction():
            assert other.execute(app.queries.CLAIM_IN_TRANSACTION, params).fetchall() == []
        counted = waiter.execute(app.queries.COUNT_UNDONE_ATTEMPT, {
            "id": job_id, "attempt": 1, "delay": 0.0, "error": json.dumps({"error": "x"})})
        assert [r[1] for r in counted] == ["scheduled"]
        waiter.execute("COMMIT")
    job = row(app, job_id)
    assert (job["state"], job["attempt"], len(job["errors"])) == ("scheduled", 1, 1)


def test_a_claim_mode_job_s_lease_is_its_own_else_its_task_s_else_the_worker_s(
        app: App) -> None:
    """The lease a claim-mode claim gives each job (its handler's time limit, the claim's
    lease_expires_at, and its transaction's timeouts): the job's own, even one equal to the
    worker's (before, such a lease yielded to the task's: the worker could not tell it from
    none); its task's for a job with none of its own (enqueued without the task's options);
    the worker's when the task has none either."""

    @app.task(name="short", queue="q", transaction="claim", lease=4.0)
    def short() -> None:
        pass

    @app.task(name="plain", queue="q", transaction="claim")
    def plain() -> None:
        pass

    own = short.configure(lease=30.0).enqueue()  # equal to the worker's lease
    none = short.enqueue()
    query(app.dsn, "UPDATE {schema}.jobs SET lease_seconds = NULL WHERE id = %s", [none],
          schema=app.schema)
    worker_s = plain.enqueue()
    leases: dict[int, tuple[float, float, str, str]] = {}
    with app.connect() as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()
        for _ in range(3):
            with conn.transaction():
                (job_id, lease, claim_pid), = [(r[0], r[12], r[14]) for r in conn.execute(
                    app.queries.CLAIM_IN_TRANSACTION, queries.claim_params(
                        "q", 1, lease=30.0, worker="w", claim_mode_tasks=["short", "plain"],
                        claim_mode_leases=[4.0, None], claim_mode=True, skip=list(leases),
                        claim_lock=queries.claim_lock_key(app.schema), timeout_margin=5.0,
                        server_statement_ms=20_000))]
                assert (claim_pid,) == pid
                expires_in, = conn.execute(sql.SQL(
                    "SELECT extract(epoch FROM lease_expires_at - attempted_at)::float8 "
                    "FROM {}.jobs WHERE id = %s").format(sql.Identifier(app.schema)),
                    [job_id]).fetchone() or ()
                idle, statement = conn.execute(
                    "SELECT current_setting('idle_in_transaction_session_timeout'), "
                    "current_setting('statement_timeout')").fetchone() or ()
                leases[job_id] = (lease, round(expires_in, 3), idle, statement)
                raise psycopg.Rollback()
    # the transaction's timeouts: the lease plus the margin, the statement timeout never
    # above the server's own (20 s here)
    assert leases == {own: (30.0, 30.0, "35s", "20s"), none: (4.0, 4.0, "9s", "9s"),
                      worker_s: (30.0, 30.0, "35s", "20s")}
