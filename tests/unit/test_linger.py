"""How long the completer lets a small batch of outcomes grow (``runtime.completer.linger``)."""

from __future__ import annotations

import pytest

from skipjack.runtime.completer import LINGER, LINGER_MAX, LINGER_OUTCOMES, linger


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
