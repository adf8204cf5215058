"""What became of an attempt: the ``Outcome`` type, its binding for the fenced outcome
statement, and ``decide``, the one place that turns a handler's result, exception or
cancellation into an outcome (every execution mode uses it).
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from .app import Task
from .context import CancelCause, Job
from .db import connection_lost
from .errors import Discard, Snooze
from .jobs import ERROR_MAX_CHARS, dump_result, safe_str, scrub_text
from .retry import Backoff

log = logging.getLogger("skipjack.worker")

# What the outcome statement does with a job (see skipjack.sql.outcomes.RECORD_OUTCOMES):
# complete -> succeeded; retry -> runnable after the delay, or discarded when its attempts
# are used up; discard -> the dead letter now; cancel -> cancelled; release -> runnable after
# the delay, the attempt not counted.
OutcomeKind = Literal["complete", "retry", "discard", "release", "cancel"]

# The delay of a release after the job's own database connection was lost.
DEFAULT_BACKOFF = Backoff()

# A job of a task this worker does not know waits for a worker that knows it (during a
# rolling deploy an old worker can claim a new task's job): it is released, without using an
# attempt, for this many seconds after it was enqueued (Worker(unknown_task_grace=)), and
# runnable again UNKNOWN_TASK_DELAY seconds (at most half the grace) after each release;
# then it is discarded.
UNKNOWN_TASK_GRACE = 600.0
UNKNOWN_TASK_DELAY = 10.0


@dataclass(slots=True)  # not frozen: its __init__ would take 1.5 us more, once per job
class Outcome:
    """What became of one attempt of the job ``id`` claimed with fencing token
    ``lease_version``.

    ``delay`` is seconds until the job is runnable again (retry, release); ``result`` and
    ``error`` are JSON text (see ``error_json``). ``job``, ``ran`` (seconds the handler
    ran; None when it never started) and ``exception`` (what it raised) are not written:
    they are for the log line and the hooks (see ``skipjack.runtime.report``).
    ``progress`` is the handler's last progress report (JSON text), written with the outcome
    so that the last one is kept however soon after it the job ended.
    """

    id: int
    lease_version: int
    queue: str
    kind: OutcomeKind
    delay: float = 0.0
    result: str | None = None
    error: str | None = None
    job: Job | None = field(default=None, compare=False, repr=False)
    ran: float | None = field(default=None, compare=False)
    exception: BaseException | None = field(default=None, compare=False, repr=False)
    progress: str | None = field(default=None, compare=False)  # JSON text: the last report


def outcome_params(batch: Sequence[Outcome]) -> dict[str, str | int]:
    """Bind values of ``RECORD_OUTCOMES`` (and ``RECORD_MANY_OUTCOMES``) for a batch: one
    JSON array of objects with the keys id, lease_version, kind, delay (seconds), result,
    error and progress (JSON text or null), and ``count``, the batch's size. A success
    with no result, error or progress report has only the first three keys (the statement
    reads a missing key as null, and reads delay only for a retry or a release): 58 bytes
    of JSON a job instead of 121, encoded in 1.3 us instead of 2.1."""
    return {"outcomes": json.dumps([_entry(o) for o in batch], ensure_ascii=False),
            "count": len(batch)}


def _entry(o: Outcome) -> dict[str, Any]:
    """One outcome's object in ``outcome_params``."""
    if o.kind == "complete" and o.result is None and o.error is None and o.progress is None:
        return {"id": o.id, "lease_version": o.lease_version, "kind": o.kind}
    return {"id": o.id, "lease_version": o.lease_version, "kind": o.kind, "delay": o.delay,
            "result": o.result, "error": o.error, "progress": o.progress}


# skipjack's own source files: a stored traceback starts at the first frame outside them
_OWN_FILES = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _from_the_handler(exc: BaseException) -> TracebackType | None:
    """``exc``'s traceback from the last of skipjack's own frames before the first that is
    not (the worker's frames that led to the handler say nothing about the failure; the
    one kept says what skipjack was doing: calling the handler, or committing its
    transaction); the whole of it when every frame is skipjack's."""
    tb, last_own = exc.__traceback__, None
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_OWN_FILES):
        last_own, tb = tb, tb.tb_next
    return last_own if tb is not None and last_own is not None else exc.__traceback__


def error_json(job: Job, exc: BaseException) -> str:
    """The error entry stored for a failed attempt: NUL-free, the message capped at 4,000
    characters and the traceback (from the frame that called the handler: see
    ``_from_the_handler``)
    at its last 16,000; never fails, whatever ``exc`` does."""
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, _from_the_handler(exc)))
    except Exception:
        tb = "<traceback could not be formatted>"
    message = f"{type(exc).__name__}: {safe_str(exc)}"
    return json.dumps({
        "attempt": job.attempt,
        "error": scrub_text(message[:ERROR_MAX_CHARS]),
        "type": scrub_text(f"{type(exc).__module__}.{type(exc).__qualname__}"),
        "traceback": scrub_text(tb[-16_000:]),
    }, ensure_ascii=False)


