"""The worker's event loop: timed waits end on time and I/O still wakes them."""

from __future__ import annotations

import asyncio
import ctypes
import selectors
import socket
import threading
import time

import pytest

from skipjack.runtime import eventloop

pytestmark = pytest.mark.skipif(not hasattr(selectors, "EpollSelector"), reason="Linux only")


def test_the_worker_loop_uses_the_precise_selector() -> None:
    loop = eventloop.new_event_loop()
    try:
        assert isinstance(loop._selector, eventloop.PreciseEpollSelector)  # type: ignore[attr-defined]
    finally:
        loop.close()


def test_timers_never_fire_early() -> None:
    async def main() -> list[float]:
        late = []
        for delay in (0.0003, 0.0012, 0.0017, 0.002, 0.0105):
            started = time.perf_counter()
            await asyncio.sleep(delay)
            late.append(time.perf_counter() - started - delay)
        return late

    with asyncio.Runner(loop_factory=eventloop.new_event_loop) as runner:
        assert min(runner.run(main())) >= 0


def test_io_wakes_a_wait_that_has_a_long_timeout() -> None:
    """A reader becomes ready while the loop waits on a timer an hour away."""
    left, right = socket.socketpair()

    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        loop.call_later(3600, lambda: None)  # the loop's wait now has a timeout
        received: asyncio.Future[bytes] = loop.create_future()
        loop.add_reader(left, lambda: received.set_result(left.recv(16)))
        threading.Timer(0.05, right.send, [b"ping"]).start()
        try:
            return await asyncio.wait_for(received, 30)
        finally:
            loop.remove_reader(left)

    try:
        with asyncio.Runner(loop_factory=eventloop.new_event_loop) as runner:
            assert runner.run(main()) == b"ping"
    finally:
        left.close()
        right.close()


def test_the_worker_loop_lowers_its_threads_timer_slack() -> None:
    """Linux may end a timed wait up to the thread's timer slack late (50 us by default)."""
    seen: list[int] = []

    def make_loop() -> None:
        eventloop.new_event_loop().close()
        seen.append(ctypes.CDLL(None).prctl(30, 0, 0, 0, 0))  # PR_GET_TIMERSLACK

    thread = threading.Thread(target=make_loop)
    thread.start()
    thread.join(30)
    assert seen == [1000]
