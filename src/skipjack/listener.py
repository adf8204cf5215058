"""LISTEN for wakeups, with a health check and reconnection."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

import psycopg

from .errors import ConfigError
from .migrate import channel_name
from .queries import listen as listen_statement
from .reconnect import Backoff as ReconnectBackoff

if TYPE_CHECKING:
    from .app import App

log = logging.getLogger("skipjack.worker")


async def listen(app: App, on_queue: Callable[[str], None], on_connect: Callable[[], None],
                 health_interval: float) -> None:
    """LISTEN on the app's channel until cancelled.

    Args:
        app: the application.
        on_queue: called with the queue name of each notification.
        on_connect: called after each (re)connection, so the caller rescans every queue
            (notifications sent while the listener was away are lost).
        health_interval: seconds of silence after which ``SELECT 1`` checks the connection.

    Database errors never end it: it reconnects with capped exponential backoff.
    """
    backoff = ReconnectBackoff()
    statement = listen_statement(channel_name(app.schema))
    while True:
        try:
            async with await app.connect_async() as conn:
                await conn.execute(statement)
                backoff.reset()
                on_connect()
                while True:
                    async for note in conn.notifies(timeout=health_interval):
                        on_queue(note.payload)
                    await conn.execute("SELECT 1")  # detects a dead connection
        except psycopg.Error as exc:
            delay = backoff.next()
            log.warning("listener: %s (reconnecting in %.1fs)", str(exc).strip(), delay)
            await asyncio.sleep(delay)


async def probe(app: App, timeout: float = 5.0) -> None:
    """Check that a NOTIFY from one session reaches a LISTEN on another.

    Raises:
        ConfigError: it did not within ``timeout`` seconds. Behind a transaction-mode pooler
            (PgBouncer ``pool_mode=transaction``) LISTEN is lost with its server session, so
            a worker there would silently fall back to polling; it refuses to start instead.
    """
    channel = f"skipjack_probe_{secrets.token_hex(6)}"
    async with await app.connect_async() as listener, await app.connect_async() as sender:
        await listener.execute(listen_statement(channel))
        await sender.execute(app.queries.PROBE_NOTIFY, {"channel": channel})
        async for _ in listener.notifies(timeout=timeout, stop_after=1):
            return
    raise ConfigError(
        "notifications sent on one connection do not reach LISTEN on another: is the DSN a "
        "transaction-mode pooler (PgBouncer pool_mode=transaction)? Point workers at "
        "PostgreSQL itself or at a session-mode pool; enqueuers may keep using the pooler "
        "with App(prepare=False)")
