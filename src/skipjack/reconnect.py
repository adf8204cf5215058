"""Capped exponential backoff for reconnecting to the database.

Delays double from ``base`` up to ``cap`` seconds, each with +-25% jitter so many workers do
not reconnect in lockstep after a server restart. A worker never gives up: it keeps trying at
the cap (so it logs about once per ``cap`` seconds per component while the database is away).
"""

from __future__ import annotations

import random


class Backoff:
    """Reconnect delays in seconds: ``next()`` for the next wait, ``reset()`` after success."""

    def __init__(self, base: float = 0.05, cap: float = 5.0) -> None:
        self.base = base
        self.cap = cap
        self._failures = 0

    def peek(self) -> float:
        """The un-jittered delay the next call to :meth:`next` is centred on."""
        return min(self.cap, self.base * 2.0 ** min(self._failures, 32))

    def next(self) -> float:
        """The delay before the next attempt; each call doubles the following one."""
        delay = self.peek() * random.uniform(0.75, 1.25)
        self._failures += 1
        return delay

    def reset(self) -> None:
        """Forget past failures (call after a successful connection or statement)."""
        self._failures = 0
