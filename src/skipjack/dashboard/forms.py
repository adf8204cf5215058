"""Reading the dashboard's query strings and forms into checked values: every field is
parsed here, and a bad one becomes a ``ValidationError`` naming it, before anything
reads or writes the queue."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from ..errors import ValidationError
from ..search import ID_MAX, JobFilter

# Filter fields as the jobs page's query string names them.
FILTER_FIELDS = ("state", "queue", "task", "key", "id", "since", "until", "time", "error")

# The most characters of a hand-enqueued job's JSON args accepted from the form (the app's
# max_args_bytes applies after parsing).
ARGS_TEXT_MAX = 1_000_000


def text(values: Mapping[str, Any], name: str) -> str | None:
    """The field stripped, or None when missing or blank."""
    value = values.get(name)
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value or None


def _number(value: str, name: str, kind: type[int] | type[float], what: str) -> Any:
    """``kind(value)`` for ASCII text (``int`` and ``float`` also take other scripts'
    digits), or a ValidationError saying the field is not ``what``."""
    try:
        if not value.isascii():
            raise ValueError(value)
        return kind(value)
    except ValueError:
        raise ValidationError(name, f"{value[:40]!r} is not {what}") from None


def job_id(value: str | None, name: str = "id") -> int | None:
    """A job id (0..2^63-1) from text, or None for None.

    Raises:
        ValidationError: not such a number.
    """
    if value is None:
        return None
    number: int = _number(value, name, int, "a job id")
    if not 0 <= number <= ID_MAX:
        raise ValidationError(name, f"{number} is out of range 0..{ID_MAX}")
    return number


def instant(value: str | None, name: str) -> datetime | None:
    """An ISO 8601 date and time (a browser's ``datetime-local`` value is read as UTC), or
    None for None.

    Raises:
        ValidationError: not such a time.
    """
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValidationError(name, f"{value[:40]!r} is not a date and time like "
                                    "2026-12-01T09:30 (UTC)") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def job_filter(values: Mapping[str, Any]) -> JobFilter:
    """The jobs filter of a query string or form (fields ``FILTER_FIELDS``).

    Raises:
        ValidationError: a field out of range, named as the page names it.
    """
    state = text(values, "state")
    time = text(values, "time")
    if time is None:  # a range over finished jobs means when they finished
        time = "finished" if state in ("succeeded", "discarded", "cancelled") else "created"
    return JobFilter(state=state, queue=text(values, "queue"), task=text(values, "task"),
                     idempotency_key=text(values, "key"), id=job_id(text(values, "id")),
                     since=instant(text(values, "since"), "since"),
                     until=instant(text(values, "until"), "until"),
                     time=time, error=text(values, "error")).check()


def filter_fields(where: JobFilter) -> dict[str, str]:
    """The query-string fields of a filter (those given), the inverse of ``job_filter``."""
    fields = {"state": where.state, "queue": where.queue, "task": where.task,
              "key": where.idempotency_key, "id": None if where.id is None else str(where.id),
              "since": None if where.since is None else where.since.isoformat(),
              "until": None if where.until is None else where.until.isoformat(),
              "error": where.error}
    given = {k: v for k, v in fields.items() if v is not None}
    if where.since is not None or where.until is not None:
        given["time"] = where.time
    return given


def filter_query(where: JobFilter, **extra: str | int) -> str:
    """A query string for the filter plus ``extra`` fields (URL-encoded)."""
    return urlencode({**filter_fields(where), **{k: str(v) for k, v in extra.items()}})


def optional_int(value: str | None, name: str) -> int | None:
    """An integer field, or None when blank.

    Raises:
        ValidationError: not an integer.
    """
    if value is None:
        return None
    number: int = _number(value, name, int, "a whole number")
    return number


def optional_seconds(value: str | None, name: str) -> float | None:
    """A number of seconds, or None when blank.

    Raises:
        ValidationError: not a finite number.
    """
    if value is None:
        return None
    number: float = _number(value, name, float, "a number of seconds")
    if not math.isfinite(number):
        raise ValidationError(name, f"{value[:40]!r} is not a number of seconds")
    return number


def json_object(value: str | None, name: str) -> dict[str, Any]:
    """A JSON object (``{}`` when blank), as a job's keyword arguments.

    Raises:
        ValidationError: not JSON, not an object, or longer than ``ARGS_TEXT_MAX``.
    """
    if value is None:
        return {}
    if len(value) > ARGS_TEXT_MAX:
        raise ValidationError(name, f"{len(value):,} characters; at most {ARGS_TEXT_MAX:,}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValidationError(name, f"not JSON: {exc.msg} (line {exc.lineno}, column "
                                    f"{exc.colno})") from None
    except RecursionError:
        raise ValidationError(name, "nested too deeply") from None
    if not isinstance(parsed, dict):
        raise ValidationError(name, f"must be a JSON object of keyword arguments, got "
                                    f"{type(parsed).__name__}")
    return parsed
