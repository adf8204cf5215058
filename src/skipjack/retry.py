"""Retry delays: capped exponential backoff with "equal jitter".

For the attempt that just failed (``attempt`` >= 1)::

    ceiling = min(cap, base * 2 ** attempt)
    delay   = ceiling / 2 + uniform(0, ceiling / 2)

The exponential term is the ``2^attempt`` seconds of the article "PostgreSQL navbat: FOR UPDATE
SKIP LOCKED bilan Redis'siz fon vazifalari" (with ``base`` = 1 s). The jitter is the "equal
jitter" variant of Marc Brooker, "Exponential Backoff And Jitter", AWS Architecture
Blog, 2015: it keeps at least half of the backoff (no immediate retry) while spreading a burst
of failures over the other half, which breaks up retry storms. The exponent is clamped before
it is computed, so no attempt count overflows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .errors import ValidationError

# The longest retry delay, in seconds: a year, as for Snooze; the shortest base, a millisecond.
MAX_RETRY_DELAY = 31_557_600.0
MIN_RETRY_BASE = 0.001


@dataclass(frozen=True)
class Backoff:
    """Retry delay policy.

    Args:
        base: seconds; the delay ceiling after attempt 1 is ``2 * base``. 0.001 <= base <= cap.
        cap: seconds; no delay exceeds it. base <= cap <= 31,557,600 (one year, as for
            ``skipjack.Snooze``).
        jitter: when False, the delay is the ceiling itself (deterministic; use only for tests
            and benchmarks, it brings back retry storms).

    Raises:
        ValidationError: base under a millisecond, cap < base, cap over one year, either not
            a number, or jitter not a bool.
    """

    base: float = 1.0
    cap: float = 3600.0
    jitter: bool = True

    def __post_init__(self) -> None:
        for name in ("base", "cap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValidationError(f"backoff.{name}", f"must be seconds (a number), got "
                                      f"{type(value).__name__}")
        if not (math.isfinite(self.base) and self.base >= MIN_RETRY_BASE):
            raise ValidationError("backoff.base", f"must be a finite number of seconds >= "
                                  f"{MIN_RETRY_BASE}, got {self.base!r}")
        if not isinstance(self.jitter, bool):
            raise ValidationError("backoff.jitter", f"must be a bool, got {self.jitter!r}")
        if not (math.isfinite(self.cap) and self.cap >= self.base):
            raise ValidationError(
                "backoff.cap", f"must be finite and >= base ({self.base}), got {self.cap!r}"
            )
        if self.cap > MAX_RETRY_DELAY:
            raise ValidationError("backoff.cap", f"{self.cap!r} seconds is over the limit of "
                                  f"{MAX_RETRY_DELAY:,.0f} (one year)")

    def ceiling(self, attempt: int) -> float:
        """The largest delay in seconds after ``attempt`` (>= 1) failed."""
        exponent = min(max(attempt, 0), 1024)  # 2.0 ** 1024 overflows; cap long before
        if exponent >= math.log2(self.cap / self.base) + 1:
            return self.cap
        return min(self.cap, self.base * 2.0**exponent)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before the next attempt, after ``attempt`` (>= 1) failed."""
        ceiling = self.ceiling(attempt)
        if not self.jitter:
            return ceiling
        return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)
