"""Hooks without a database: how a hook's context managers are entered and exited around a
handler, and what is stored of the metadata hooks attach."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import pytest

from skipjack import Hook, Job
from skipjack.hooks import EnqueueCall, Hooks

NOW = datetime(2026, 1, 1, tzinfo=UTC)
JOB = Job(1, "q", "t", {}, 0, 1, 3, 7, NOW, NOW, NOW, None, 30.0)


class Seeing(Hook):
    """A generator-based context manager that records what it saw."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    @contextmanager
    def run(self, job: Job) -> Iterator[None]:
        self.seen.append(("enter", job.id))
        try:
            yield
        except Exception as exc:
            self.seen.append(("raised", type(exc).__name__))
            raise
        self.seen.append("returned")


def boom() -> None:
    raise ValueError("the handler fails")


def test_a_run_context_sees_the_handlers_exception_which_still_propagates(
        caplog: pytest.LogCaptureFixture) -> None:
    hook = Seeing()
    hooks = Hooks([hook])
    assert hooks.wrap(JOB, lambda: 42, False)() == 42
    with caplog.at_level(logging.ERROR, logger="skipjack.hooks"), \
            pytest.raises(ValueError, match="the handler fails"):
        hooks.wrap(JOB, boom, False)()
    assert hook.seen == [("enter", 1), "returned", ("enter", 1), ("raised", "ValueError")]
    assert caplog.text == ""  # a context that lets the exception through did not fail


def test_async_handlers_run_inside_the_same_contexts() -> None:
    hook = Seeing()

    async def handler() -> int:
        return 7

    assert asyncio.run(Hooks([hook]).wrap(JOB, handler, True)()) == 7
    assert hook.seen == [("enter", 1), "returned"]


def test_a_context_cannot_swallow_the_handlers_exception() -> None:
    class Swallowing(Hook):
        @contextmanager
        def run(self, job: Job) -> Iterator[None]:
            try:
                yield
            except ValueError:
                pass  # would swallow it

    with pytest.raises(ValueError):
        Hooks([Swallowing()]).wrap(JOB, boom, False)()


def test_without_run_hooks_the_handler_is_called_as_it_is() -> None:
    assert Hooks().wrap(JOB, boom, False) is boom
    assert Hooks([Hook()]).wrap(JOB, boom, False) is boom


def test_only_text_metadata_within_the_limits_is_stored(caplog: pytest.LogCaptureFixture) -> None:
    hooks = Hooks()
    call = EnqueueCall([], False, {"traceparent": "00-ab-cd-01", "n": 1,  # type: ignore[dict-item]
                                   "big": "x" * 2000, "nul": "a\x00b"})
    with caplog.at_level(logging.ERROR, logger="skipjack.hooks"):
        stored = hooks.metadata_json(call)
    assert stored is not None and json.loads(stored) == {"traceparent": "00-ab-cd-01"}
    assert "left out" in caplog.text
    assert hooks.metadata_json(EnqueueCall([], False)) is None


def test_only_hooks_are_accepted() -> None:
    with pytest.raises(TypeError, match="a skipjack.Hook is needed"):
        Hooks([object()])  # type: ignore[list-item]


def test_metadata_that_postgresql_cannot_store_is_left_out() -> None:
    hooks = Hooks()
    stored = hooks.metadata_json(EnqueueCall([], False, {"tenant": "caf\udce9", "\ud800": "x",
                                                         "ok": "yes"}))
    assert stored is not None and json.loads(stored) == {"ok": "yes"}
    not_a_dict = EnqueueCall([], False)
    not_a_dict.metadata = [("a", "b")]  # type: ignore[assignment]
    assert hooks.metadata_json(not_a_dict) is None


def test_an_ended_hook_cannot_end_the_worker(caplog: pytest.LogCaptureFixture) -> None:
    from skipjack import Attempt

    class Exiting(Hook):
        def ended(self, attempt: Attempt) -> None:
            raise SystemExit(3)

    with caplog.at_level(logging.ERROR, logger="skipjack.hooks"):
        Hooks([Exiting()]).ended(Attempt(JOB, "succeeded"))
    assert "Exiting.ended failed" in caplog.text
