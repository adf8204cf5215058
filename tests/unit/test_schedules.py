"""Unit: cron expansion and the misfire policy (skipjack.cron), and retry and reconnect
delays (skipjack.retry, skipjack.db), without a database."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from skipjack import Backoff, ValidationError
from skipjack.cron import CronSchedule, plan
from skipjack.db import ReconnectDelay


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


@dataclass
class Entry:
    schedule: CronSchedule
    grace: float = 600.0


def test_steps_ranges_and_lists_expand_to_the_listed_minutes() -> None:
    s = CronSchedule("5-20/5,45 3 * * *")
    assert [x.minute for x in s.slots(utc(2026, 1, 1), utc(2026, 1, 2))] == [5, 10, 15, 20, 45]
    assert CronSchedule("@hourly").slots(utc(2026, 1, 1, 0, 30), utc(2026, 1, 1, 3)) == [
        utc(2026, 1, 1, 1), utc(2026, 1, 1, 2), utc(2026, 1, 1, 3)]
    # day 7 is Sunday too; 4 Jan 2026 is a Sunday
    assert CronSchedule("0 0 * * 7").slots(utc(2026, 1, 1), utc(2026, 1, 8)) == [
        utc(2026, 1, 4)]


def test_a_repeated_hour_runs_twice_only_for_hourly_schedules() -> None:
    after, until = utc(2026, 10, 25, 0), utc(2026, 10, 25, 3)  # Berlin goes back at 01:00 UTC
    every_hour = CronSchedule("30 * * * *", "Europe/Berlin").slots(after, until)
    assert every_hour == [utc(2026, 10, 25, 0, 30), utc(2026, 10, 25, 1, 30),
                          utc(2026, 10, 25, 2, 30)]
    daily = CronSchedule("30 2 * * *", "Europe/Berlin").slots(after, until)
    assert daily == [utc(2026, 10, 25, 0, 30)]  # the first 02:30 (CEST) only


def test_the_misfire_policy_runs_the_newest_slot_within_grace_and_records_the_rest() -> None:
    minute = Entry(CronSchedule("* * * * *"), grace=90)
    slot, missed = plan(minute, utc(2026, 1, 1, 12, 0), utc(2026, 1, 1, 12, 4, 30))
    assert slot == utc(2026, 1, 1, 12, 4) and missed == [
        utc(2026, 1, 1, 12, 1), utc(2026, 1, 1, 12, 2), utc(2026, 1, 1, 12, 3)]
    slot, missed = plan(Entry(CronSchedule("0 0 * * *"), grace=60), utc(2026, 1, 1),
                        utc(2026, 1, 2, 0, 5))
    assert slot is None and missed == [utc(2026, 1, 2)]
    assert plan(minute, utc(2026, 1, 1, 12, 4), utc(2026, 1, 1, 12, 4, 30)) == (None, [])


def test_retry_delays_are_equal_jitter_within_half_and_all_of_the_ceiling() -> None:
    policy = Backoff(base=1.0, cap=60.0)
    assert [policy.ceiling(n) for n in (1, 2, 5, 6, 10_000)] == [2.0, 4.0, 32.0, 60.0, 60.0]
    rng = random.Random(7)
    delays = [policy.delay(3, rng) for _ in range(1000)]
    assert 4.0 <= min(delays) and max(delays) <= 8.0 and max(delays) - min(delays) > 3.5
    assert Backoff(base=1.0, cap=60.0, jitter=False).delay(3) == 8.0
    with pytest.raises(ValidationError, match="backoff.cap"):
        Backoff(base=5.0, cap=1.0)


def test_reconnect_delays_double_to_the_cap_and_reset_after_a_success() -> None:
    delay = ReconnectDelay(base=0.1, cap=1.0)
    centres = []
    for _ in range(6):
        centres.append(delay.peek())
        assert 0.75 * centres[-1] <= delay.next() <= 1.25 * centres[-1]
    assert centres == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    delay.reset()
    assert delay.peek() == 0.1

