"""Unit: skipjack.outcome.decide turns a handler's result, exception or cancellation into the
outcome that is recorded (no database)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from skipjack import App, Backoff, Discard, Snooze
from skipjack.app import Task
from skipjack.context import Job
from skipjack.outcome import decide

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def job(attempt: int = 3) -> Job:
    return Job(7, "q", "t", {}, 0, attempt, 25, 1234, NOW, NOW, NOW, None, 30.0)


def task(transaction: str = "none", backoff: Backoff | None = None) -> Task:
    app = App("postgresql://unused", schema="unit")
    return app.task(name=f"t_{transaction}", transaction=transaction,
                    backoff=backoff)(lambda: None)


def test_a_result_completes_with_its_json() -> None:
    o = decide(job(), task(), result={"sent": 2})
    assert o is not None and o.kind == "complete" and json.loads(o.result or "") == {"sent": 2}
    assert (o.id, o.lease_version, o.queue) == (7, 1234, "q")


def test_an_exception_retries_after_the_tasks_backoff_for_this_attempt() -> None:
    policy = Backoff(base=2.0, cap=1000.0)
    o = decide(job(attempt=3), task(backoff=policy), error=ValueError("boom"))
    assert o is not None and o.kind == "retry"
    assert policy.ceiling(3) / 2 <= o.delay <= policy.ceiling(3) == 16.0
    error = json.loads(o.error or "")
    assert error["attempt"] == 3 and error["error"] == "ValueError: boom"
    assert "ValueError" in error["traceback"]


def test_an_unknown_task_is_released_until_its_grace_is_over_then_discarded() -> None:
    young = job(attempt=1)
    released = decide(young, None, error=LookupError("t"), unknown_task_grace=600)
    assert released is not None and released.kind == "release" and released.delay == 10.0
    assert "unknown task 't'" in json.loads(released.error or "")["error"]
    old = Job(7, "q", "t", {}, 0, 1, 25, 1234, NOW, NOW, NOW + timedelta(seconds=601), None, 30)
    discarded = decide(old, None, error=LookupError("t"), unknown_task_grace=600)
    assert discarded is not None and discarded.kind == "discard"
    short = decide(young, None, error=LookupError("t"), unknown_task_grace=4)
    assert short is not None and short.delay == 2.0  # at most half the grace


def test_snooze_releases_after_its_delay_and_discard_goes_to_the_dead_letter() -> None:
    snoozed = decide(job(), task(), error=Snooze(42))
    assert snoozed is not None and (snoozed.kind, snoozed.delay) == ("release", 42.0)
    assert snoozed.error is None
    discarded = decide(job(), task(), error=Discard("bad payload"))
    assert discarded is not None and discarded.kind == "discard"
    assert json.loads(discarded.error or "")["error"] == "Discard: bad payload"


@pytest.mark.parametrize(("mode", "kind"), [("complete", "release"), ("claim", "release"),
                                            ("none", "retry")])
def test_a_lost_connection_is_not_the_jobs_fault_only_under_its_own_transaction(
        mode: str, kind: str) -> None:
    o = decide(job(), task(mode), error=psycopg.OperationalError("server closed"))
    assert o is not None and o.kind == kind and o.error is not None


def test_a_statement_the_database_refused_is_the_jobs_fault() -> None:
    o = decide(job(), task("complete"), error=psycopg.errors.QueryCanceled("timeout"))
    assert o is not None and o.kind == "retry"


@pytest.mark.parametrize(("cause", "kind"), [("cancel requested", "cancel"),
                                             ("shutdown", "release"),
                                             ("timed out", "retry")])
def test_a_cancellation_decides_before_the_result_or_error(cause: str, kind: str) -> None:
    for outcome in (decide(job(), task(), result="done", cancelled=(cause, "why")),
                    decide(job(), task(), error=ValueError(),
                           cancelled=(cause, "why"))):
        assert outcome is not None and outcome.kind == kind
    timed_out = decide(job(), task(), cancelled=("timed out", "timed out after 5s"))
    assert timed_out is not None
    assert json.loads(timed_out.error or "")["error"] == "TimeoutError: timed out after 5s"
    released = decide(job(), task(), cancelled=("shutdown", "worker shutting down"))
    assert released is not None and released.delay == 0 and released.error is None


def test_a_lost_lease_records_nothing() -> None:
    assert decide(job(), task(), result=1, cancelled=("lease lost", "rescued")) is None
    assert decide(job(), task(), error=ValueError(), cancelled=("lease lost", "x")) is None


def test_a_stored_traceback_starts_at_the_frame_that_called_the_handler() -> None:
    # frames compiled as if in skipjack's package: the worker's own, which led to the handler
    import os

    import skipjack
    from skipjack.outcome import error_json

    own = os.path.join(os.path.dirname(skipjack.__file__), "runtime", "executor.py")
    worker: dict[str, object] = {}
    exec(compile("def run(f):\n    f()\n\ndef call(f):\n    run(f)\n\n"
                 "def execute(f):\n    try:\n        call(f)\n"
                 "    except Exception as exc:\n        return exc\n\n"
                 "def fail():\n    raise KeyError('own')\n", own, "exec"), worker)

    def handler() -> None:
        raise ValueError("the handler's")

    def frames(fn: object) -> list[str]:
        exc = worker["execute"](fn)  # type: ignore[operator]
        tb = json.loads(error_json(job(), exc))["traceback"]
        return [line.split(", in ")[-1] for line in tb.splitlines()
                if line.startswith('  File "')]

    # the worker's frame that called the handler, then the handler's
    assert frames(handler) == ["run", "handler"]
    # every frame skipjack's: all of them
    assert frames(worker["fail"]) == ["execute", "call", "run", "fail"]
