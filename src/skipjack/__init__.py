"""skipjack: a PostgreSQL job queue for Python built on ``FOR UPDATE SKIP LOCKED``.

Public API: :class:`App` (configuration, tasks, enqueue), :class:`Worker`, :class:`Backoff`,
:func:`current_job`, and the errors.
"""

from .app import App, Task
from .context import Job, JobContext, current_job
from .errors import (
    ConfigError,
    Discard,
    DuplicateJobError,
    JobCancelled,
    MigrationError,
    MigrationLockError,
    SchemaVersionError,
    SkipjackError,
    Snooze,
    ValidationError,
)
from .jobs import JobSpec
from .retry import Backoff
from .runtime.completer import WorkerStats
from .runtime.worker import Worker

__all__ = [
    "App",
    "Backoff",
    "ConfigError",
    "Discard",
    "DuplicateJobError",
    "Job",
    "JobCancelled",
    "JobContext",
    "JobSpec",
    "MigrationError",
    "MigrationLockError",
    "SchemaVersionError",
    "SkipjackError",
    "Snooze",
    "Task",
    "ValidationError",
    "Worker",
    "WorkerStats",
    "current_job",
]
