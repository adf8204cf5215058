"""Jobs as data: the validated spec of a job to enqueue, and the limits that apply.

Everything here runs before any database work, so bad input never reaches the queue.

Limits (bytes are UTF-8 bytes):

===================  ===========================================================
queue                1-63 bytes, printable, no white space
task                 1-255 bytes, printable, no white space
args                 a dict of JSON values; at most ``max_args_bytes`` after
                     serialisation (default 64 MiB = 67,108,864 bytes); no NaN or
                     Infinity; no NUL (U+0000) in any string or key
priority             integer, -100..100; higher runs first; default 0
max_attempts         integer, 1..10,000; default 25
run_at               an aware datetime (any zone; stored as UTC), or ``delay``
delay                seconds (int/float) or timedelta, 0..10 years
idempotency_key      1-255 bytes, no NUL; unique among the jobs in ``unique_while``
                     states (default: every state, i.e. forever)
lease                seconds, 0.1..604,800 (7 days); default: the worker's lease
===================  ===========================================================

JSON values are ``dict`` (str keys), ``list``, ``tuple`` (comes back as a list), ``str``,
``int``, ``float``, ``bool`` and ``None``. Anything else (datetime, Decimal, UUID, bytes, set,
custom objects) is rejected: convert it yourself, so that what a handler receives is exactly
what it was sent.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from .errors import ValidationError

QUEUE_MAX_BYTES = 63
TASK_MAX_BYTES = 255
IDEMPOTENCY_KEY_MAX_BYTES = 255
DEFAULT_MAX_ARGS_BYTES = 64 * 1024 * 1024
PRIORITY_MIN, PRIORITY_MAX = -100, 100
MAX_ATTEMPTS_LIMIT = 10_000
MAX_DELAY_SECONDS = 10 * 365.25 * 86400
LEASE_MIN, LEASE_MAX = 0.1, 7 * 86400.0

# A NUL escape in serialised JSON: "\u0000" preceded by an even number of backslashes
# (an odd number means the text holds a literal backslash followed by "u0000").
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def has_nul_escape(json_text: str) -> bool:
    """Whether JSON text encodes a NUL character (``\\u0000``), which jsonb refuses."""
    return _NUL_ESCAPE.search(json_text) is not None


@dataclass(frozen=True)
class JobSpec:
    """A validated job, ready to enqueue. Build it with ``skipjack.Task.job``.

    ``args_json`` is the serialised args (UTF-8 JSON text); ``delay`` is seconds from the
    database's ``now()`` when ``run_at`` is None. (Task.job passes the fields by position:
    keep their order.)
    """

    queue: str
    task: str
    args_json: str
    priority: int = 0
    max_attempts: int = 25
    run_at: datetime | None = None
    delay: float | None = None
    idempotency_key: str | None = None
    lease: float | None = None
    unique_states: int = 63


@dataclass(frozen=True)
class HandlerArguments:
    """The keyword arguments a handler takes, to check a job's args against before anything
    is written (at enqueue) and before the handler runs (in the worker).

    ``names``: the parameters args may fill; ``required``: those without a default (a
    positional-only one can never be filled: it is required and not in ``names``);
    ``any_keyword``: the handler takes ``**kwargs``.
    """

    names: frozenset[str]
    required: frozenset[str]
    any_keyword: bool
    order: tuple[str, ...] = ()  # the names in the signature's order, for messages

    @classmethod
    def of(cls, fn: Callable[..., object]) -> HandlerArguments | None:
        """What ``fn`` takes, or None when its signature cannot be read (a builtin)."""
        try:
            # the wrapper's own signature (a decorator may add or take arguments)
            params = inspect.signature(fn, follow_wrapped=False).parameters.values()
        except (TypeError, ValueError):
            return None
        order = tuple(p.name for p in params
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        names = set(order)
        required = {p.name for p in params if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        any_keyword = any(p.kind == p.VAR_KEYWORD for p in params)
        return cls(frozenset(names), frozenset(required), any_keyword, order)

    def mismatch(self, args: Mapping[str, object]) -> str | None:
        """Why ``args`` cannot be passed as keyword arguments, or None when they can (a
        job's args that are not a JSON object, written by other code, never can)."""
        try:
            keys = args.keys()
        except AttributeError:
            return (f"a job's args must be a JSON object of keyword arguments, not "
                    f"{_json_kind(args)}")
        if (self.any_keyword or keys <= self.names) and self.required <= keys \
                and self.required <= self.names:
            return None  # the common case, without building a set
        positional = sorted(self.required - self.names)
        if positional:  # args come as keywords: these can never be given
            return (f"the handler's parameters {', '.join(positional)} are positional-only: "
                    "a job's args are passed as keyword arguments")
        unexpected = sorted(keys - self.names) if not self.any_keyword else []
        missing = sorted(self.required - keys)
        problems = [f"unexpected argument {n!r}" for n in unexpected]
        problems += [f"missing argument {n!r}" for n in missing]
        takes = ", ".join(self.order or sorted(self.names)) or "no arguments"
        return f"{'; '.join(problems)} (the handler takes {takes})"


def _json_kind(value: object) -> str:
    """What JSON calls the type of ``value`` (a decoded JSON value): "an array", "a string"."""
    kinds = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"),
             (list, "an array"), (type(None), "null"))
    return next((name for kind, name in kinds if isinstance(value, kind)),
                type(value).__name__)


