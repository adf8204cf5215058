"""Which jobs an operator means: a ``JobFilter``, for listing jobs page by page and for
acting on every job that matches (the dashboard's bulk actions).

A filter is checked when it is made (``JobFilter.check``) and becomes a statement built
from constant conditions (``skipjack.sql.admin.SEARCH_CONDITIONS``) whose values are bound
parameters."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from .errors import ValidationError
from .jobs import IDEMPOTENCY_KEY_MAX_BYTES, QUEUE_MAX_BYTES, STATES, TASK_MAX_BYTES, check_name

# The longest error text a search looks for (characters).
ERROR_TEXT_MAX = 200

# The largest job id PostgreSQL's bigint holds.
ID_MAX = 2**63 - 1

# The time columns a filter's range may apply to.
TIME_FIELDS = ("created", "finished")


@dataclass(frozen=True)
class JobFilter:
    """Jobs matching every field given (None: any).

    Attributes:
        state: one of ``skipjack.jobs.STATES``.
        queue, task, idempotency_key: exact names.
        id: one job id (1..2^63-1).
        since, until: aware datetimes: the range ``since <= t < until`` of ``time``.
        time: ``"created"`` (when enqueued) or ``"finished"`` (when it succeeded, was
            discarded or cancelled; unfinished jobs have no such time and never match).
        error: text found (case-insensitive) in the message of any of the job's attempts'
            errors, at most 200 characters.
    """

    state: str | None = None
    queue: str | None = None
    task: str | None = None
    idempotency_key: str | None = None
    id: int | None = None
    since: datetime | None = None
    until: datetime | None = None
    time: str = "created"
    error: str | None = None

    def check(self) -> JobFilter:
        """Return this filter once every field is valid.

        Raises:
            ValidationError: a field out of its range, naming the field.
        """
        if self.state is not None and self.state not in STATES:
            raise ValidationError("state", f"{self.state!r} is not one of {', '.join(STATES)}")
        if self.queue is not None:
            check_name("queue", self.queue, QUEUE_MAX_BYTES)
        if self.task is not None:
            check_name("task", self.task, TASK_MAX_BYTES)
        if self.idempotency_key is not None:
            check_name("idempotency_key", self.idempotency_key, IDEMPOTENCY_KEY_MAX_BYTES)
        if self.id is not None and (isinstance(self.id, bool) or not isinstance(self.id, int)
                                    or not 1 <= self.id <= ID_MAX):
            raise ValidationError("id", f"{self.id!r} must be a job id in 1..{ID_MAX}")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, datetime) or value.tzinfo is None):
                raise ValidationError(name, f"{value!r} must be an aware datetime (UTC offset)")
        if self.time not in TIME_FIELDS:
            raise ValidationError("time", f"{self.time!r} is not one of {', '.join(TIME_FIELDS)}")
        if self.error is not None and not 1 <= len(self.error) <= ERROR_TEXT_MAX:
            raise ValidationError("error", f"{len(self.error)} characters; give 1.."
                                           f"{ERROR_TEXT_MAX}")
        if self.error is not None and "\x00" in self.error:
            raise ValidationError("error", "must not contain NUL characters")
        return self

    def params(self) -> dict[str, Any]:
        """The bound values of the fields given, by condition name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "time" and getattr(self, f.name) is not None}
