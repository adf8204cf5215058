"""The jobs table, for the read-only admin (an unmanaged model: skipjack's own migrations
create and change the table)."""

from __future__ import annotations

from django.db import models

from .application import configured_schema


def job_table() -> str:
    """``"<schema>"."jobs"``, quoted as Django keeps a quoted name as it is."""
    return f'"{configured_schema()}"."jobs"'


class Job(models.Model):
    """A skipjack job (read only: change jobs with the ``skipjack`` commands or the app)."""

    STATES = tuple((s, s) for s in ("scheduled", "available", "running", "succeeded", "discarded",
                                    "cancelled"))

    id = models.BigIntegerField(primary_key=True)
    queue = models.TextField()
    task = models.TextField()
    args = models.JSONField()
    state = models.TextField(choices=STATES)
    attempt = models.IntegerField()
    max_attempts = models.IntegerField()
    priority = models.SmallIntegerField()
    run_at = models.DateTimeField()
    created_at = models.DateTimeField()
    attempted_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)
    worker = models.TextField(null=True)
    idempotency_key = models.TextField(null=True)
    errors = models.JSONField()
    result = models.JSONField(null=True)
    progress = models.JSONField(null=True)
    metadata = models.JSONField(null=True)

    class Meta:
        managed = False
        db_table = job_table()
        ordering = ("-id",)
        verbose_name = "job"

    def __str__(self) -> str:
        return f"job {self.id} ({self.task}, {self.state})"