STATES = ("scheduled", "available", "running", "succeeded", "discarded", "cancelled")

# Seconds a worker keeps succeeded and cancelled jobs by default before pruning them (the
# dead letter: ten times as long); a worker given retention=None keeps them forever.
DEFAULT_RETENTION = 7 * 86400.0

_STATE_BITS = {state: 1 << i for i, state in enumerate(STATES)}  # as state_bit() in SQL


def unique_states_mask(states: Iterable[str] | None) -> int:
    """The bit mask of ``unique_while`` states (None: every state).

    Raises:
        ValidationError: not a collection of known state names, or empty.
    """
    if states is None:
        return 63
    names = [states] if isinstance(states, str) else list(states)
    if isinstance(states, str) or not names or any(s not in _STATE_BITS for s in names):
        raise ValidationError("unique_while", f"{states!r}: give a non-empty collection of "
                              f"states from {STATES}")
    if not {"scheduled", "available", "running"} <= set(names):
        # a key released while its job still waits or runs could be taken by another job,
        # and the first one's next move (staging, claim, retry) would then break the index
        raise ValidationError("unique_while", "must include 'scheduled', 'available' and "
                              "'running' (a job holds its key until it finishes)")
    mask = 0
    for s in names:
        mask |= _STATE_BITS[s]
    return mask


