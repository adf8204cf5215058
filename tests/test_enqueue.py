"""Enqueue: transactions, bulk, idempotency keys, wakeup notifications."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
import pytest
from psycopg.pq import TransactionStatus

import skipjack.enqueue
from skipjack import App, ValidationError
from skipjack.channels import channel_name, due_channel_name

from support import query, wait_until


def _task(app: App, queue: str = "q") -> Any:
    @app.task(name="t", queue=queue)
    def t(**kwargs: Any) -> None:
        pass

    return t


def _ids(app: App) -> list[int]:
    return [r[0] for r in query(app.dsn, "SELECT id FROM {schema}.jobs ORDER BY id",
                                schema=app.schema)]


class CountingCursor(psycopg.Cursor[Any]):
    executed = 0

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        CountingCursor.executed += 1
        return super().execute(*args, **kwargs)


def test_fc10_rollback_leaves_no_job(app: App) -> None:
    t = _task(app)
    with psycopg.connect(app.dsn) as conn:
        conn.execute("SELECT 1")
        job_id = app.enqueue(t.job(order=1), conn=conn)
        assert job_id > 0
        conn.rollback()
    assert _ids(app) == []


def test_fc10_savepoint_rollback_removes_only_the_job(app: App) -> None:
    t = _task(app)
    query(app.dsn, "CREATE TABLE {schema}.orders (id int)", schema=app.schema)
    with psycopg.connect(app.dsn) as conn:
        conn.execute(psycopg.sql.SQL("INSERT INTO {}.orders VALUES (2)").format(
            psycopg.sql.Identifier(app.schema)))
        with conn.transaction():  # a savepoint inside the open transaction
            app.enqueue(t.job(order=2), conn=conn)
            raise psycopg.Rollback()  # ROLLBACK TO SAVEPOINT
        conn.commit()
    assert _ids(app) == []
    assert query(app.dsn, "SELECT id FROM {schema}.orders", schema=app.schema) == [(2,)]


def test_fc10_job_invisible_until_commit(app: App) -> None:
    t = _task(app)
    with psycopg.connect(app.dsn) as conn:
        app.enqueue(t.job(order=3), conn=conn)
        assert _ids(app) == []  # another session sees nothing yet
        conn.commit()
    assert len(_ids(app)) == 1


def test_fc10_own_connection_commits_at_once(app: App) -> None:
    """Without conn=, enqueue is independent of any caller transaction (documented)."""
    t = _task(app)
    with psycopg.connect(app.dsn) as conn:
        conn.execute("SELECT 1")  # a caller transaction is open...
        job_id = t.enqueue(order=4)
        assert _ids(app) == [job_id]  # ...and the job is visible at once
        conn.rollback()
    assert _ids(app) == [job_id]


def test_async_enqueue_on_callers_transaction(app: App) -> None:
    t = _task(app)

    async def main() -> tuple[int, int]:
        async with await psycopg.AsyncConnection.connect(app.dsn) as conn:
            first = await app.enqueue_async(t.job(n=1), conn=conn)
            await conn.rollback()
            ids = await app.enqueue_many_async([t.job(n=2), t.job(n=3)], conn=conn)
            await conn.commit()
        own = await t.enqueue_async(n=4)
        await app.close_async()
        return first, len(ids) + (own > 0)

    first, n = asyncio.run(main())
    assert first > 0 and n == 3
    assert len(_ids(app)) == 3


def test_bulk_enqueue_10000_in_ten_statements(app: App) -> None:
    t = _task(app)
    specs = [t.job(n=i) for i in range(10_000)]
    CountingCursor.executed = 0
    with psycopg.connect(app.dsn, cursor_factory=CountingCursor, autocommit=True) as conn:
        ids = app.enqueue_many(specs, conn=conn)
    assert CountingCursor.executed == 10  # CHUNK_JOBS = 1,000 a statement
    assert len(ids) == len(set(ids)) == 10_000 and ids == sorted(ids)
    rows = query(app.dsn, "SELECT id, (args->>'n')::int FROM {schema}.jobs", schema=app.schema)
    assert {job_id: n for job_id, n in rows} == {job_id: n for n, job_id in enumerate(ids)}


def test_bulk_enqueue_cuts_statements_by_size_too(app: App, monkeypatch: Any) -> None:
    monkeypatch.setattr(skipjack.enqueue, "CHUNK_MAX_CHARS", 1_000)
    t = _task(app)
    specs = [t.job(s="x" * 400) for _ in range(5)] + [t.job(s="y" * 5_000), t.job(n=1)]
    CountingCursor.executed = 0
    with psycopg.connect(app.dsn, cursor_factory=CountingCursor, autocommit=True) as conn:
        ids = app.enqueue_many(specs, conn=conn)
    assert CountingCursor.executed == 5  # 2 + 2 + 1 of 400, the large one alone, the last
    rows = dict(query(app.dsn, "SELECT id, args->>'s' FROM {schema}.jobs", schema=app.schema))
    assert [rows[i] for i in ids] == ["x" * 400] * 5 + ["y" * 5_000, None]


def test_bulk_enqueue_from_a_generator_keeps_order_and_keys_across_statements(app: App) -> None:
    t = _task(app)
    held = t.configure(idempotency_key="held").enqueue(n=-1)
    keys = {10: "a", 1_500: "a", 2_400: "held"}  # "a" in two statements; "held" exists

    def specs() -> Iterator[Any]:
        for i in range(2_500):
            yield (t.configure(idempotency_key=keys[i]) if i in keys else t).job(n=i)

    ids = app.enqueue_many(specs())
    assert len(ids) == 2_500 and ids[1_500] == ids[10] and ids[2_400] == held
    rows = dict(query(app.dsn, "SELECT id, (args->>'n')::int FROM {schema}.jobs",
                      schema=app.schema))
    assert len(rows) == 2_499  # 2,498 new and the held one
    assert all(rows[job_id] == n for n, job_id in enumerate(ids) if n not in (1_500, 2_400))
    unkeyed = [job_id for n, job_id in enumerate(ids) if n not in keys]
    assert unkeyed == sorted(unkeyed)


def _then(t: Any, n: int, last: Any) -> Iterator[Any]:
    """n good specs, then ``last``: an item, or a callable that raises."""
    for i in range(n):
        yield t.job(n=i)
    yield last() if callable(last) else last


def test_bulk_enqueue_that_fails_after_its_first_statement_writes_nothing(app: App) -> None:
    t = _task(app)
    kept = t.enqueue(keep=1)
    with pytest.raises(ValidationError, match=r"jobs\[1500\]"):
        app.enqueue_many(_then(t, 1_500, {"n": 0}))
    with pytest.raises(ValidationError, match="NaN"):
        app.enqueue_many(_then(t, 2_500, lambda: t.job(n=math.nan)))
    query(app.dsn, "ALTER TABLE {schema}.jobs ADD CONSTRAINT low CHECK (priority < 50)",
          schema=app.schema)
    with pytest.raises(psycopg.errors.CheckViolation):  # the database refuses statement 2
        app.enqueue_many(_then(t, 1_500, t.configure(priority=60).job()))
    assert _ids(app) == [kept]
    assert len(app.enqueue_many(t.job(n=i) for i in range(1_500))) == 1_500  # pool still fine


def test_bulk_enqueue_of_several_statements_joins_the_callers_transaction(app: App) -> None:
    t = _task(app)
    with psycopg.connect(app.dsn) as conn:  # not autocommit, no transaction open yet
        app.enqueue_many((t.job(n=i) for i in range(1_500)), conn=conn)
        assert conn.info.transaction_status == TransactionStatus.INTRANS
        assert _ids(app) == []
        conn.rollback()
    assert _ids(app) == []
    with psycopg.connect(app.dsn) as conn:
        kept = app.enqueue(t.job(n=-1), conn=conn)
        with pytest.raises(ValidationError):
            app.enqueue_many(_then(t, 1_500, {"n": 0}), conn=conn)
        conn.commit()  # the caller's transaction is intact: only this call's jobs are gone
    assert _ids(app) == [kept]
    with psycopg.connect(app.dsn, autocommit=True) as conn:
        ids = app.enqueue_many((t.job(n=i) for i in range(1_500)), conn=conn)
        assert conn.info.transaction_status == TransactionStatus.IDLE
    assert _ids(app) == [kept, *ids]


def test_bulk_enqueue_reads_an_iterable_over_the_callers_connection_before_writing(
        app: App) -> None:
    t = _task(app)
    with psycopg.connect(app.dsn) as conn:
        streamed = conn.cursor().stream("SELECT g FROM generate_series(1, 2500) AS g")
        ids = app.enqueue_many((t.job(n=n) for (n,) in streamed), conn=conn)
        named = conn.cursor("source")  # fetches 100 rows at a time from the server
        named.execute("SELECT g FROM generate_series(1, 2500) AS g")
        ids += app.enqueue_many((t.job(n=n) for (n,) in named), conn=conn)
        conn.commit()
    assert _ids(app) == ids and len(ids) == 5_000


def test_bulk_enqueue_refused_in_the_callers_transaction_fails_it_whatever_its_size(
        app: App) -> None:
    t = _task(app)
    query(app.dsn, "ALTER TABLE {schema}.jobs ADD CONSTRAINT low CHECK (priority < 50)",
          schema=app.schema)
    for n in (999, 1_500):
        with psycopg.connect(app.dsn) as conn:
            app.enqueue(t.job(n=-1), conn=conn)
            with pytest.raises(psycopg.errors.CheckViolation):
                app.enqueue_many(_then(t, n, t.configure(priority=60).job()), conn=conn)
            assert conn.info.transaction_status == TransactionStatus.INERROR
            conn.rollback()
    assert _ids(app) == []


def test_async_bulk_enqueue_of_several_statements(app: App) -> None:
    t = _task(app)

    async def main() -> tuple[list[int], list[int]]:
        async with await psycopg.AsyncConnection.connect(app.dsn) as conn:
            ids = await app.enqueue_many_async((t.job(n=i) for i in range(2_500)), conn=conn)
            assert _ids(app) == []
            await conn.commit()
        with pytest.raises(ValidationError):
            await app.enqueue_many_async(_then(t, 1_500, {"n": 0}))
        own = await app.enqueue_many_async(t.job(n=i) for i in range(1_200))
        await app.close_async()
        return ids, own

    ids, own = asyncio.run(main())
    assert ids == sorted(ids) and _ids(app) == [*ids, *own]


def test_idempotency_key_returns_existing_job(app: App) -> None:
    t = _task(app)
    first = t.configure(idempotency_key="order-1").enqueue(n=1)
    again = t.configure(idempotency_key="order-1").enqueue(n=2)
    mixed = app.enqueue_many([t.job(n=3), t.configure(idempotency_key="order-1").job(n=4),
                              t.configure(idempotency_key="order-2").job(n=5)])
    assert again == first == mixed[1]
    assert len(set(mixed)) == 3
    assert len(_ids(app)) == 3


def test_delay_and_run_at_use_database_clock(app: App) -> None:
    t = _task(app)
    later = t.configure(delay=3600).enqueue()
    at = datetime(2030, 1, 1, 12, tzinfo=UTC)
    fixed = t.configure(run_at=at).enqueue()
    rows = dict(query(app.dsn, "SELECT id, run_at - created_at FROM {schema}.jobs",
                      schema=app.schema))
    assert timedelta(seconds=3599) < rows[later] <= timedelta(seconds=3601)
    run_at = query(app.dsn, "SELECT run_at FROM {schema}.jobs WHERE id = %s", [fixed],
                   schema=app.schema)[0][0]
    assert run_at == at
    # in a chain of configure calls, the last of run_at and delay given wins
    with pytest.raises(ValidationError, match="run_at: give run_at or delay, not both"):
        t.configure(run_at=at, delay=5)
    assert (t.configure(run_at=at).configure(delay=5).run_at, t.configure(run_at=at)
            .configure(delay=5).delay) == (None, 5.0)
    assert (t.configure(delay=5).configure(run_at=at).run_at, t.configure(delay=5)
            .configure(run_at=at).delay) == (at, None)


class Listener:
    """Records every notification on the schema's channel (or ``channel``)."""

    def __init__(self, app: App, channel: str | None = None) -> None:
        self.conn = psycopg.connect(app.dsn, autocommit=True)
        self.conn.execute(psycopg.sql.SQL("LISTEN {}").format(
            psycopg.sql.Identifier(channel or channel_name(app.schema))))
        self.notes: list[str] = []

    def drain(self, timeout: float = 0.5) -> list[str]:
        for note in self.conn.notifies(timeout=timeout):
            self.notes.append(note.payload)
        return self.notes


