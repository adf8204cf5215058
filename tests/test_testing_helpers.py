"""skipjack.testing against a real server: drain, inline, the enqueue assertions, and the
fresh-schema fixture."""

from __future__ import annotations

import asyncio

import pytest

from skipjack import App, current_job
from skipjack.testing import app_fixture, assert_enqueued, drain, enqueued, fresh_schema, inline

from support import Server

calls: list[tuple[str, int]] = []


def make_app(server: Server, schema: str) -> App:
    app = App(server.dsn, schema=schema)

    @app.task(name="double")
    def double(n: int) -> int:
        calls.append(("double", current_job().job.id))
        return 2 * n

    @app.task(name="flaky", max_attempts=2)
    def flaky(n: int) -> None:
        raise ValueError(f"no {n}")

    @app.task(name="async_triple", queue="other")
    async def async_triple(n: int) -> int:
        return 3 * n

    return app


@pytest.fixture
def helpers_app(server: Server, schema: str) -> App:
    app = make_app(server, schema)
    app.migrate()
    yield app  # type: ignore[misc]
    app.close()


def test_drain_runs_what_is_waiting_and_reports_states(helpers_app: App) -> None:
    app = helpers_app
    first = app.tasks["double"].enqueue(n=21)
    app.tasks["async_triple"].enqueue(n=2)
    app.tasks["flaky"].configure(max_attempts=1).enqueue(n=1)
    assert drain(app) == {"succeeded": 2, "discarded": 1}
    assert first.result(timeout=0) == 42
    assert drain(app, ["nothing"]) == {}


def test_assertions_on_what_was_enqueued(helpers_app: App) -> None:
    app = helpers_app
    app.tasks["double"].enqueue(n=1)
    app.tasks["double"].enqueue(n=2)
    assert [j["args"] for j in enqueued(app, "double")] == [{"n": 1}, {"n": 2}]
    assert_enqueued(app, "double", n=2)
    assert_enqueued(app, "double", count=2)
    with pytest.raises(AssertionError, match=r"expected a job of task 'double' with args "
                                             r"\{'n': 3\}, found 0; .*\{'n': 1\}"):
        assert_enqueued(app, "double", n=3)
    with app.connect(autocommit=False) as conn:
        app.enqueue(app.tasks["double"].job(n=9), conn=conn)
        assert_enqueued(app, "double", n=9, conn=conn)  # seen in its own transaction
        with pytest.raises(AssertionError):
            assert_enqueued(app, "double", n=9)  # not by others before the commit
        conn.rollback()


def test_inline_runs_handlers_at_once_without_the_database(helpers_app: App) -> None:
    app = helpers_app
    calls.clear()
    with inline(app) as ran:
        handle = app.tasks["double"].enqueue(n=5)
        assert asyncio.run(app.tasks["async_triple"].enqueue_async(n=5)) < 0
        with pytest.raises(ValueError, match="no 7"):
            app.tasks["flaky"].enqueue(n=7)
    assert [value for _, value in ran] == [10, 15]
    assert calls == [("double", int(handle))] and int(handle) < 0
    assert enqueued(app) == []  # nothing was written
    app.tasks["double"].enqueue(n=1)  # outside the block: written again
    assert len(enqueued(app)) == 1


def test_fresh_schema_is_migrated_then_dropped(server: Server, schema: str) -> None:
    app = make_app(server, schema)
    with fresh_schema(app) as fresh:
        name = fresh.schema
        assert name != schema and name.startswith("test_")
        fresh.tasks["double"].enqueue(n=4)
        assert drain(fresh) == {"succeeded": 1}
    assert app.schema == schema
    with server.connect() as conn:
        assert conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s",
                            (name,)).fetchone() is None


_shared = App(schema="unused")
fresh_app = app_fixture(_shared)


def test_app_fixture_gives_a_fresh_schema(fresh_app: App,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert fresh_app is _shared and fresh_app.schema.startswith("test_")
    assert enqueued(fresh_app) == []


def test_inline_nests_leaves_no_context_and_runs_async_handlers_under_a_loop(
        helpers_app: App) -> None:
    app = helpers_app
    seen: dict[str, int] = {}

    @app.task(name="outer")
    def outer() -> None:
        seen["before"] = current_job().job.id
        app.tasks["double"].enqueue(n=1)  # nested: runs at once too
        seen["after"] = current_job().job.id

    with inline(app):
        app.tasks["outer"].enqueue()

        async def in_a_loop() -> int:
            # a sync enqueue of an async handler, from code that runs an event loop
            return int(app.tasks["async_triple"].enqueue(n=1))

        assert asyncio.run(in_a_loop()) < 0
    assert seen["before"] == seen["after"]
    with pytest.raises(LookupError):
        current_job()


def test_fresh_schema_is_dropped_even_behind_a_transaction_left_open(server: Server,
                                                                      schema: str) -> None:
    app = make_app(server, schema)
    with pytest.warns(UserWarning, match="ended 1 session"), fresh_schema(app) as fresh:
        name = fresh.schema
        left_open = fresh.connect(autocommit=False)
        fresh.enqueue(fresh.tasks["double"].job(n=1), conn=left_open)  # never committed
    with server.connect() as conn:
        assert conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s",
                            (name,)).fetchone() is None
    left_open.close()
