"""The names of a schema's LISTEN/NOTIFY channels: each is derived from the schema name
(a hash of it, so that any schema name gives a valid channel of at most 63 bytes), so every
process that serves the schema finds the same ones without configuration."""

from __future__ import annotations

import hashlib


def channel_name(schema: str) -> str:
    """The LISTEN/NOTIFY channel of a schema's jobs table (at most 25 bytes)."""
    return "skipjack_" + hashlib.sha1(schema.encode()).hexdigest()[:16]


def settings_channel_name(schema: str) -> str:
    """The channel on which a change of a queue's settings (paused, limits) is announced,
    with the queue name as payload, so that workers take it up at once (at most 34 bytes)."""
    return channel_name(schema) + "_queues"


def due_channel_name(schema: str) -> str:
    """The channel on which an enqueue of delayed jobs says when the soonest is due: its
    run_at in seconds since 1970-01-01 UTC (migration 7; at most 29 bytes)."""
    return channel_name(schema) + "_due"


def done_channel_name(schema: str) -> str:
    """The channel on which the end of an awaited job of a schema is announced, with the
    job id as payload (migration 6; at most 30 bytes)."""
    return channel_name(schema) + "_done"
