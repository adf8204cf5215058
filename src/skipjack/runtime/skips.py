"""Jobs a worker leaves alone for a while because claiming, staging or rescuing them fails
(FC-35 in ``tests/CASES.md``): a trigger of the application's that raises for one job, a value
that would overflow. Skipping them lets the rest of the queue run; each is tried again after
``SKIP_FIRST`` seconds, then twice as long each time it fails, at most ``SKIP_MAX``.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("skipjack.worker")

SKIP_FIRST = 1.0
SKIP_MAX = 60.0


class SkipList:
    """The jobs to skip, with when each may be tried again (monotonic seconds)."""

    def __init__(self) -> None:
        # job id -> (time until which it is skipped, 0 once that passed; the last skip's length)
        self._skipped: dict[int, tuple[float, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._skipped)

    def ids(self) -> list[int]:
        """The ids skipped now (those whose time passed are tried again, and logged)."""
        now = time.monotonic()
        current = []
        for job_id, (until, delay) in list(self._skipped.items()):
            if until > now:
                current.append(job_id)
            elif until:
                log.info("job %s: trying again", job_id)
                self._skipped[job_id] = (0.0, delay)  # its delay kept, to double it
        return current

    def add(self, job_id: int, error: str, what: str = "claiming it") -> None:
        """``what`` (claiming, staging, rescuing the job) failed on ``job_id`` with
        ``error``: skip it, for longer each time."""
        delay = min(SKIP_MAX, 2 * self._skipped.get(job_id, (0.0, SKIP_FIRST / 2))[1])
        self._skipped[job_id] = (time.monotonic() + delay, delay)
        log.error("job %s: %s fails (%s); skipping it for %.0fs", job_id, what, error, delay)

    def claimed(self, job_id: int) -> None:
        """``job_id`` was claimed: whatever made its claim fail has gone."""
        self._skipped.pop(job_id, None)
