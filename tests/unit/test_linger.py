"""How long the completer lets a small batch of outcomes grow (``runtime.completer.linger``)."""

from __future__ import annotations

import pytest

from skipjack.runtime.completer import LINGER, LINGER_GAIN, LINGER_MAX, LINGER_OUTCOMES, linger


def test_short_jobs_on_many_slots_and_slow_jobs_keep_the_base_linger() -> None:
    assert linger(None, 1) == LINGER  # no job has ended yet
    assert linger(0.0001, 100) == LINGER  # no-op jobs: 5 ms gather hundreds already
    assert linger(0.002, 8) == LINGER  # 2 ms jobs on 8 slots: 2 ms would gather 8
    assert linger(1.0, 1) == LINGER  # seconds-long jobs: waiting would gather nothing


@pytest.mark.parametrize(("run_time", "concurrency"), [(0.002, 1), (0.001, 1), (0.005, 4)])
def test_few_slots_of_short_jobs_wait_until_they_finish_enough_to_share_a_statement(
        run_time: float, concurrency: int) -> None:
    wait = linger(run_time, concurrency)
    assert LINGER < wait <= LINGER_MAX
    assert wait == pytest.approx(LINGER_OUTCOMES * run_time / concurrency)


@pytest.mark.parametrize(("run_time", "concurrency"), [(0.0026, 1), (0.005, 1), (0.012, 4)])
def test_slots_that_would_fill_a_batch_only_past_the_longest_wait_wait_that_long(
        run_time: float, concurrency: int) -> None:
    """Past LINGER_MAX the wait is capped, not dropped to the base linger, while the slots
    still finish LINGER_GAIN jobs within it: 2 ms handlers that ran 2.6 ms on one slot
    waited 5 ms before (under 3 outcomes a statement)."""
    assert LINGER_OUTCOMES * run_time / concurrency > LINGER_MAX
    assert linger(run_time, concurrency) == LINGER_MAX


def test_slots_finishing_few_jobs_in_the_longest_wait_keep_the_base_linger() -> None:
    run_time = LINGER_MAX / LINGER_GAIN * 1.01  # just under LINGER_GAIN jobs in LINGER_MAX
    assert linger(run_time, 1) == LINGER
    assert linger(run_time / 1.02, 1) == LINGER_MAX  # just over: the capped wait
