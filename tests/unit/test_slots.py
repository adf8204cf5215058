"""Unit: the worker's capacity accounting (skipjack.runtime.slots, no database)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from skipjack.context import Job, JobContext
from skipjack.runtime import slots as slots_module
from skipjack.runtime.slots import MAX_PREFETCH, PAUSE_WARNING_INTERVAL, Running, Slots

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def job(job_id: int) -> Job:
    return Job(job_id, "q", "t", {}, 0, 1, 25, 1, NOW, NOW, NOW, None, 30.0)


def test_room_is_free_slots_plus_free_prefetch_places() -> None:
    """A claim-mode runner's slot is busy but counts as free for claims (the runner gives it
    back after its job while claimed jobs wait)."""
    slots = Slots(concurrency=4, prefetch=4)
    assert slots.room(0) == 8 and slots.has_free_slot()
    slots.running[1] = Running(job(1), JobContext(job(1)))
    slots.claim_mode = 1
    slots.stuck_threads = 1
    assert slots.busy() == 3 and slots.room(0) == 6
    slots.ready[2] = job(2)
    assert slots.room(0) == 5


def test_a_buffer_over_half_full_claims_nothing_until_it_drains() -> None:
    slots = Slots(concurrency=2, prefetch=4)
    for i in range(3):
        slots.ready[i] = job(i)
    assert slots.room(0) == 0  # 3 > 4 // 2: wait, so claims come in batches
    assert not slots.claimable()  # a freed slot does not wake the claim loop
    del slots.ready[0]
    assert slots.room(0) == 4  # 2 + 4 - 0 busy - 2 waiting
    assert slots.claimable()
    assert slots.room(1000) == 0 and slots.claimable()  # outcomes pause claims, not this


def test_full_slots_leave_no_free_slot() -> None:
    slots = Slots(concurrency=1, prefetch=0)
    slots.stuck_threads = 1
    assert not slots.has_free_slot() and slots.room(0) == 0


def test_unwritten_outcomes_pause_claims_until_they_are_written() -> None:
    slots = Slots(concurrency=10, prefetch=10)
    assert slots.max_unwritten == 1000  # 10 x slots + 2 buffers, at least 1,000
    assert Slots(concurrency=200, prefetch=100).max_unwritten == 2200
    assert Slots(concurrency=10, prefetch=None).max_unwritten == 2100  # the largest buffer
    assert slots.room(999) == 20 and not slots.claims_paused
    assert slots.room(1000) == 0 and slots.claims_paused
    assert slots.room(999) == 0 and slots.room(501) == 0  # until half as many wait
    assert slots.room(500) == 20 and not slots.claims_paused
    assert slots.room(999) == 20


def test_a_pause_is_warned_at_most_once_a_minute_with_the_pauses_since(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    monkeypatch.setattr(slots_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    caplog.set_level(logging.INFO, logger="skipjack.worker")
    slots = Slots(concurrency=10, prefetch=10)

    def pause_and_resume() -> None:
        assert slots.room(1000) == 0 and slots.claims_paused
        assert slots.room(0) == 20 and not slots.claims_paused

    pause_and_resume()
    now[0] += 1
    pause_and_resume()
    pause_and_resume()
    now[0] += PAUSE_WARNING_INTERVAL
    pause_and_resume()
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert messages == [
        ("WARNING", "1000 outcomes wait to be written; claiming paused until no more than 500 do"),
        ("INFO", "outcomes written; claiming again"),
        ("WARNING", "1000 outcomes wait to be written; claiming paused until no more than 500 do"
                    " (2 more pauses since the last such warning)"),
        ("INFO", "outcomes written; claiming again"),
    ]


def test_adaptive_prefetch_follows_the_handlers_run_time() -> None:
    slots = Slots(concurrency=10, prefetch=None)
    assert slots.prefetch == 0 and slots.room(0) == 10  # nothing known yet: the slots only
    slots.ran(0.00001)  # 10 us no-op handlers: 10 slots finish 50,000 in the horizon
    assert slots.prefetch == MAX_PREFETCH
    slots.run_time = None
    slots.ran(0.002)  # 2 ms jobs: 10 * 0.05 / 0.002
    assert slots.prefetch == 250
    for _ in range(200):  # the average follows a change to 1 s jobs
        slots.ran(1.0)
    assert slots.prefetch == 0 and slots.room(0) == 10
    slots.ran(0.0)
    assert slots.prefetch == 0  # one fast job moves the average only by its weight


def test_a_fixed_prefetch_does_not_adapt() -> None:
    slots = Slots(concurrency=10, prefetch=7)
    slots.ran(0.00001)
    assert slots.prefetch == 7 and slots.run_time == 0.00001
