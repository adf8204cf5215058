"""Periodic jobs: 5-field cron expressions in an IANA time zone, enqueued once per slot.

Syntax: ``minute hour day-of-month month day-of-week`` with ``*``, lists ``a,b``, ranges
``a-b``, steps ``*/n`` and ``a-b/n``, month names ``jan``-``dec`` and day names ``sun``-``sat``
(0 and 7 are Sunday); or ``@hourly``, ``@daily``, ``@weekly``, ``@monthly``, ``@yearly``. When
both day fields are restricted, a day matching either runs (as in Vixie cron).

Time zones and daylight saving time (documented policy):

- Slots are local wall-clock times, stored as UTC instants (``timestamptz``).
- A wall time skipped by a spring-forward gap runs at the instant it maps to with the offset
  in force before the change, i.e. moved forward by the gap (``30 2 * * *`` in New York runs at
  03:30 EDT on the day clocks jump from 02:00 to 03:00). Slots that collapse onto the same
  instant run once.
- A wall time repeated by a fall-back runs once, at its first occurrence, unless the schedule
  runs every hour (hour field ``*``), which then runs in both occurrences, so that for
  ``*/15 * * * *`` consecutive runs are always 900 s apart.

Misfire policy: each scheduler pass looks at the slots since the schedule's last recorded
slot. The most recent one runs if it is at most ``grace`` seconds old (default 600); every
other one is recorded as ``missed``, never run: a long outage produces no burst.
A schedule seen for the first time runs its most recent slot if that is at most ``grace``
seconds old and records none as missed (it did not exist then).

Each slot is a row of ``cron_slots`` (primary key name + slot), inserted in the same
transaction as its job, so any number of schedulers enqueue a slot at most once (the
scheduler pass is ``skipjack.runtime.maintenance.schedule_due``).
"""

from __future__ import annotations

import calendar
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .errors import ValidationError

_MACROS = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
           "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
           "@hourly": "0 * * * *"}
_MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_abbr) if name}
_DAYS = {name: i for i, name in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("minute", 0, 59, {}), ("hour", 0, 23, {}), ("day of month", 1, 31, {}),
    ("month", 1, 12, _MONTHS), ("day of week", 0, 7, _DAYS))
MAX_MISSED_RECORDED = 10_000

# The grace a schedule may have, in seconds (10 s to 7 days). The pruner keeps cron history
# at least GRACE_MAX old, so no slot still inside its grace window loses its record.
GRACE_MIN = 10.0
GRACE_MAX = 7 * 86400.0


def _value(token: str, names: dict[str, int]) -> int:
    if token.lower() in names:
        return names[token.lower()]
    if not (token.isascii() and token.isdigit()):
        raise ValueError(token)
    return int(token)


def _parse_field(text: str, name: str, low: int, high: int, names: dict[str, int]) -> set[int]:
    values: set[int] = set()
    for part in text.split(","):
        body, _, step_text = part.partition("/")
        try:
            step = int(step_text) if step_text else 1
            if body == "*":
                start, end = low, high
            else:
                first, dash, last = body.partition("-")
                if dash and not last:
                    raise ValueError(part)
                start = _value(first, names)
                end = _value(last, names) if last else (high if step_text else start)
        except ValueError:
            raise ValidationError("cron", f"{name} field {part!r} is not a number, range "
                                  "or name") from None
        if not (low <= start <= end <= high) or step < 1:
            raise ValidationError("cron", f"{name} field {part!r} is outside {low}..{high}")
        values.update(range(start, end + 1, step))
    return values


