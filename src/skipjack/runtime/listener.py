"""LISTEN for wakeups, with a health check and reconnection."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import psycopg

from ..channels import channel_name, due_channel_name, settings_channel_name
from ..db import Database, ReconnectDelay
from ..errors import ConfigError
from ..sql.schema import listen_statement

log = logging.getLogger("skipjack.worker")


async def listen(db: Database, on_queue: Callable[[str], None], on_connect: Callable[[], None],
                 health_interval: float,
                 on_lost: Callable[[], None] = lambda: None,
                 on_settings: Callable[[str], None] = lambda queue: None,
                 on_due: Callable[[float], None] = lambda seconds: None) -> None:
    """LISTEN on the app's channels until cancelled.

    Args:
        db: the app's database.
        on_queue: called with the queue name of each notification of new jobs.
        on_settings: called with the queue name of each change of a queue's settings
            (paused, limits).
        on_due: called with the seconds until the soonest of the delayed jobs an enqueue
            wrote is due (its time on the database's clock, told apart from this host's
            by a reading at each connection).
        on_connect: called after each (re)connection, so the caller rescans every queue
            (notifications sent while the listener was away are lost).
        health_interval: seconds of silence after which ``SELECT 1`` checks the connection.
        on_lost: called when the connection was lost (the worker polls until the next
            ``on_connect``).

    Database errors never end it: it reconnects with capped exponential backoff.
    """
    backoff = ReconnectDelay()
    jobs = channel_name(db.schema)
    settings, due = settings_channel_name(db.schema), due_channel_name(db.schema)
    statements = [listen_statement(c) for c in (jobs, settings, due)]
    while True:
        try:
            async with await db.connect_async() as conn:
                offset = await _clock_offset(conn, db)
                for statement in statements:  # last: a LISTEN shows a ready worker
                    await conn.execute(statement)
                if backoff.reset():
                    log.info("listener: listening again")
                on_connect()
                while True:
                    async for note in conn.notifies(timeout=health_interval):
                        if note.channel == settings:
                            on_settings(note.payload)
                        elif note.channel == due:
                            try:
                                at = float(note.payload)
                            except ValueError:
                                continue
                            on_due(max(0.0, at - offset - time.time()))
                        else:
                            on_queue(note.payload)
                    await conn.execute(db.queries.PING)  # detects a dead connection
        except psycopg.Error as exc:
            on_lost()
            delay = backoff.next()
            log.warning("listener: %s (reconnecting in %.1fs)", str(exc).strip(), delay)
            await asyncio.sleep(delay)


async def _clock_offset(conn: psycopg.AsyncConnection[Any], db: Database) -> float:
    """The database's clock minus this host's, in seconds (to within half a round trip)."""
    before = time.time()
    row = await (await conn.execute(db.queries.DB_EPOCH)).fetchone()
    after = time.time()
    return float(row[0]) - (before + after) / 2 if row else 0.0


async def probe(db: Database, timeout: float = 5.0) -> None:
    """Check that a NOTIFY from one session reaches a LISTEN on another.

    While PostgreSQL's notification queue is too full for wake-ups (see migration 3) the
    check cannot be made: it is skipped with a warning, and the worker starts (it picks up
    jobs by polling until the queue has room again).

    Args:
        db: the app's database.
        timeout: seconds to wait for the notification.

    Raises:
        ConfigError: it did not arrive within ``timeout`` seconds. Behind a transaction-mode
            pooler (PgBouncer ``pool_mode=transaction``) LISTEN is lost with its server
            session, so a worker there would silently fall back to polling; it refuses to
            start instead.
        psycopg.Error: the database could not be reached.
    """
    channel = f"skipjack_probe_{secrets.token_hex(6)}"
    async with await db.connect_async() as listener, await db.connect_async() as sender:
        await listener.execute(listen_statement(channel))
        try:
            cur = await sender.execute(db.queries.PROBE_NOTIFY, {"channel": channel})
            sent = bool(await cur.fetchall())
        except psycopg.errors.ProgramLimitExceeded:  # the queue filled up after the check
            sent = False
        if not sent:
            log.warning("cannot check that notifications reach this worker: PostgreSQL's "
                        "notification queue is too full for wake-ups, which are skipped "
                        "until it has room again (jobs are picked up by polling meanwhile)")
            return
        async for _ in listener.notifies(timeout=timeout, stop_after=1):
            return
    raise ConfigError(
        "notifications sent on one connection do not reach LISTEN on another: is the DSN a "
        "transaction-mode pooler (PgBouncer pool_mode=transaction)? Point workers at "
        "PostgreSQL itself or at a session-mode pool; enqueuers may keep using the pooler "
        "with App(prepare=False)")
