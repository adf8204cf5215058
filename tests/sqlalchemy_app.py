"""An SQLAlchemy 2 application's tasks (``sqlalchemy_app:app``): ORM writes in the job's
transaction. The schema and DSN come from SKIPJACK_SCHEMA and SKIPJACK_DATABASE_URL."""

from __future__ import annotations

import asyncio
import os
import time

import psycopg
from sqlalchemy import BigInteger, Integer, create_engine
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from skipjack import App, current_job
from skipjack.contrib.sqlalchemy import (
    async_job_transactions,
    async_session,
    job_transactions,
    session,
)

SCHEMA = os.environ.get("SKIPJACK_SCHEMA", "skipjack")
engine = create_engine("postgresql+psycopg://",
                       creator=lambda: psycopg.connect(os.environ["SKIPJACK_DATABASE_URL"]))
async_engine = create_async_engine(
    "postgresql+psycopg://",
    async_creator=lambda: psycopg.AsyncConnection.connect(os.environ["SKIPJACK_DATABASE_URL"]))
app = App(schema=SCHEMA, complete_transaction=job_transactions(engine),
          complete_transaction_async=async_job_transactions(async_engine))


class Base(DeclarativeBase):
    pass


class EffectRow(Base):
    """One row per committed effect; no unique key, so that a duplicate would show."""

    __tablename__ = "effect_rows"
    __table_args__ = {"schema": SCHEMA}  # noqa: RUF012
    rowid: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(BigInteger)
    pid: Mapped[int] = mapped_column(Integer)


@app.task(name="orm_effect", transaction="complete")
def orm_effect(seconds: float = 0.0) -> None:
    """Adds its effect row through the ORM, then takes ``seconds`` before returning."""
    with session() as s:
        s.add(EffectRow(job_id=current_job().job.id, pid=os.getpid()))
        s.commit()
    time.sleep(seconds)


@app.task(name="async_orm_effect", transaction="complete")
async def async_orm_effect(seconds: float = 0.0) -> None:
    """:func:`orm_effect` for an async handler, through an AsyncSession."""
    async with async_session() as s:
        s.add(EffectRow(job_id=current_job().job.id, pid=os.getpid()))
        await s.commit()
    await asyncio.sleep(seconds)
