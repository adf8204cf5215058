"""The exceptions skipjack raises."""

from __future__ import annotations


class SkipjackError(Exception):
    """Base class of every skipjack error."""


class ValidationError(SkipjackError, ValueError):
    """Bad input to enqueue or to a task declaration. Raised before anything is written.

    The message names the field and the limit, e.g. ``queue: 70 bytes, the limit is 63``.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class ConfigError(SkipjackError, ValueError):
    """A worker or app setting that cannot work (e.g. a heartbeat too slow for the lease)."""


class SchemaVersionError(SkipjackError):
    """The database schema is missing, older than this code, or newer than this code."""


class MigrationError(SkipjackError):
    """A migration could not be applied: the database refused one of its statements. Each
    attempt runs in one transaction, which was rolled back: nothing of the failed call is
    kept (migrations applied by earlier calls stay)."""


class MigrationLockError(MigrationError):
    """A migration could not take a lock it needs: on every attempt another session held a
    lock on one of the schema's tables (a backup's ``pg_dump``, a long transaction) for longer
    than the lock timeout, or the migration deadlocked with it. The migration gave up its
    wait each time, so the queue kept running.

    Attributes:
        pids: the backend pids of the sessions seen holding locks on the schema's tables
            after the last attempt, oldest transaction first (empty when none was seen).
    """

    def __init__(self, message: str, pids: list[int]) -> None:
        self.pids = pids
        super().__init__(message)


class DuplicateJobError(SkipjackError):
    """An idempotency key is taken by a job this caller cannot see yet (another open
    transaction, or a snapshot older than the job's commit)."""


class Discard(SkipjackError):
    """Raise from a handler to send the job to the dead letter now, without more attempts."""


class ArgumentsError(Discard):
    """A job's args do not fit its handler's signature (an unexpected or a missing argument).

    The worker raises it before the handler runs; like ``Discard``, it sends the job to
    the dead letter at once, since no retry could succeed."""


class HandlerTransactionError(SkipjackError):
    """A ``transaction="complete"`` or ``"claim"`` handler ended the transaction it was given
    (a COMMIT or ROLLBACK on ``current_job().conn``), or went on after one of its statements
    failed (the transaction is then aborted). The attempt fails with this error; skipjack
    alone commits or rolls back that transaction."""


class Snooze(SkipjackError):
    """Raise from a handler to run the job again after ``seconds`` without using an attempt.

    Args:
        seconds: delay from the database's ``now()``; 0..31,557,600 (one year).
    """

    def __init__(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not (isinstance(seconds, int | float)
                                             and 0 <= seconds <= 31_557_600):
            raise ValidationError("seconds", f"{seconds!r} is not in 0..31557600")
        self.seconds = float(seconds)
        super().__init__(f"snoozed for {self.seconds}s")


class JobCancelled(SkipjackError):
    """Raised in a handler that checks ``skipjack.JobContext.raise_if_cancelled`` after
    its job was taken from it (lease lost) or the worker is shutting down."""


class JobFailed(SkipjackError):
    """``skipjack.JobHandle.result``: the job ended without a result, discarded (the dead
    letter, after its last attempt or by hand) or cancelled.

    Attributes:
        job_id: the job's id.
        state: ``"discarded"`` or ``"cancelled"``.
        errors: the job's error entries, one per failed attempt, oldest first (dicts with
            ``attempt``, ``error`` ("Type: message"), ``type`` (the exception's import path,
            when recorded), ``traceback``, ``at``, ``worker``, ``started_at``).
    """

    def __init__(self, job_id: int, state: str, errors: list[dict[str, object]]) -> None:
        self.job_id = job_id
        self.state = state
        self.errors = errors
        last = errors[-1].get("error") if errors else None
        detail = f": {last}" if last else ""
        super().__init__(f"job {job_id} was {state}{detail}")


class ResultTimeout(SkipjackError, TimeoutError):
    """``skipjack.JobHandle.result``: the job had not ended within the timeout (it goes
    on: waiting changes nothing about it)."""


class JobNotFound(SkipjackError, LookupError):
    """No job has this id (never enqueued, deleted by retention, or enqueued in a
    transaction this caller cannot see: not committed yet, or rolled back)."""
