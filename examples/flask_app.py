"""A Flask shop: an order and its shipping job written in one transaction, on a psycopg
connection of the request; the jobs run in a separate worker process.

    SKIPJACK_DATABASE_URL=postgresql://localhost/shop flask --app flask_app run
    SKIPJACK_DATABASE_URL=postgresql://localhost/shop skipjack worker flask_app:jobs

POST /orders?item=... creates an order and enqueues its shipping; GET /orders/<id> shows it.
"""

from __future__ import annotations

import os

from flask import Flask, abort, request
from psycopg_pool import ConnectionPool

from skipjack import App

DSN = os.environ["SKIPJACK_DATABASE_URL"]
pool = ConnectionPool(DSN, min_size=1, max_size=4, open=False)
jobs = App(DSN)


@jobs.task(max_attempts=5)
def ship(order_id: int) -> str:
    with jobs.connect() as conn:  # the worker's process: a connection of the job's own
        updated = conn.execute("UPDATE orders SET shipped = true WHERE id = %s",
                               (order_id,)).rowcount
    if not updated:
        raise LookupError(f"no order {order_id}")
    return f"order {order_id} shipped"


def create_app() -> Flask:
    pool.open()
    with pool.connection() as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS orders (id serial PRIMARY KEY, "
                     "item text NOT NULL, shipped boolean NOT NULL DEFAULT false)")
    jobs.migrate()
    web = Flask(__name__)

    @web.post("/orders")
    def create_order() -> dict[str, int]:
        with pool.connection() as conn:  # one transaction: committed at the end of the block
            (order_id,) = conn.execute("INSERT INTO orders (item) VALUES (%s) RETURNING id",
                                       (request.args["item"],)).fetchone()  # type: ignore[misc]
            job = jobs.enqueue(ship.job(order_id=order_id), conn=conn)
        return {"order": order_id, "job": job}

    @web.get("/orders/<int:order_id>")
    def get_order(order_id: int) -> dict[str, object]:
        with pool.connection() as conn:
            row = conn.execute("SELECT item, shipped FROM orders WHERE id = %s",
                               (order_id,)).fetchone()
        if row is None:
            abort(404)
        return {"order": order_id, "item": row[0], "shipped": row[1]}

    return web
