"""The worker's event loop: asyncio's selector loop, with timers that fire on time.

On Linux asyncio waits for I/O and timers with epoll, whose timeout is a whole number of
milliseconds: CPython rounds the wait up to the next millisecond, so a timer due in 1.2 ms fires
after 2 ms. In a busy worker, timers fall due at scattered moments and a handler's
``await asyncio.sleep(0.002)`` lasted 2.65-2.7 ms on average (W4 of ``skipjack bench``, see
docs/performance.md; 2.14 ms with this selector). :class:`PreciseEpollSelector` waits with
select(2) on the epoll descriptor itself, whose timeout is in microseconds (the descriptor
becomes readable when any registered one has events), then collects the events with a
zero-timeout epoll wait: one extra system call per wait that has a timeout.
"""

from __future__ import annotations

import asyncio
import select
import selectors

_FD_SETSIZE = 1024  # select(2) cannot wait on a higher descriptor


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
    :class:`PreciseEpollSelector` on Linux, else asyncio's default loop."""
    if hasattr(selectors, "EpollSelector"):
        selector = PreciseEpollSelector()
        if selector.fileno() < _FD_SETSIZE:
            return asyncio.SelectorEventLoop(selector)
        selector.close()
    return asyncio.new_event_loop()
