"""Cron: parsing, DST policy, misfire policy, and one job per slot under concurrent schedulers."""

from __future__ import annotations

import random
import threading
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

import psycopg
import pytest

from skipjack import App, ValidationError
from skipjack.app import CronEntry
from skipjack.cron import CronSchedule, plan
from skipjack.runtime.maintenance import schedule_due

from support import query

NY = "America/New_York"


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


@pytest.mark.parametrize(("expr", "message"), [
    ("* * * *", "expected 5 fields"),
    ("60 * * * *", "minute field '60' is outside 0..59"),
    ("* 24 * * *", "hour field"),
    ("* * 0 * *", "day of month"),
    ("* * * 13 *", "month"),
    ("* * * * 8", "day of week"),
    ("*/0 * * * *", "minute field"),
    ("a * * * *", "not a number"),
    ("5- * * * *", "not a number"),
    ("\u0665 * * * *", "not a number"),
    ("0 0 30 2 *", "matches no day"),
])
def test_bad_expressions_name_the_field(expr: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        CronSchedule(expr)


def test_unknown_zone() -> None:
    with pytest.raises(ValidationError, match="unknown time zone"):
        CronSchedule("* * * * *", "Mars/Olympus")


def test_syntax_forms() -> None:
    s = CronSchedule("0,30 9-10 * jan-feb mon-fri")
    slots = s.slots(utc(2025, 1, 3, 0), utc(2025, 1, 7, 0))  # Fri 3 .. Mon 6 Jan 2025
    assert [x.strftime("%a %H:%M") for x in slots] == [
        "Fri 09:00", "Fri 09:30", "Fri 10:00", "Fri 10:30",
        "Mon 09:00", "Mon 09:30", "Mon 10:00", "Mon 10:30"]
    assert CronSchedule("@daily").slots(utc(2025, 1, 1), utc(2025, 1, 3)) == [
        utc(2025, 1, 2), utc(2025, 1, 3)]
    # both day fields restricted: either matches (the 1st, or any Sunday)
    days = CronSchedule("0 0 1 * sun").slots(utc(2025, 6, 1), utc(2025, 6, 30))
    assert [d.day for d in days] == [8, 15, 22, 29]


def test_fc15_dst_spring_forward() -> None:
    after, until = utc(2025, 3, 8, 5), utc(2025, 3, 10, 5)  # local midnights around the change
    at_230 = CronSchedule("30 2 * * *", NY).slots(after, until)
    assert len(at_230) == 2  # one on the 8th, exactly one on the 9th (02:30 does not exist)
    assert at_230[1] == utc(2025, 3, 9, 7, 30)  # 03:30 EDT: moved forward by the gap
    quarter = CronSchedule("*/15 * * * *", NY).slots(after, until)
    gaps = {(b - a).total_seconds() for a, b in pairwise(quarter)}
    assert gaps == {900.0}
    six_pm = CronSchedule("0 18 * * *", NY).slots(after, until)
    assert [s.hour for s in six_pm] == [23, 22]  # 18:00 EST = 23:00 UTC, EDT = 22:00 UTC


def test_fc15_dst_fall_back() -> None:
    after, until = utc(2025, 11, 1, 4), utc(2025, 11, 3, 5)
    at_130 = CronSchedule("30 1 * * *", NY).slots(after, until)
    on_2nd = [s for s in at_130 if s.date() == datetime(2025, 11, 2).date()]
    assert on_2nd == [utc(2025, 11, 2, 5, 30)]  # once, at the first 01:30 (EDT)
    quarter = CronSchedule("*/15 * * * *", NY).slots(after, until)
    gaps = {(b - a).total_seconds() for a, b in pairwise(quarter)}
    assert gaps == {900.0}
    six_pm = CronSchedule("0 18 * * *", NY).slots(after, until)
    assert [s.hour for s in six_pm] == [22, 23]


def _entry(app: App, expr: str = "* * * * *", grace: float = 600.0) -> CronEntry:
    task = app.tasks.get("tick") or app.task(name="tick")(lambda: None)
    return CronEntry("tick", CronSchedule(expr), task, {}, grace)


def test_fc14_misfire_policy(app: App) -> None:
    minute = _entry(app)
    # (a) down 12:00:50-12:03:20: one catch-up (12:03), 12:01 and 12:02 recorded missed
    slot, missed = plan(minute, utc(2025, 1, 1, 12, 0), utc(2025, 1, 1, 12, 3, 20))
    assert slot == utc(2025, 1, 1, 12, 3) and missed == [utc(2025, 1, 1, 12, 1),
                                                         utc(2025, 1, 1, 12, 2)]
    # (b) a daily job whose slot passed 20 s ago runs once
    daily = _entry(app, "0 0 * * *")
    assert plan(daily, utc(2025, 1, 1), utc(2025, 1, 2, 0, 0, 20)) == (utc(2025, 1, 2), [])
    # (d) six hours down: no burst; everything outside the grace period is missed
    slot, missed = plan(minute, utc(2025, 1, 1, 6), utc(2025, 1, 1, 12, 0, 5))
    assert slot == utc(2025, 1, 1, 12) and len(missed) == 359
    stale, missed = plan(_entry(app, "0 0 * * *", grace=60), utc(2025, 1, 1),
                         utc(2025, 1, 2, 6))
    assert stale is None and missed == [utc(2025, 1, 2)]
    # (e) a new schedule runs its latest slot within the grace period and records no misses
    assert plan(minute, None, utc(2025, 1, 1, 12, 5, 30)) == (utc(2025, 1, 1, 12, 5), [])
    assert plan(_entry(app, "0 0 * * *", grace=60), None, utc(2025, 1, 2, 6)) == (None, [])


def test_fc13_three_schedulers_one_job_per_slot(app: App) -> None:
    """Three schedulers race over 30 simulated minutes, some "dying" mid-transaction and
    coming back; every slot gets exactly one job, enforced by the (name, slot) key."""
    app.task(name="tick")(lambda: None)
    app.cron("* * * * *", name="tick")(app.tasks["tick"])
    start = utc(2030, 1, 1, 12)
    rng = random.Random(3)
    for minute in range(30):
        now = start + timedelta(minutes=minute, seconds=rng.uniform(0, 50))
        barrier = threading.Barrier(3)
        errors: list[BaseException] = []

        def scheduler(now: datetime = now, barrier: threading.Barrier = barrier,
                      errors: list[BaseException] = errors) -> None:
            try:
                with psycopg.connect(app.dsn, autocommit=True) as conn:
                    barrier.wait()
                    if rng.random() < 0.2:  # dies after claiming a slot, before commit
                        with conn.transaction():
                            conn.execute(app.queries.CRON_CLAIM_SLOT,
                                         {"name": "tick", "slot": now.replace(second=0)})
                            raise psycopg.Rollback()
                    schedule_due(app, conn, now=now)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=scheduler) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
    rows = query(app.dsn, "SELECT idempotency_key, count(*) FROM {schema}.jobs GROUP BY 1",
                 schema=app.schema)
    assert len(rows) == 30 and {n for _, n in rows} == {1}
    slots = query(app.dsn, "SELECT count(*) FROM {schema}.cron_slots WHERE status = 'enqueued'",
                  schema=app.schema)
    assert slots == [(30,)]


def test_cron_declaration_errors(app: App) -> None:
    task = app.task(name="t")(lambda x: None)
    with pytest.raises(ValidationError, match="above @app.task"):
        app.cron("* * * * *")(lambda: None)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="args"):
        app.cron("* * * * *", args={"x": float("nan")})(task)
    app.cron("* * * * *", args={"x": 1})(task)
    with pytest.raises(ValidationError, match="already scheduled"):
        app.cron("0 * * * *")(task)


def test_cron_args_reach_the_job(app: App) -> None:
    task = app.task(name="report")(lambda **kw: None)
    app.cron("0 * * * *", args={"kind": "hourly"})(task)
    with psycopg.connect(app.dsn, autocommit=True) as conn:
        assert schedule_due(app, conn, now=utc(2030, 1, 1, 13, 0, 10)) == 1
        assert schedule_due(app, conn, now=utc(2030, 1, 1, 13, 0, 40)) == 0
    rows: list[Any] = query(app.dsn, "SELECT args, idempotency_key FROM {schema}.jobs",
                            schema=app.schema)
    assert rows == [({"kind": "hourly"}, "cron:report:2030-01-01T13:00:00+00:00")]
