"""Unit: the reporter's success lines, at most SUCCESS_LINES_PER_SECOND a second, the rest
counted in one line at the next second (no database)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pytest

from skipjack.context import Job
from skipjack.hooks import Hooks
from skipjack.outcome import Outcome
from skipjack.runtime.report import SUCCESS_LINES_PER_SECOND, Reporter, WorkerStats

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def success(job_id: int) -> Outcome:
    job = Job(job_id, "q", "t", {}, 0, 1, 25, 1, NOW, NOW, NOW, None, 30.0)
    return Outcome(job_id, 1, "q", "complete", job=job, ran=0.001)


def test_past_the_limit_a_second_successes_are_counted_in_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [10.2]
    stats = WorkerStats()
    reporter = Reporter(Hooks(), stats, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="skipjack.jobs")
    for i in range(250):
        reporter.recorded(success(i), "succeeded")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == SUCCESS_LINES_PER_SECOND == 100
    assert lines[0].startswith("job 0 succeeded: t on q, attempt 1/25")
    now[0] = 11.05  # the next second: the count, then this job's own line
    reporter.recorded(success(250), "succeeded")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[100].startswith("150 more jobs succeeded without a line each")
    assert caplog.records[100].count == 150  # type: ignore[attr-defined]
    assert lines[101].startswith("job 250 succeeded")
    reporter.say_unlogged()  # as the worker stops: nothing more to say
    assert len(caplog.records) == 102 and stats.succeeded == 251


def test_debug_logs_every_success(caplog: pytest.LogCaptureFixture) -> None:
    reporter = Reporter(Hooks(), WorkerStats(), clock=lambda: 5.0)
    caplog.set_level(logging.DEBUG, logger="skipjack.jobs")
    for i in range(150):
        reporter.recorded(success(i), "succeeded")
    assert len(caplog.records) == 150