def check_name(field: str, value: object, max_bytes: int) -> str:
    """Validate a queue or task name. Returns it unchanged.

    Raises:
        ValidationError: not a str, empty, over ``max_bytes`` UTF-8 bytes, or containing
            white space or unprintable characters.
    """
    if not isinstance(value, str):
        raise ValidationError(field, f"must be a str, got {type(value).__name__}")
    if not value:
        raise ValidationError(field, "must not be empty")
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ValidationError(field, f"{size} bytes, the limit is {max_bytes} bytes (UTF-8)")
    if not value.isprintable() or any(c.isspace() for c in value):
        raise ValidationError(field, f"{value!r} has white space or unprintable characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(field, "holds a lone surrogate (invalid Unicode)") from None
    return value


def _int_in(field: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValidationError(field, f"must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValidationError(field, f"{value} is out of range {low}..{high}")
    return value


def _seconds_in(field: str, value: object, low: float, high: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValidationError(
            field, f"must be seconds or a timedelta, got {type(value).__name__}")
    if not (math.isfinite(seconds) and low <= seconds <= high):
        raise ValidationError(field, f"{seconds!r} seconds is out of range {low:g}..{high:.0f}")
    return seconds


def check_priority(value: object) -> int:
    """Raises ValidationError unless ``value`` is an int in -100..100."""
    return _int_in("priority", value, PRIORITY_MIN, PRIORITY_MAX)


def check_max_attempts(value: object) -> int:
    """Raises ValidationError unless ``value`` is an int in 1..10,000."""
    return _int_in("max_attempts", value, 1, MAX_ATTEMPTS_LIMIT)


def check_delay(value: object) -> float | None:
    """Seconds from a number or timedelta; raises ValidationError outside 0..10 years."""
    return _seconds_in("delay", value, 0, MAX_DELAY_SECONDS)


def check_lease(value: object) -> float | None:
    """Seconds of a per-task lease; raises ValidationError outside 0.1..604,800."""
    return _seconds_in("lease", value, LEASE_MIN, LEASE_MAX)


def check_timeout(value: object) -> float | None:
    """Seconds of a per-task timeout; raises ValidationError outside 0.001..604,800."""
    return _seconds_in("timeout", value, 0.001, LEASE_MAX)


def check_run_at(value: object) -> datetime | None:
    """Raises ValidationError for anything but None or an aware datetime whose UTC time is
    within years 1-9999 (a time outside them could be stored, but not read back in Python)."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise ValidationError("run_at", f"must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValidationError(
            "run_at",
            "naive datetime: pass an aware one (e.g. datetime.now(timezone.utc)) or use delay",
        )
    try:
        value.astimezone(UTC)
    except OverflowError:
        raise ValidationError("run_at", f"{value.isoformat()} is outside years 1-9999 in "
                              "UTC") from None
    return value


def check_idempotency_key(value: object) -> str | None:
    """Raises ValidationError unless ``value`` is None or a 1-255 byte str without NUL."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValidationError("idempotency_key", f"must be a str, got {type(value).__name__}")
    size = len(value.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= IDEMPOTENCY_KEY_MAX_BYTES:
        raise ValidationError(
            "idempotency_key", f"{size} bytes, must be 1..{IDEMPOTENCY_KEY_MAX_BYTES} (UTF-8)"
        )
    if "\x00" in value:
        raise ValidationError("idempotency_key", "contains NUL (U+0000)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError("idempotency_key", "holds a lone surrogate (invalid "
                              "Unicode)") from None
    return value


# What a handler's database transaction spans (see skipjack.App.task): "none", its job's
# completion ("complete"), or its job's claim ("claim").
TransactionMode = Literal["none", "complete", "claim"]
TRANSACTION_MODES: tuple[TransactionMode, ...] = ("none", "complete", "claim")


def check_transaction(value: object) -> TransactionMode:
    """Raises ValidationError unless ``value`` is one of ``TRANSACTION_MODES``."""
    if value not in TRANSACTION_MODES:
        raise ValidationError("transaction", f"{value!r} is not one of {TRANSACTION_MODES}")
    return value  # narrowed by the membership test


def _reject(obj: object) -> Any:
    raise ValidationError(
        "args",
        f"a value of type {type(obj).__name__} is not JSON: pass only dict, list, str, "
        "int, float, bool or None (convert datetimes, Decimals, UUIDs, bytes yourself)",
    )


_ARGS_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                                 default=_reject)


def serialize_args(args: object, max_bytes: int = DEFAULT_MAX_ARGS_BYTES) -> str:
    """Serialise job args to compact JSON text and check every rule above.

    Args:
        args: a dict of JSON values (the keyword arguments of the task).
        max_bytes: the size limit in UTF-8 bytes of the serialised text.

    Returns:
        The JSON text stored in the ``args`` column.

    Raises:
        ValidationError: not a dict, a non-JSON value, NaN/Infinity, NUL, invalid Unicode,
            or over ``max_bytes``.
    """
    if not isinstance(args, dict):
        raise ValidationError("args", f"must be a dict, got {type(args).__name__}")
    _check_keys(args)
    try:
        text = _ARGS_ENCODER.encode(args)
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            raise
        if "Out of range float" in str(exc):
            raise ValidationError("args", "NaN and Infinity are not JSON (jsonb refuses "
                                  "them)") from exc
        if "Circular reference" in str(exc):
            raise ValidationError("args", "contains a reference cycle") from exc
        raise ValidationError("args", str(exc)) from exc
    except RecursionError as exc:
        raise ValidationError("args", "nested too deeply") from exc
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        raise ValidationError("args", "a string or key contains NUL (U+0000), which jsonb refuses")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValidationError("args", "a string holds a lone surrogate (invalid Unicode)") from exc
    if size > max_bytes:
        raise ValidationError("args", f"{size} bytes serialised, the limit is {max_bytes} bytes")
    return text


_CONTAINERS = (dict, list, tuple)


def _check_keys(args: dict[Any, Any]) -> None:
    """Refuse non-str dict keys at any depth (JSON would turn 1, True, None into strings)."""
    stack: list[Any] = []
    for key, value in args.items():  # the top level on its own: most args are flat
        if not isinstance(key, str):
            raise ValidationError("args", f"dict keys must be str, got {key!r}")
        if isinstance(value, _CONTAINERS):
            stack.append(value)
    seen = 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > 10_000_000:
            return  # pathological size or a cycle: json.dumps reports it
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(key, str):
                    raise ValidationError("args", f"dict keys must be str, got {key!r}")
                if isinstance(value, _CONTAINERS):
                    stack.append(value)
        else:
            stack.extend(v for v in node if isinstance(v, _CONTAINERS))


RESULT_MAX_BYTES = 1024 * 1024
ERROR_MAX_CHARS = 4000


def safe_str(value: object) -> str:
    """``str(value)``, or a placeholder when its ``__str__`` itself raises."""
    try:
        return str(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"


def scrub_text(text: str) -> str:
    """Make text safe for jsonb: NUL becomes U+FFFD, lone surrogates are replaced."""
    return text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def dump_result(value: object) -> str | None:
    """Serialise a handler's return value for the ``result`` column, never failing.

    JSON values are kept as ``json.dumps`` writes them (a tuple as an array, a key that is
    not a string as one; NUL replaced by U+FFFD); anything else is stored as its ``repr``
    (NaN/Infinity too). A result over 1 MiB serialised is replaced by a note saying so.
    Returns None for None.
    """
    if value is None:
        return None
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except Exception:
        try:
            text = json.dumps(scrub_text(repr(value)), ensure_ascii=False)
        except Exception:
            text = json.dumps(f"<unrepresentable {type(value).__name__}>")
    if len(text) > RESULT_MAX_BYTES:
        return json.dumps(f"<result not stored: {len(text)} characters, the limit is "
                          f"{RESULT_MAX_BYTES}>")
    text = _NUL_ESCAPE.sub(lambda m: m.group(0)[:-6] + "\ufffd", text)
    return scrub_text(text)


def job_ids(values: Iterable[object], field: str = "ids") -> list[int]:
    """Job ids as plain ints, for an array parameter (a ``skipjack.JobHandle`` is an
    int subclass, which psycopg will not put in one array with plain ints).

    Raises:
        ValidationError: (naming ``field``) a value is not an int in 1..2^63-1 (bools are
            not ids).
    """
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**63:
            raise ValidationError(field, f"{value!r} is not a job id (an int in 1..2^63-1)")
        out.append(int(value))
    return out