def test_fc07_notifications_stay_small(app: App) -> None:
    queue = "q" * 63
    t = _task(app, queue=queue)
    listener = Listener(app)
    for size in (7_900, 8_000, 8_001, 100_000):
        t.enqueue(s="a" * size)
    t.enqueue(s="€" * 2_700)
    app.enqueue_many([t.job(n=i) for i in range(10_000)])
    notes = listener.drain()
    assert len(notes) == 6  # one per enqueueing statement, the bulk one included
    assert all(len(n.encode()) < 8000 and n == queue for n in notes)
    listener.conn.close()


def test_fc09_no_wakeup_before_commit_none_after_rollback(app: App) -> None:
    t = _task(app)
    listener = Listener(app)
    with psycopg.connect(app.dsn) as conn:
        app.enqueue(t.job(), conn=conn)
        app.enqueue(t.job(), conn=conn)
        assert listener.drain(0.2) == []
        conn.commit()
        assert listener.drain(1.0) == ["q"]  # one wakeup per queue per transaction
        app.enqueue(t.job(), conn=conn)
        conn.rollback()
    assert listener.drain(0.3) == ["q"]
    listener.conn.close()


def test_a_bulk_enqueue_wakes_each_queue_once_and_says_when_its_soonest_delayed_job_is_due(
        app: App) -> None:
    t = _task(app)
    queues, due = Listener(app), Listener(app, due_channel_name(app.schema))
    now = datetime.now(UTC)
    soonest = now + timedelta(seconds=30)
    ids = app.enqueue_many([
        *(t.configure(queue=q).job(n=i) for q in ("a", "b", "a") for i in range(3)),
        t.configure(run_at=now + timedelta(seconds=90)).job(),
        t.configure(run_at=soonest).job(),
        t.configure(queue="c", delay=60).job(),
    ])
    assert len(ids) == 12
    assert sorted(queues.drain()) == ["a", "b"]  # none for the delayed jobs' queues
    (note,) = due.drain()
    assert abs(float(note) - soonest.timestamp()) < 0.001
    # a job whose idempotency key is held is not inserted, and wakes no one
    keyed = t.configure(idempotency_key="k")
    first = keyed.enqueue()
    assert queues.drain()[2:] == ["q"]
    assert keyed.enqueue() == first
    assert app.enqueue_many([keyed.job(), keyed.configure(queue="d").job()]) == [first] * 2
    assert queues.drain(0.3)[2:] == ["q"]
    assert due.drain(0.1) == [note]
    queues.conn.close()
    due.conn.close()


