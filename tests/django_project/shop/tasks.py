"""The shop's tasks: skipjack tasks on the project's app, and Django Tasks on the skipjack
backend."""

from __future__ import annotations

import os
import time

from asgiref.sync import sync_to_async
from django.db import connection
from django.tasks import task

from shop.models import Effect, Order
from skipjack import current_job
from skipjack.contrib.django import app


@app.task(name="shop.mark_paid")
def mark_paid(order_id: int) -> str:
    Order.objects.filter(id=order_id).update(paid=True)
    return f"order {order_id} paid"


@app.task(name="shop.orm_effect", transaction="complete")
def orm_effect(seconds: float = 0.0) -> None:
    """Writes its effect through the ORM in the job's transaction, then takes ``seconds``."""
    Effect.objects.create(job_id=current_job().job.id, pid=os.getpid())
    time.sleep(seconds)


@app.task(name="shop.async_orm", max_attempts=1)
async def async_orm(order_id: int) -> int:
    """Reads an order through the ORM from async code; returns the server process id of
    the Django connection that served it."""
    def read() -> int:
        Order.objects.filter(id=order_id).count()
        with connection.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            return int(cur.fetchone()[0])

    return await sync_to_async(read)()


@task()
def add(a: int, b: int) -> int:
    return a + b


@task(queue_name="reports", priority=10)
def flaky_report() -> str:
    """Always fails (its backend options allow it 2 attempts)."""
    raise ValueError("the report is not ready")


@task(takes_context=True)
def which_attempt(context, label: str) -> dict:  # type: ignore[no-untyped-def]
    return {"label": label, "attempt": context.attempt, "id": context.task_result.id}


@task()
def receipt(order_id: int) -> str:
    return f"receipt for {order_id}"


@task()
async def async_double(n: int) -> int:
    return 2 * n


@task()
def note(label: str) -> str:
    """Writes an order noted ``label``: the orders' ids tell the order the tasks ran in."""
    Order.objects.create(note=label)
    return label


@task(queue_name="reports")
def weekly_digest() -> str:
    """No test enqueues it: known from Django's start all the same."""
    return "digest"