def decide(job: Job, task: Task | None, *, result: object = None,
           error: BaseException | None = None,
           cancelled: tuple[CancelCause, str] | None = None,
           unknown_task_grace: float = UNKNOWN_TASK_GRACE,
           ran: float | None = None) -> Outcome | None:
    """The outcome of one attempt (see ``_decide``), with ``job``, ``ran`` (seconds the
    handler ran) and the exception attached for the reports; never raises: if deciding
    itself fails (a task's policy that raises), the attempt is retried with
    ``DEFAULT_BACKOFF`` and that failure as its error, so no job is left running
    unrecorded."""
    try:
        if cancelled is None and error is None and task is not None:
            # a success, the common case: built once (and positionally: cheaper)
            return Outcome(job.id, job.lease_version, job.queue, "complete", 0.0,
                           dump_result(result), None, job, ran, None)
        outcome = _decide(job, task, result=result, error=error, cancelled=cancelled,
                          unknown_task_grace=unknown_task_grace)
    except Exception as failure:
        log.exception("job %s: deciding its outcome failed", job.id)
        return Outcome(job.id, job.lease_version, job.queue, "retry",
                       delay=DEFAULT_BACKOFF.delay(max(1, min(job.attempt, 64))),
                       error=error_json(job, failure), job=job, ran=ran, exception=failure)
    if outcome is None:
        return None
    if cancelled is not None and cancelled[0] == "timed out":
        error = TimeoutError(cancelled[1])
    o = outcome  # positional: far cheaper than dataclasses.replace, once per job
    return Outcome(o.id, o.lease_version, o.queue, o.kind, o.delay, o.result, o.error, job, ran,
                   error)


def _decide(job: Job, task: Task | None, *, result: object, error: BaseException | None,
            cancelled: tuple[CancelCause, str] | None,
            unknown_task_grace: float) -> Outcome | None:
    """The outcome of one attempt.

    Args:
        job: the claimed job (its id, fencing token, queue and attempt).
        task: its task, or None when this worker does not know the task.
        result: what the handler returned (stored as JSON, see
            ``skipjack.jobs.dump_result``).
        error: what the handler raised, if it raised.
        cancelled: (cause, reason) when the worker took the job from its handler; it
            decides before ``result`` or ``error``.
        unknown_task_grace: seconds after its enqueue during which a job of an unknown task
            (``task`` None) is released rather than discarded.

    Returns:
        None when nothing may be written (the lease was lost: the job belongs to another
        claim now). Else, in this order: a requested cancellation -> ``cancel``; a shutdown
        -> ``release`` (the attempt not counted); an unknown task -> ``release`` after
        ``UNKNOWN_TASK_DELAY`` or half the grace (the attempt not counted) until the job
        has waited ``unknown_task_grace`` seconds since its enqueue (database clock), then
        ``discard``;
        a timeout -> a failure with ``TimeoutError``; no error -> ``complete``;
        ``skipjack.Snooze`` -> ``release`` after its delay; ``skipjack.Discard``
        (and ``skipjack.errors.ArgumentsError``) -> ``discard``; a lost database
        connection under a task's own transaction (``transaction`` "complete" or "claim")
        -> ``release`` after ``DEFAULT_BACKOFF``'s first delay (not the job's fault);
        anything else -> ``retry`` after the task's backoff for this attempt.
    """
    if cancelled is not None:
        cause, reason = cancelled
        if cause == "lease lost":
            return None
        if cause == "cancel requested":
            return Outcome(job.id, job.lease_version, job.queue, "cancel")
        if cause != "timed out":  # shutting down
            return Outcome(job.id, job.lease_version, job.queue, "release")
        error = TimeoutError(reason)
    if task is None:
        unknown = error_json(job, LookupError(
            f"unknown task {job.task!r}: no handler of that name is registered in the app of "
            f"the worker that claimed it; the job waits {unknown_task_grace:.0f}s after its "
            "enqueue for a worker that knows it, then goes to the dead letter"))
        if (job.attempted_at - job.created_at).total_seconds() < unknown_task_grace:
            return Outcome(job.id, job.lease_version, job.queue, "release",
                           delay=min(UNKNOWN_TASK_DELAY, unknown_task_grace / 2), error=unknown)
        return Outcome(job.id, job.lease_version, job.queue, "discard", error=unknown)
    if error is None:
        return Outcome(job.id, job.lease_version, job.queue, "complete",
                       result=dump_result(result))
    if isinstance(error, Snooze):
        return Outcome(job.id, job.lease_version, job.queue, "release", delay=error.seconds)
    text = error_json(job, error)
    if isinstance(error, Discard):
        return Outcome(job.id, job.lease_version, job.queue, "discard", error=text)
    if task is not None and task.transaction != "none" and connection_lost(error):
        return Outcome(job.id, job.lease_version, job.queue, "release",
                       delay=DEFAULT_BACKOFF.delay(1), error=text)
    backoff = task.backoff if task is not None else DEFAULT_BACKOFF
    return Outcome(job.id, job.lease_version, job.queue, "retry",
                   delay=backoff.delay(job.attempt), error=text)
