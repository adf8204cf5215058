"""SQLAlchemy 2: enqueue in a Session's or Connection's transaction (sync and async), and ORM
writes of a "complete" handler committed exactly once, against real workers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import (
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from skipjack import App, ValidationError

from support import WorkerProcess, effect_counts, kill_repeatedly, query, states

FAST = ["--lease", "2", "--heartbeat", "0.3", "--rescue-interval", "0.5", "--poll-interval",
        "0.5", "--concurrency", "4"]


@pytest.fixture
def tasks(app: App) -> App:
    app.task(name="orm_effect", transaction="complete")(lambda **kw: None)

    async def stub(**kw: object) -> None:
        return None

    app.task(name="async_orm_effect", transaction="complete")(stub)
    query(app.dsn, "CREATE TABLE {schema}.effect_rows (rowid bigserial PRIMARY KEY, "
                   "job_id bigint NOT NULL, pid int NOT NULL)", schema=app.schema)
    return app


def jobs(app: App) -> int:
    return int(query(app.dsn, "SELECT count(*) FROM {schema}.jobs", schema=app.schema)[0][0])


def test_enqueue_joins_a_session_and_a_connection(tasks: App) -> None:
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(tasks.dsn))
    task = tasks.tasks["orm_effect"]
    with Session(engine) as session:
        tasks.enqueue(task.job(), conn=session)
        assert jobs(tasks) == 0  # not committed yet: another session cannot see it
        session.rollback()
    assert jobs(tasks) == 0
    with Session(engine) as session, session.begin():
        session.execute(text("SELECT 1"))
        with session.begin_nested():
            tasks.enqueue(task.job(), conn=session)
        nested = session.begin_nested()
        tasks.enqueue(task.job(), conn=session)
        nested.rollback()  # a rolled-back savepoint takes its job with it
    assert jobs(tasks) == 1
    with engine.connect() as connection:
        tasks.enqueue_many([task.job(), task.job()], conn=connection)
        connection.rollback()
        handle = tasks.enqueue(task.job(), conn=connection)
        connection.commit()
    assert jobs(tasks) == 2 and handle.state() == "available"
    engine.dispose()


def test_enqueue_joins_an_async_session_and_connection(tasks: App) -> None:
    async def scenario() -> None:
        engine = create_async_engine(
            "postgresql+psycopg://",
            async_creator=lambda: psycopg.AsyncConnection.connect(tasks.dsn))
        task = tasks.tasks["orm_effect"]
        async with AsyncSession(engine) as session:
            await tasks.enqueue_async(task.job(), conn=session)
            await session.rollback()
        assert jobs(tasks) == 0
        async with AsyncSession(engine) as session, session.begin():
            await tasks.enqueue_async(task.job(), conn=session)
        async with engine.connect() as connection:
            await tasks.enqueue_many_async([task.job()], conn=connection)
            await connection.commit()
        await engine.dispose()

    asyncio.run(scenario())
    assert jobs(tasks) == 2


class AppSession(Session):
    """A Session subclass of the application's own (its module is not SQLAlchemy's)."""


def test_enqueue_joins_the_current_session_of_a_scoped_session(tasks: App) -> None:
    # Flask-SQLAlchemy's db.session is a scoped_session: conn=db.session is its current session
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(tasks.dsn))
    task = tasks.tasks["orm_effect"]
    registry = scoped_session(sessionmaker(engine, class_=AppSession))
    tasks.enqueue(task.job(), conn=registry)
    assert jobs(tasks) == 0  # in the current session's open transaction
    registry.rollback()
    assert jobs(tasks) == 0
    handle = tasks.enqueue(task.job(), conn=registry)
    registry.commit()
    assert jobs(tasks) == 1 and handle.state() == "available"
    registry.remove()
    with AppSession(engine) as session:  # a subclass outside SQLAlchemy's modules
        tasks.enqueue(task.job(), conn=session)
        session.commit()
    assert jobs(tasks) == 2
    engine.dispose()


def test_enqueue_async_joins_the_current_session_of_an_async_scoped_session(
        tasks: App) -> None:
    async def scenario() -> None:
        engine = create_async_engine(
            "postgresql+psycopg://",
            async_creator=lambda: psycopg.AsyncConnection.connect(tasks.dsn))
        registry = async_scoped_session(async_sessionmaker(engine),
                                        scopefunc=asyncio.current_task)
        task = tasks.tasks["orm_effect"]
        await tasks.enqueue_async(task.job(), conn=registry)
        assert jobs(tasks) == 0
        await registry.rollback()
        assert jobs(tasks) == 0
        await tasks.enqueue_async(task.job(), conn=registry)
        await registry.commit()
        assert jobs(tasks) == 1
        await registry.remove()
        await engine.dispose()

    asyncio.run(scenario())
    assert jobs(tasks) == 1


def test_a_refusal_suggests_the_other_enqueue_only_for_the_other_kind(tasks: App) -> None:
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(tasks.dsn))
    async_engine = create_async_engine(
        "postgresql+psycopg://", async_creator=lambda: psycopg.AsyncConnection.connect(tasks.dsn))
    job = tasks.tasks["orm_effect"].job()
    with pytest.raises(ValidationError, match="it is async, use the async enqueue"):
        tasks.enqueue(job, conn=AsyncSession(async_engine))
    with pytest.raises(ValidationError, match="it is async, use the async enqueue"):
        tasks.enqueue(job, conn=async_scoped_session(async_sessionmaker(async_engine),
                                                    scopefunc=lambda: None))
    with pytest.raises(ValidationError, match="it is sync, use the sync enqueue"):
        asyncio.run(tasks.enqueue_async(job, conn=scoped_session(sessionmaker(engine))))
    for wrong, hint in [(engine, "an engine is in no transaction; pass a Session or "
                                 "Connection of it"),
                        (sessionmaker(engine), "pass a session it made")]:
        with pytest.raises(ValidationError) as refused:
            tasks.enqueue(job, conn=wrong)
        assert hint in str(refused.value) and "async" not in str(refused.value)
    with pytest.raises(ValidationError, match="pass an AsyncSession or AsyncConnection"):
        asyncio.run(tasks.enqueue_async(job, conn=async_engine))
    with pytest.raises(ValidationError) as refused:
        tasks.enqueue(job, conn=text("SELECT 1"))
    assert str(refused.value).endswith("is not an SQLAlchemy Session, scoped_session or "
                                       "Connection")
    assert jobs(tasks) == 0
    engine.dispose()
    asyncio.run(async_engine.dispose())


def test_the_wrong_kind_of_connection_is_refused_before_anything_is_written(
        tasks: App) -> None:
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(tasks.dsn))
    with Session(engine) as session:
        with pytest.raises(ValidationError, match="conn: .*use the sync enqueue"):
            asyncio.run(tasks.enqueue_async(tasks.tasks["orm_effect"].job(), conn=session))
    with pytest.raises(ValidationError, match="conn: builtins.str is not a connection"):
        tasks.enqueue(tasks.tasks["orm_effect"].job(), conn="postgresql://")
    sqlite = create_engine("sqlite://")
    with Session(sqlite) as session, pytest.raises(ValidationError, match="psycopg 3"):
        tasks.enqueue(tasks.tasks["orm_effect"].job(), conn=session)
    assert jobs(tasks) == 0
    engine.dispose()


@pytest.mark.parametrize("task", ["orm_effect", "async_orm_effect"])
def test_orm_writes_of_a_complete_handler_happen_once_through_kills(tasks: App, tmp_path: Path,
                                                                   task: str) -> None:
    ids = tasks.enqueue_many([tasks.tasks[task].job(seconds=0.2) for _ in range(24)])

    def start(n: int) -> WorkerProcess:
        return WorkerProcess(tasks.dsn, tasks.schema, ["default"], *FAST,
                             app="sqlalchemy_app:app", log=tmp_path / f"w{n}.log")

    kill_repeatedly(tasks.dsn, tasks.schema, ids, start, kills=3)
    assert states(tasks.dsn, tasks.schema) == {"succeeded": len(ids)}
    assert effect_counts(tasks.dsn, tasks.schema) == dict.fromkeys(ids, 1)
    # some attempts were cut by the kills, and their ORM writes rolled back with them
    attempts = query(tasks.dsn, "SELECT sum(attempt) FROM {schema}.jobs", schema=tasks.schema)
    assert attempts[0][0] > len(ids)


def test_the_job_sessions_exist_only_in_complete_handlers() -> None:
    from skipjack.contrib.sqlalchemy import async_session, session

    with pytest.raises(LookupError, match="transaction='complete' handlers"):
        session()
    with pytest.raises(LookupError, match="async transaction='complete' handlers"):
        async_session()
