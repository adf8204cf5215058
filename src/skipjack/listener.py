"""LISTEN for wakeups, with a health check and reconnection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql

from .migrate import channel_name
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
    statement = sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(app.schema)))
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
