"""skipjack: a PostgreSQL job queue for Python built on ``FOR UPDATE SKIP LOCKED``.

Public API: ``App`` (configuration, tasks, enqueue), ``JobHandle`` (what enqueue
returns: wait for the outcome), ``Worker``, ``Backoff``, ``current_job``,
``Hook`` (see ``skipjack.hooks``), and the errors. Framework integrations live in
``skipjack.contrib``, test helpers in ``skipjack.testing``.
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