class CronSchedule:
    """A parsed cron expression in a time zone.

    Args:
        expr: the 5-field expression or a macro such as ``@daily``.
        tz: an IANA time zone name, e.g. ``America/New_York``.

    Raises:
        ValidationError: bad expression (naming the field) or unknown time zone.
    """

    def __init__(self, expr: str, tz: str = "UTC") -> None:
        text = _MACROS.get(expr.strip().lower(), expr)
        parts = text.split()
        if len(parts) != 5:
            raise ValidationError("cron", f"{expr!r}: expected 5 fields, got {len(parts)}")
        fields = [_parse_field(p, *spec) for p, spec in zip(parts, _FIELDS, strict=True)]
        try:
            self._zone = ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValidationError("cron", f"unknown time zone {tz!r}") from None
        self.expr, self.tz = expr, tz
        self._minutes, self._hours = sorted(fields[0]), sorted(fields[1])
        self._doms, self._months = fields[2], fields[3]
        self._dows = {d % 7 for d in fields[4]}
        self._dom_any, self._dow_any = parts[2] == "*", parts[4] == "*"
        first_day = datetime(2000, 1, 1).date()  # 28 years cover every weekday/leap pattern
        if not any(self._day_matches(first_day + timedelta(days=d)) for d in range(366 * 28)):
            raise ValidationError("cron", f"{expr!r} matches no day of any year")

    def __repr__(self) -> str:
        return f"CronSchedule({self.expr!r}, tz={self.tz!r})"

    def _day_matches(self, day: date) -> bool:
        if day.month not in self._months:
            return False
        dom_ok = day.day in self._doms
        dow_ok = (day.weekday() + 1) % 7 in self._dows
        if self._dom_any or self._dow_any:
            return dom_ok and dow_ok
        return dom_ok or dow_ok

    def slots(self, after: datetime, until: datetime) -> list[datetime]:
        """The UTC instants of the slots in (after, until], in order (see the module's DST
        policy). ``after`` and ``until`` are aware datetimes."""
        every_hour = len(self._hours) == 24
        found: set[datetime] = set()
        day = (after.astimezone(self._zone) - timedelta(days=1)).date()
        last_day = (until.astimezone(self._zone) + timedelta(days=1)).date()
        while day <= last_day:
            if self._day_matches(day):
                for h in self._hours:
                    for m in self._minutes:
                        wall = datetime(day.year, day.month, day.day, h, m)
                        found.update(_instants(wall, self._zone, every_hour))
            day += timedelta(days=1)
        return sorted(s for s in found if after < s <= until)


def _instants(wall: datetime, zone: ZoneInfo, both_folds: bool) -> Iterator[datetime]:
    first = wall.replace(tzinfo=zone, fold=0)
    second = wall.replace(tzinfo=zone, fold=1)
    yield first.astimezone(UTC)  # in a gap, fold=0 uses the offset before the change
    if both_folds and first.utcoffset() != second.utcoffset():
        round_trip = first.astimezone(UTC).astimezone(zone).replace(tzinfo=None)
        if round_trip == wall:  # a repeated (not skipped) wall time: its second occurrence
            yield second.astimezone(UTC)


class Planned(Protocol):
    """What ``plan`` reads of a cron entry (see ``skipjack.app.CronEntry``)."""

    @property
    def schedule(self) -> CronSchedule: ...

    @property
    def grace(self) -> float: ...  # seconds


def plan(entry: Planned, last_slot: datetime | None,
         now: datetime) -> tuple[datetime | None, list[datetime]]:
    """Apply the misfire policy to ``entry`` at ``now`` (aware datetimes), given the last slot
    recorded for it (None for a new schedule): (the slot to enqueue or None, the slots to
    record as missed)."""
    grace = timedelta(seconds=entry.grace)
    after = last_slot if last_slot is not None else now - grace
    after = max(after, now - timedelta(days=400))
    candidates = entry.schedule.slots(after, now)
    if not candidates:
        return None, []
    newest = candidates[-1]
    if last_slot is None:  # a new schedule: the slots before it existed were not missed
        return (newest if now - newest <= grace else None), []
    if now - newest <= grace:
        return newest, candidates[:-1][-MAX_MISSED_RECORDED:]
    return None, candidates[-MAX_MISSED_RECORDED:]
