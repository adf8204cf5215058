"""What a running handler can know about its job: ``current_job``."""

from __future__ import annotations

import contextvars
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Literal

from .errors import JobCancelled, ValidationError
from .jobs import has_nul_escape

PROGRESS_MAX_BYTES = 65_536  # the most a progress report may take, serialised as JSON


@dataclass(frozen=True)
class Job:
    """A claimed job, as the worker read it at claim time.

    Times are aware datetimes from the database clock (UTC). ``args`` is None when the
    payload was too large to fetch with the claim; the worker loads it before the handler runs.
    ``metadata`` holds the text entries hooks attached at enqueue (see ``skipjack.hooks``),
    e.g. a trace context; None when there are none.
    """

    id: int
    queue: str
    task: str
    args: dict[str, Any] | None
    priority: int
    attempt: int
    max_attempts: int
    lease_version: int
    created_at: datetime
    run_at: datetime
    attempted_at: datetime
    idempotency_key: str | None
    lease: float  # seconds: the job's own lease, else (claim mode) its task's, else the worker's
    metadata: dict[str, str] | None = None

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Job:
        """The job of a claim statement's row (``skipjack.sql.claim.claim_jobs``): its
        columns in the order of the fields.

        The same as ``Job(*row)`` in less than half the time: a frozen dataclass's
        ``__init__`` sets each field through ``object.__setattr__`` (about 1.9 us for these
        14 fields against 0.8 us here), once per claimed job."""
        job = object.__new__(cls)
        job.__dict__.update(zip(_JOB_FIELDS, row))  # noqa: B905 (the claim sets the columns)
        return job


_JOB_FIELDS = tuple(f.name for f in fields(Job))


# Why the worker took a job from its handler; it decides what is recorded (see
# skipjack.outcome.decide): nothing for a lost lease, "cancelled" for a requested cancel, a
# failed attempt for a timeout, and a release (the attempt not counted) for a shutdown.
CancelCause = Literal["lease lost", "cancel requested", "timed out", "shutdown"]

_EVENT_LOCK = threading.Lock()


@dataclass
class JobContext:
    """The running job and its cancellation flag.

    ``cancelled`` is set when the worker lost the job's lease (another worker may own it now),
    the job's cancellation was requested, it timed out, or the worker is shutting down past
    its grace period; ``cause`` then says which and ``reason`` says it for people. Async
    handlers are also cancelled outright; long sync handlers should check
    ``raise_if_cancelled`` between steps.
    """

    job: Job
    reason: str = ""
    cause: CancelCause | None = None
    conn: Any = None  # the job's transaction connection (tasks with transaction="complete")
    reported: str | None = None  # the last progress report, as JSON text
    # where a report goes: (job id, fencing token, JSON text), the worker's running set
    on_progress: Callable[[int, int, str], None] | None = field(default=None, repr=False)
    _event: threading.Event | None = field(default=None, repr=False)

    def progress(self, value: Any) -> None:
        """Report the job's progress: any JSON value, e.g. ``0.4`` or
        ``{"done": 40, "total": 100}``. It returns at once (no database round trip).

        The worker writes the latest report at most once a second while the job runs
        (fenced: a worker that lost the job's lease writes nothing), and the last one with
        the job's outcome. It is read by ``skipjack.JobHandle.progress``,
        ``skipjack.App.get_job`` and ``skipjack jobs show``.

        Raises:
            ValidationError: ``value`` is not JSON (NaN and infinities are not), or takes
                more than 65,536 bytes serialised.
        """
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False,
                              separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ValidationError("progress", f"must be a JSON value: {exc}") from None
        try:
            size = len(text.encode())
        except UnicodeEncodeError:
            raise ValidationError("progress", "must be valid Unicode (a lone surrogate is "
                                  "not)") from None
        if size > PROGRESS_MAX_BYTES or has_nul_escape(text):
            raise ValidationError("progress", f"must take at most {PROGRESS_MAX_BYTES:,} "
                                  "bytes as JSON, without NUL characters")
        self.reported = text
        if self.on_progress is not None:
            self.on_progress(self.job.id, self.job.lease_version, text)

    @property
    def cancelled(self) -> threading.Event:
        """A ``threading.Event`` set when the job is taken from its handler (made on
        first use: most jobs never need one)."""
        if self._event is None:
            with _EVENT_LOCK:
                if self._event is None:
                    self._event = threading.Event()
        return self._event

    @property
    def is_cancelled(self) -> bool:
        """Whether the job was taken from its handler (see ``cancelled``)."""
        return self._event is not None and self._event.is_set()

    @property
    def cancellation(self) -> tuple[CancelCause, str] | None:
        """(cause, reason) once the job was taken from its handler, else None."""
        if not self.is_cancelled:
            return None
        return self.cause or "shutdown", self.reason

    def cancel(self, reason: str, cause: CancelCause = "shutdown") -> None:
        """Set the cancellation flag, with a reason for people and its ``cause``."""
        self.reason = reason
        self.cause = cause
        self.cancelled.set()

    def raise_if_cancelled(self) -> None:
        """Raise ``JobCancelled`` if the job was taken from this handler."""
        if self.is_cancelled:
            raise JobCancelled(f"job {self.job.id}: {self.reason}")


_current: contextvars.ContextVar[JobContext] = contextvars.ContextVar("skipjack_job")


def current_job() -> JobContext:
    """The job the calling handler is running (works in sync handlers' threads too).

    Raises:
        LookupError: called outside a handler run by a skipjack worker (the task's function
            called directly, say).
    """
    try:
        return _current.get()
    except LookupError:
        raise LookupError("current_job() was called outside a job: only a handler run by a "
                          "skipjack worker (or skipjack.testing's drain or inline) has "
                          "one") from None


def set_current(ctx: JobContext) -> None:
    """Bind ``ctx`` to the calling task's context (the worker does this)."""
    _current.set(ctx)
