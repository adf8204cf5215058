"""skipjack: a PostgreSQL job queue for Python built on ``FOR UPDATE SKIP LOCKED``.

Public API: :class:`App` (configuration, tasks, enqueue), :class:`JobHandle` (what enqueue
returns: wait for the outcome), :class:`Worker`, :class:`Backoff`, :func:`current_job`,
:class:`Hook` (see :mod:`skipjack.hooks`), and the errors. Framework integrations live in
:mod:`skipjack.contrib`, test helpers in :mod:`skipjack.testing`.
"""

from .app import App, Task
from .context import Job, JobContext, current_job
from .errors import (
    ConfigError,
    Discard,
    DuplicateJobError,
    JobCancelled,
    JobFailed,
    JobNotFound,
    MigrationError,
    MigrationLockError,
    ResultTimeout,
    SchemaVersionError,
    SkipjackError,
    Snooze,
    ValidationError,
)
from .hooks import Attempt, EnqueueCall, Hook
from .jobs import JobSpec
from .results import JobHandle
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
    "JobFailed",
    "JobHandle",
    "JobNotFound",
    "JobSpec",
    "MigrationError",
    "MigrationLockError",
    "ResultTimeout",
    "SchemaVersionError",
    "SkipjackError",
    "Snooze",
    "Task",
    "ValidationError",
    "Worker",
    "WorkerStats",
    "current_job",
]
