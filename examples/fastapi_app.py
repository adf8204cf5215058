"""A FastAPI shop: an order and its shipping job written in one transaction (SQLAlchemy's
AsyncSession on psycopg), and a skipjack worker in the same process (its lifespan).

    SKIPJACK_DATABASE_URL=postgresql://localhost/shop uvicorn fastapi_app:api

POST /orders creates an order and enqueues its shipping; GET /orders/{id} shows it, and
GET /jobs/{id} waits (up to 10 s) for a job's result.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import psycopg
from fastapi import Depends, FastAPI, HTTPException
from sqlalchemy import Boolean, Integer, String
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from skipjack import App, JobFailed, JobNotFound, ResultTimeout
from skipjack.contrib.starlette import running_worker

DSN = os.environ["SKIPJACK_DATABASE_URL"]
engine = create_async_engine("postgresql+psycopg://",
                             async_creator=lambda: psycopg.AsyncConnection.connect(DSN))
Session = async_sessionmaker(engine, expire_on_commit=False)
jobs = App(DSN)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    item: Mapped[str] = mapped_column(String)
    shipped: Mapped[bool] = mapped_column(Boolean, default=False)


@jobs.task(max_attempts=5)
async def ship(order_id: int) -> str:
    async with Session() as session, session.begin():
        order = await session.get(Order, order_id)
        if order is None:
            raise LookupError(f"no order {order_id}")
        order.shipped = True
    return f"order {order_id} shipped"


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    async with running_worker(jobs, migrate=True, concurrency=4):
        yield
    await jobs.close_async()
    await engine.dispose()


api = FastAPI(lifespan=lifespan)


async def session() -> AsyncIterator[AsyncSession]:
    async with Session() as s:
        yield s


DbSession = Annotated[AsyncSession, Depends(session)]


@api.post("/orders")
async def create_order(item: str, s: DbSession) -> dict[str, int]:
    async with s.begin():  # the order and its job commit together, or neither does
        order = Order(item=item)
        s.add(order)
        await s.flush()
        job = await jobs.enqueue_async(ship.job(order_id=order.id), conn=s)
    return {"order": order.id, "job": job}


@api.get("/orders/{order_id}")
async def get_order(order_id: int, s: DbSession) -> dict[str, object]:
    order = await s.get(Order, order_id)
    if order is None:
        raise HTTPException(404, f"no order {order_id}")
    return {"order": order.id, "item": order.item, "shipped": order.shipped}


@api.get("/jobs/{job_id}")
async def job_result(job_id: int) -> dict[str, object]:
    try:
        return {"job": job_id, "result": await jobs.job_handle(job_id).result_async(timeout=10)}
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id}") from None
    except ResultTimeout:
        raise HTTPException(504, f"job {job_id} has not ended yet") from None
    except JobFailed as failed:
        raise HTTPException(500, str(failed)) from None
