"""skipjack: a PostgreSQL job queue for Python built on ``FOR UPDATE SKIP LOCKED``.

Public API: :class:`App` (configuration, tasks, enqueue), :class:`Worker`, :class:`Backoff`,
:func:`current_job`, :class:`Hook` (see :mod:`skipjack.hooks`), and the errors.
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
from .hooks import Attempt, EnqueueCall, Hook
from .jobs import JobSpec
from .retry import Backoff
from .runtime.report import WorkerStats
from .runtime.worker import Worker

__all__ = [
    "App",
    "Attempt",
    "Backoff",
    "ConfigError",
    "Discard",
    "DuplicateJobError",
    "EnqueueCall",
    "Hook",
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
