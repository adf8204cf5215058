"""The worker's event loop: asyncio's selector loop, with timers that fire on time.

On Linux asyncio waits for I/O and timers with epoll, whose timeout is a whole number of
milliseconds: CPython rounds the wait up to the next millisecond, so a timer due in 1.2 ms fires
after 2 ms. In a busy worker, timers fall due at scattered moments and a handler's
``await asyncio.sleep(0.002)`` lasted 2.65-2.7 ms on average (W4 of ``skipjack bench``, see
docs/performance.md; 2.14 ms with this selector). ``PreciseEpollSelector`` waits with
select(2) on the epoll descriptor itself, whose timeout is in microseconds (the descriptor
becomes readable when any registered one has events), then collects the events with a
zero-timeout epoll wait: one extra system call per wait that has a timeout.

Linux may also end a timed wait up to the thread's timer slack late (50 us by default, to
batch wake-ups); ``new_event_loop`` lowers it to 1 us for the calling thread and the
threads it starts (the handlers' pool): with it W4 went from about 3,650 to 3,740 jobs/s.
"""

from __future__ import annotations

import asyncio
import ctypes
import select
import selectors
import sys

_FD_SETSIZE = 1024  # select(2) cannot wait on a higher descriptor
_PR_SET_TIMERSLACK = 29  # prctl(2)
_TIMER_SLACK_NS = 1000


if hasattr(selectors, "EpollSelector"):

    class PreciseEpollSelector(selectors.EpollSelector):
        """An epoll selector whose timed waits end on time (to the microsecond, not the next
        whole millisecond). Used only while its epoll descriptor is below 1024."""

        def select(
            self, timeout: float | None = None
        ) -> list[tuple[selectors.SelectorKey, int]]:
            if timeout is not None and timeout > 0:
                select.select([self.fileno()], [], [], timeout)
                timeout = 0
            return super().select(timeout)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop for a worker: asyncio's selector loop with
    ``PreciseEpollSelector`` on Linux (and the calling thread's timer slack lowered to
    1 us), else asyncio's default loop."""
    if sys.platform == "linux":
        _lower_timer_slack()
    if hasattr(selectors, "EpollSelector"):
        selector = PreciseEpollSelector()
        if selector.fileno() < _FD_SETSIZE:
            return asyncio.SelectorEventLoop(selector)
        selector.close()
    return asyncio.new_event_loop()


def _lower_timer_slack() -> None:
    """prctl(PR_SET_TIMERSLACK) for the calling thread; left as it is where that fails."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS, 0, 0, 0)
    except (OSError, AttributeError):
        pass
