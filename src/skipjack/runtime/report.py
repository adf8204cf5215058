"""The reporter: what the worker says about each attempt once its outcome is known.

For every attempt it updates the worker's counters, writes one log line on the
``skipjack.jobs`` logger, and hands an ``skipjack.hooks.Attempt`` to the app's hooks
(which the Prometheus metrics and the OpenTelemetry spans are built on).

Log lines carry their facts as structured fields (``logging`` extras: ``job_id``, ``task``,
``queue``, ``attempt``, ``max_attempts``, ``outcome``, ``duration``, and for failures
``error_type``, ``error``, ``retry_in`` and ``retry_at``), which
``skipjack.logs.JsonFormatter`` prints. Levels: a success, cancellation, snooze or
release is INFO; a failure that will be retried, and a stale write, WARNING; a job sent to
the dead letter, ERROR.

Success lines are at most ``SUCCESS_LINES_PER_SECOND`` a second: past that, one line at the
start of the next second says how many more succeeded (a line costs the worker about 20 µs
of CPU, a third of a no-op job's whole cost; docs/performance.md, "What a user's worker
does"). At DEBUG every success has its line; ``--log-level skipjack.jobs=WARNING`` drops
them all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from ..context import Job
from ..errors import Snooze
from ..hooks import Attempt, AttemptOutcome, Hooks
from ..jobs import safe_str
from ..outcome import Outcome

log = logging.getLogger("skipjack.jobs")

# Characters of an exception's message in a log line (the job's errors keep 4,000).
ERROR_LOG_CHARS = 500
# Success lines a second at INFO (see the module's doc).
SUCCESS_LINES_PER_SECOND = 100

# The WorkerStats field each recorded outcome counts in.
_COUNTERS: dict[AttemptOutcome, str] = {
    "succeeded": "succeeded", "retried": "retried", "discarded": "discarded",
    "cancelled": "cancelled", "snoozed": "snoozed", "released": "released",
    "stale": "stale_writes",
}

_LEVELS: dict[AttemptOutcome, int] = {
    "succeeded": logging.INFO, "retried": logging.WARNING, "discarded": logging.ERROR,
    "cancelled": logging.INFO, "snoozed": logging.INFO, "released": logging.INFO,
    "lost": logging.WARNING, "stale": logging.WARNING,
}


@dataclass
class WorkerStats:
    """Counters since the worker started (attempts by what became of them)."""

    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    discarded: int = 0
    cancelled: int = 0
    snoozed: int = 0
    released: int = 0
    stale_writes: int = 0  # outcome writes rejected by fencing
    leases_lost: int = 0
    rescued: int = 0  # jobs of any worker this one's rescuer found with an expired lease

    def __str__(self) -> str:
        """The counters for a log line: ``claimed 10, succeeded 9, ..., rescued 0``."""
        return ", ".join(f"{name.replace('_', ' ')} {value}"
                         for name, value in asdict(self).items())


class Reporter:
    """Counts, logs and hands to the hooks each attempt's end.

    Args:
        hooks: the app's hooks.
        stats: the worker's counters.
    """

    def __init__(self, hooks: Hooks, stats: WorkerStats,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._hooks = hooks
        self._stats = stats
        self._clock = clock
        self._second = -1  # the second (of ``clock``) the success lines are counted in
        self._lines = 0  # success lines written in it
        self._unlogged = 0  # successes without a line in it

    def recorded(self, o: Outcome, state: str | None, run_at: datetime | None = None) -> None:
        """An outcome was written (``state``: the job's new state, ``run_at``: when it is
        runnable again) or refused by fencing (``state`` None)."""
        if state is not None and o.kind == "complete":  # a success, the common case
            self._stats.succeeded += 1
            if log.isEnabledFor(logging.INFO):
                self._log_success(o)
            if self._hooks.on_ended and o.job is not None:
                self._hooks.ended(Attempt(o.job, "succeeded", o.ran))
            return
        outcome = _attempt_outcome(o, state)
        counter = _COUNTERS[outcome]
        setattr(self._stats, counter, getattr(self._stats, counter) + 1)
        if outcome not in ("retried", "snoozed", "released"):
            run_at = None
        self._end(o, outcome, run_at)

    def _log_success(self, o: Outcome) -> None:
        """The success's line, unless SUCCESS_LINES_PER_SECOND were written this second
        (and DEBUG is off): it is then counted, and said at the next second."""
        second = int(self._clock())
        if second != self._second:
            self.say_unlogged()
            self._second, self._lines = second, 0
        if self._lines < SUCCESS_LINES_PER_SECOND or log.isEnabledFor(logging.DEBUG):
            self._lines += 1
            _log(logging.INFO, o, "succeeded", None)
        else:
            self._unlogged += 1

    def say_unlogged(self) -> None:
        """Log how many successes had no line of their own since the last such line (at
        most SUCCESS_LINES_PER_SECOND lines a second); nothing if none."""
        if self._unlogged:
            log.info("%d more jobs succeeded without a line each (at most %d such lines a "
                     "second; --log-level skipjack.jobs=DEBUG logs every one)", self._unlogged,
                     SUCCESS_LINES_PER_SECOND,
                     extra={"outcome": "succeeded", "count": self._unlogged})
            self._unlogged = 0

    def lost(self, job: Job, ran: float | None, error: BaseException | None) -> None:
        """The handler of ``job`` ended after the worker lost its lease: nothing is written
        (the loss itself was logged when it happened)."""
        if self._hooks.on_ended:
            self._hooks.ended(Attempt(job, "lost", ran, _own_error(error)))

    def _end(self, o: Outcome, outcome: AttemptOutcome, run_at: datetime | None) -> None:
        level = _LEVELS[outcome]
        if log.isEnabledFor(level):
            _log(level, o, outcome, run_at)
        if o.job is not None and self._hooks.on_ended:
            self._hooks.ended(Attempt(o.job, outcome, o.ran, _own_error(o.exception), run_at))


def _own_error(error: BaseException | None) -> BaseException | None:
    """The handler's exception, not the cancellation the worker itself caused."""
    return None if isinstance(error, asyncio.CancelledError) else error


