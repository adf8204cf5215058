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


@dataclass(frozen=True)
class Backoff:
    """Retry delay policy.

    Args:
        base: seconds; the delay ceiling after attempt 1 is ``2 * base``. > 0.
        cap: seconds; no delay exceeds it. >= base.
        jitter: when False, the delay is the ceiling itself (deterministic; use only for tests
            and benchmarks, it brings back retry storms).

    Raises:
        ValidationError: base <= 0, cap < base, or either is not finite.
    """

    base: float = 1.0
    cap: float = 3600.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base) and self.base > 0):
            raise ValidationError("backoff.base", f"must be a finite number > 0, got {self.base!r}")
        if not (math.isfinite(self.cap) and self.cap >= self.base):
            raise ValidationError(
                "backoff.cap", f"must be finite and >= base ({self.base}), got {self.cap!r}"
            )

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