def test_future_job_sends_no_wakeup(app: App) -> None:
    t = _task(app)
    listener = Listener(app)
    t.configure(delay=60).enqueue()
    assert listener.drain(0.3) == []
    listener.conn.close()


def test_concurrent_idempotent_enqueue_gives_one_job(app: App) -> None:
    t = _task(app)
    results: list[int] = []
    barrier = threading.Barrier(5)

    def enqueue() -> None:
        barrier.wait()
        results.append(t.configure(idempotency_key="same").enqueue())

    threads = [threading.Thread(target=enqueue) for _ in range(5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wait_until(lambda: len(results) == 5, what="all enqueues")
    assert len(set(results)) == 1
    assert len(_ids(app)) == 1


def test_bulk_enqueue_of_jobs_sharing_their_options(app: App) -> None:
    """Options every job of a batch shares are bound once for all; each job must still get
    them, whichever options are shared and whichever differ."""
    t = _task(app)
    at = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
    later = t.configure(queue="other", priority=3, max_attempts=4, lease=7.5, delay=60,
                        unique_while=("scheduled", "available", "running"))
    planned = t.configure(run_at=at, priority=-2)
    batches = {
        "delayed": [later.job(i=i) for i in range(4)],
        "planned": [planned.job(i=i) for i in range(3)],
        "mixed": [later.job(i=0), planned.job(i=1), t.job(i=2)],
    }
    ids = {name: app.enqueue_many(specs) for name, specs in batches.items()}
    rows = {r[0]: r[1:] for r in query(
        app.dsn, "SELECT id, queue, task, args, priority, max_attempts, lease_seconds, "
        "unique_states, state, run_at, round(extract(epoch FROM run_at - created_at)) "
        "FROM {schema}.jobs", schema=app.schema)}
    delayed = ("other", "t", 3, 4, 7.5, 7, "scheduled")
    planned_row = ("q", "t", -2, 25, None, 63, "scheduled")
    plain = ("q", "t", 0, 25, None, 63, "available")
    for i, job_id in enumerate(ids["delayed"]):
        queue, task, args, prio, attempts, lease, mask, state, _, wait = rows[job_id]
        assert (queue, task, prio, attempts, lease, mask, state) == delayed
        assert args == {"i": i} and wait == 60
    for i, job_id in enumerate(ids["planned"]):
        queue, task, args, prio, attempts, lease, mask, state, run_at, _ = rows[job_id]
        assert (queue, task, prio, attempts, lease, mask, state) == planned_row
        assert args == {"i": i} and run_at == at
    for job_id, expected in zip(ids["mixed"], (delayed, planned_row, plain), strict=True):
        assert rows[job_id][:2] + rows[job_id][3:8] == expected


def test_bulk_enqueue_keeps_both_times_of_an_hour_the_clocks_repeat(app: App) -> None:
    """02:30 happens twice in Berlin on 2030-10-27 (fold 0 and 1): Python calls the two
    datetimes equal, but they are an hour apart, and each job must keep its own."""
    berlin = ZoneInfo("Europe/Berlin")
    first = datetime(2030, 10, 27, 2, 30, tzinfo=berlin, fold=0)
    second = datetime(2030, 10, 27, 2, 30, tzinfo=berlin, fold=1)
    assert first == second and first.utcoffset() != second.utcoffset()
    t = _task(app)
    for times in ([first, second], [second, first]):
        ids = app.enqueue_many([t.configure(run_at=at).job() for at in times])
        stored = dict(query(app.dsn, "SELECT id, run_at FROM {schema}.jobs WHERE id = ANY(%s)",
                            [ids], schema=app.schema))
        assert [stored[i] for i in ids] == [at.astimezone(UTC) for at in times]


def test_bulk_enqueue_takes_an_offset_postgresql_cannot_read(app: App) -> None:
    """Python allows a UTC offset with seconds and microseconds; PostgreSQL reads none of
    that in text: the bulk enqueue stores the same instant as the one-job enqueue."""
    odd = datetime(2030, 1, 1, tzinfo=timezone(timedelta(hours=5, seconds=7,
                                                         microseconds=5)))
    t = _task(app)
    one = t.configure(run_at=odd).enqueue()
    many = app.enqueue_many([t.configure(run_at=odd).job(), t.job()])
    stored = dict(query(app.dsn, "SELECT id, run_at FROM {schema}.jobs WHERE id = ANY(%s)",
                        [[one, many[0]]], schema=app.schema))
    assert stored[one] == stored[many[0]] == odd


def test_args_bytes_is_the_size_of_the_json_sent(app: App) -> None:
    """jsonb re-prints what it stores ({"a":"x"} comes back as {"a": "x"}); args_bytes is the
    size of the text skipjack sent, for one job and for many."""
    t = _task(app)
    specs = [t.job(a="x", b=[1, 2], c={"d": None}), t.job(e="é")]
    ids = [app.enqueue(specs[0]), *app.enqueue_many(specs)]
    stored = dict(query(app.dsn, "SELECT id, args_bytes FROM {schema}.jobs",
                        schema=app.schema))
    sizes = [len(s.args_json.encode()) for s in specs]
    assert [stored[i] for i in ids] == [sizes[0], *sizes]


@pytest.mark.parametrize("text", ['{"a": "x", "b": [1, 2.5, null, true], "c": {"d": {}}}',
                                  '"é 😀 \\" \\\\ \\n"', "12345678901234567890123", "-0.5e-7",
                                  "null", "[]", '  {"spaced" : [ 1 ,2 ] }  '])
def test_json_and_jsonb_values_read_back_as_python_values(app: App, text: str) -> None:
    """A skipjack connection reads jsonb (which PostgreSQL writes out again itself) and json
    (kept as it was written, whitespace and all) as the same Python values json.loads
    gives for the text."""
    with app.db.connect() as conn:
        jsonb, plain = conn.execute("SELECT %s::jsonb, %s::json", [text, text]).fetchone()
    assert jsonb == plain == json.loads(text)

def test_bulk_enqueue_stores_every_value_exactly(app: App) -> None:
    """Bulk enqueue binds each column as one array literal: quotes, backslashes, braces,
    commas, the word NULL and non-ASCII text must all arrive unchanged, None as NULL."""
    t = _task(app)
    tricky = ['"', "\\", "\\\"", "{}", "a,b", "NULL", " ", "é 😀", "", "{\"x\": [1]}"]
    at = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
    specs = [t.configure(priority=i, max_attempts=i + 1, idempotency_key=f"k{s}",
                         lease=1.5 + i, run_at=at if i % 2 else None,
                         delay=None if i % 2 else 0.25 * i).job(s=s, n=[s, None, i])
             for i, s in enumerate(tricky)]
    specs.append(t.job(plain=True))  # no key, priority, lease or time: the defaults
    ids = app.enqueue_many(specs)
    # the same tricky values in a batch without keys or times (no ON CONFLICT clause)
    plain = [t.configure(priority=i % 7, lease=2.5).job(s=tricky[i % len(tricky)], i=i)
             for i in range(150)]
    copied = app.enqueue_many(plain)
    assert copied == sorted(copied) and copied[0] > ids[-1]
    stored = dict(query(app.dsn, "SELECT id, jsonb_build_array(args, priority, "
                        "lease_seconds, state, args_bytes, run_at = created_at) "
                        "FROM {schema}.jobs WHERE id >= %s", [copied[0]], schema=app.schema))
    for i, job_id in enumerate(copied):
        text = plain[i].args_json
        assert stored[job_id] == [{"s": tricky[i % len(tricky)], "i": i}, i % 7, 2.5,
                                  "available", len(text.encode()), True]
    rows = query(app.dsn, "SELECT id, args, priority, max_attempts, idempotency_key, "
                 "lease_seconds, run_at, state, run_at - created_at FROM {schema}.jobs",
                 schema=app.schema)
    by_id = {r[0]: r[1:] for r in rows}
    for i, (s, job_id) in enumerate(zip(tricky, ids, strict=False)):
        args, priority, attempts, key, lease, run_at, state, wait = by_id[job_id]
        assert args == {"s": s, "n": [s, None, i]}
        assert (priority, attempts, key, lease) == (i, i + 1, f"k{s}", 1.5 + i)
        if i % 2:
            assert run_at == at and state == "scheduled"
        else:
            assert wait == timedelta(seconds=0.25 * i)
    args, priority, attempts, key, lease, _, state, _ = by_id[ids[-1]]
    assert (args, priority, attempts, key, lease, state) == (
        {"plain": True}, 0, 25, None, None, "available")


@pytest.mark.parametrize("conn_given", [False, True], ids=["own_connection", "callers_transaction"])
@pytest.mark.parametrize("chunk", [1000, 100])
def test_fc34_one_bulk_enqueue_with_a_key_twice_and_a_key_held_inserts_the_rest(
        app: App, monkeypatch: pytest.MonkeyPatch, conn_given: bool, chunk: int) -> None:
    """1,000 jobs in one enqueue_many: job 500's key is held by a live job, jobs 10 and 11
    (and 20 and 950, in different statements when a statement takes 100) share a new key.
    Every other job is inserted, both positions of a shared key report its one job, the held
    key reports its holder; nothing fails, and the caller's transaction goes on and commits."""
    monkeypatch.setattr(skipjack.enqueue, "CHUNK_JOBS", chunk)
    t = _task(app)
    held = t.configure(idempotency_key="held").enqueue(n=-1)
    keys = {500: "held", 10: "twice", 11: "twice", 20: "apart", 950: "apart"}
    specs = [t.configure(idempotency_key=keys.get(i)).job(n=i) for i in range(1000)]
    if conn_given:
        query(app.dsn, "CREATE TABLE {schema}.orders (id int)", schema=app.schema)
        with app.connect(autocommit=False) as conn:
            ids = app.enqueue_many(specs, conn=conn)
            assert conn.info.transaction_status == TransactionStatus.INTRANS
            conn.execute(psycopg.sql.SQL("INSERT INTO {}.orders VALUES (1)").format(
                psycopg.sql.Identifier(app.schema)))
            conn.commit()
        assert query(app.dsn, "SELECT id FROM {schema}.orders", schema=app.schema) == [(1,)]
    else:
        ids = app.enqueue_many(specs)
    assert len(ids) == 1000
    assert ids[500] == held
    assert ids[10] == ids[11] and ids[20] == ids[950]
    assert len(set(ids)) == 1000 - 2  # 11 and 950 name the jobs of 10 and 20
    rows = dict(query(app.dsn, "SELECT id, (args->>'n')::int FROM {schema}.jobs",
                      schema=app.schema))
    assert len(rows) == 1 + 997  # the holder, and none for 500, 11 and 950
    assert rows[held] == -1  # the holder is unchanged
    assert [rows[ids[i]] for i in (10, 11, 20, 950)] == [10, 10, 20, 20]  # the first wins
    assert all(rows[ids[i]] == i for i in range(1000) if i not in keys)


def test_fc37_a_finished_job_keeps_its_key_unless_unique_while_says_otherwise(
        app: App) -> None:
    """Default unique_while (every state): enqueueing the key of a discarded, cancelled or
    succeeded job returns that job's id, and the caller reads its state to tell "done" from
    "dead" (and retries a dead one). unique_while limited to the waiting and running states:
    a new job takes the key once the previous one finished."""
    t = _task(app)
    forever = {state: t.configure(idempotency_key=f"forever-{state}") for state in
               ("discarded", "cancelled", "succeeded")}
    first = {state: task.enqueue(n=1) for state, task in forever.items()}
    assert app.discard([first["discarded"]]) == [first["discarded"]]
    assert app.cancel([first["cancelled"]]) == {"cancelled": 1, "requested": 0}
    query(app.dsn, "UPDATE {schema}.jobs SET state = 'succeeded', finished_at = now() "
                   "WHERE id = %s", [first["succeeded"]], schema=app.schema)
    for state, task in forever.items():
        again = task.enqueue(n=2)
        assert again == first[state]
        job = app.get_job(again) or {}
        assert (job["state"], job["args"]) == (state, {"n": 1})  # the caller can tell
    assert app.retry_discarded([first["discarded"]]) == [first["discarded"]]
    assert (app.get_job(first["discarded"]) or {})["state"] == "available"

    limited = t.configure(idempotency_key="limited",
                          unique_while=("scheduled", "available", "running"))
    old = limited.enqueue(n=1)
    assert limited.enqueue(n=2) == old  # waiting: still held
    assert app.discard([old]) == [old]
    new = limited.enqueue(n=3)
    assert new != old
    assert [(app.get_job(i) or {})["state"] for i in (old, new)] == ["discarded", "available"]
    assert limited.enqueue(n=4) == new


def test_every_enqueue_form_can_join_the_caller_s_transaction(app: App) -> None:
    @app.task(name="with_conn_arg")
    def with_conn_arg(conn: str, n: int = 0) -> None:  # an argument named conn
        return None

    task = app.tasks["with_conn_arg"]
    with app.connect(autocommit=False) as conn:
        first = task.enqueue_on(conn, conn="an argument", n=1)
        second = task.configure(priority=5).enqueue_on(conn, conn="another")
        conn.rollback()
    assert app.get_job(first) is None and app.get_job(second) is None
    with app.connect(autocommit=False) as conn:
        kept = task.configure(priority=5).enqueue_on(conn, conn="kept")
    job = app.get_job(kept)
    assert job is not None and job["args"] == {"conn": "kept"} and job["priority"] == 5

    async def run() -> int:
        aconn = await app.connect_async(autocommit=False)
        async with aconn:
            handle = await task.enqueue_on_async(aconn, conn="async")
            await aconn.rollback()
            return int(handle)

    rolled_back = asyncio.run(run())
    assert app.get_job(rolled_back) is None


def test_a_conn_keyword_for_a_task_without_one_points_to_enqueue_on(app: App) -> None:
    @app.task(name="plain")
    def plain(n: int) -> None:
        return None

    with app.connect(autocommit=False) as conn, \
            pytest.raises(ValidationError, match=r"enqueue_on\(conn"):
        app.tasks["plain"].enqueue(n=1, conn=conn)


def test_arguments_given_by_position_are_refused_with_the_keywords_to_use(app: App) -> None:
    @app.task(name="add")
    def add(x: int, y: int) -> int:
        return x + y

    for call in (lambda: add.enqueue(2, 3), lambda: asyncio.run(add.enqueue_async(2, 3))):
        with pytest.raises(ValidationError, match=r"task 'add': arguments are given by keyword "
                                                  r"\(task\.enqueue(_async)?\(x=\.\.\., "
                                                  r"y=\.\.\.\)\), not by position: got 2"):
            call()
    with pytest.raises(ValidationError, match=r"task\.job\(x=\.\.\.\)"):
        add.job(2)
    with psycopg.connect(app.dsn) as conn:
        with pytest.raises(ValidationError, match=r"task\.enqueue_on\(x=\.\.\.\)"):
            add.enqueue_on(conn, 2)
    assert query(app.dsn, "SELECT count(*) FROM {schema}.jobs", schema=app.schema)[0][0] == 0