def _attempt_outcome(o: Outcome, state: str | None) -> AttemptOutcome:
    if state is None:
        return "stale"
    if o.kind == "complete":
        return "succeeded"
    if state == "cancelled":
        return "cancelled"
    if state == "discarded":
        return "discarded"
    if o.kind == "release":
        return "snoozed" if isinstance(o.exception, Snooze) else "released"
    return "retried"


def _log(level: int, o: Outcome, outcome: AttemptOutcome, run_at: datetime | None) -> None:
    """One line about the attempt, its facts also as extras."""
    job = o.job
    extra: dict[str, Any] = {"job_id": o.id, "queue": o.queue, "outcome": outcome}
    parts = [f"job {o.id}: stale {o.kind} rejected" if outcome == "stale"
             else f"job {o.id} {_VERBS[outcome]}"]
    if job is not None:
        extra.update(task=job.task, attempt=job.attempt, max_attempts=job.max_attempts)
        parts.append(f": {job.task} on {job.queue}, attempt {job.attempt}/{job.max_attempts}")
    if o.ran is not None:
        extra["duration"] = round(o.ran, 6)
        parts.append(f", {_seconds(o.ran)}")
    exc = _own_error(o.exception)
    if exc is not None and outcome in ("retried", "discarded", "released", "stale"):
        message = safe_str(exc)[:ERROR_LOG_CHARS]
        extra.update(error_type=type(exc).__name__, error=message)
        parts.append(f": {type(exc).__name__}: {message}" if message
                     else f": {type(exc).__name__}")
    elif outcome == "stale":
        parts.append(f": its {o.kind} was refused (lease_version {o.lease_version} is no "
                     "longer current: the job was rescued or claimed again)")
    if run_at is not None:
        extra.update(retry_in=round(o.delay, 6), retry_at=run_at.isoformat())
        what = {"retried": "retrying", "snoozed": "runnable again",
                "released": "runnable again"}[outcome]
        parts.append(f"; {what} in {_seconds(o.delay)} (at {run_at.isoformat()})")
    log.log(level, "".join(parts), extra=extra)


_VERBS: dict[AttemptOutcome, str] = {
    "succeeded": "succeeded", "retried": "failed", "discarded": "discarded (dead letter)",
    "cancelled": "cancelled", "snoozed": "snoozed", "released": "released",
    "lost": "lost its lease", "stale": "stale",
}


def _seconds(value: float) -> str:
    """Seconds for people: 0.004s, 1.25s, 90s."""
    return f"{value:.3f}s" if value < 10 else f"{value:.0f}s"
