"""Durations written with a unit, the one parser of every duration the command line, the
environment and the framework settings take: ``500ms``, ``30s``, ``5m``, ``12h``, ``7d``, or
a plain number of seconds."""

from __future__ import annotations

import math

UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: str | float) -> float:
    """Seconds from ``value``: a number of seconds, or text such as ``500ms``, ``2s``,
    ``5m``, ``12h``, ``7d`` or ``"90"`` (surrounding blanks and letter case do not matter).

    Raises:
        ValueError: not a finite number >= 0, alone or with one of those units.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration like 2s, 500ms or 7d")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        unit = next((u for u in ("ms", "s", "m", "h", "d") if text.endswith(u)), None)
        number = text[: -len(unit)] if unit else text
        try:
            seconds = float(number) * (UNITS[unit] if unit else 1.0)
        except ValueError:
            raise ValueError(f"{value!r} is not a duration like 2s, 500ms or 7d") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{value!r} is not a duration like 2s, 500ms or 7d (a finite "
                         f"number of seconds >= 0)")
    return seconds
