"""The overview's charts, drawn on the server as SVG shapes (no script, no chart library):
finished jobs per minute by final state as stacked bars, and the start latency (mean and
maximum per bucket) as lines, from the rows of ``skipjack.App.throughput``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

WIDTH, HEIGHT = 600.0, 150.0
LEFT, RIGHT, TOP, BOTTOM = 48.0, 8.0, 8.0, 20.0
STATES = ("succeeded", "discarded", "cancelled")  # bottom to top
ORIGIN = datetime(2000, 1, 1, tzinfo=UTC)  # where the database aligns its buckets


@dataclass(frozen=True)
class Rect:
    """A bar segment; ``state`` names its CSS class, ``title`` its tooltip."""

    x: float
    y: float
    width: float
    height: float
    state: str
    title: str


@dataclass(frozen=True)
class Line:
    """A polyline with a dot at each point: ``points`` is SVG's "x,y x,y" text, ``dots``
    the same points as pairs; ``name`` its CSS class."""

    name: str
    points: str
    dots: list[tuple[str, str]]


@dataclass(frozen=True)
class Tick:
    """An axis label at ``x``/``y``."""

    x: float
    y: float
    text: str


@dataclass
class Chart:
    """What a chart template draws, in a WIDTH x HEIGHT view box."""

    title: str
    unit: str
    rects: list[Rect] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    x_ticks: list[Tick] = field(default_factory=list)
    y_ticks: list[Tick] = field(default_factory=list)
    empty: bool = True
    width: float = WIDTH
    height: float = HEIGHT


def buckets(now: datetime, span: timedelta, bucket: timedelta) -> list[datetime]:
    """The starts of the buckets covering ``[now - span, now]``, aligned as the database's
    ``date_bin(bucket, t, '2000-01-01')``."""
    first = ORIGIN + ((now - span - ORIGIN) // bucket) * bucket
    count = int((now - first) / bucket) + 1
    return [first + i * bucket for i in range(count)]


def _scale(top: float) -> tuple[float, list[float]]:
    """A round axis maximum at or above ``top`` and its tick values."""
    if top <= 0:
        return 1.0, [0.0, 1.0]
    step = 10 ** math.floor(math.log10(top))
    for factor in (1, 2, 5, 10):
        if top <= step * factor:
            limit = step * factor
            break
    return limit, [0.0, limit / 2, limit]


def _number(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:g} s"
    return f"{value * 1000:g} ms"


def _x_ticks(starts: list[datetime], slot: float) -> list[Tick]:
    every = max(1, len(starts) // 6)
    return [Tick(LEFT + i * slot, HEIGHT - 5, start.strftime("%H:%M"))
            for i, start in enumerate(starts)
            if i % every == 0 and LEFT + i * slot < WIDTH - RIGHT - 30]


def _index(rows: Iterable[Mapping[str, Any]]) -> dict[datetime, dict[str, Mapping[str, Any]]]:
    by_start: dict[datetime, dict[str, Mapping[str, Any]]] = {}
    for row in rows:
        by_start.setdefault(row["at"].astimezone(UTC), {})[row["state"]] = row
    return by_start


def throughput_chart(title: str, rows: Iterable[Mapping[str, Any]], *, now: datetime,
                     span: timedelta, bucket: timedelta) -> Chart:
    """Finished jobs per minute (a bucket's count over its minutes), stacked by state."""
    starts = buckets(now, span, bucket)
    by_start = _index(rows)
    minutes = bucket / timedelta(minutes=1)
    rates = [{s: by_start.get(t, {}).get(s, {}).get("jobs", 0) / minutes for s in STATES}
             for t in starts]
    top, ticks = _scale(max((sum(r.values()) for r in rates), default=0.0))
    chart = Chart(title, "jobs/min")
    plot_h = HEIGHT - TOP - BOTTOM
    slot = (WIDTH - LEFT - RIGHT) / len(starts)
    for i, (start, rate) in enumerate(zip(starts, rates, strict=True)):
        base = HEIGHT - BOTTOM
        for state in STATES:
            if rate[state] <= 0:
                continue
            chart.empty = False
            h = max(0.5, rate[state] / top * plot_h)
            base -= h
            chart.rects.append(Rect(round(LEFT + i * slot + 0.5, 2), round(base, 2),
                                    round(max(slot - 1, 0.5), 2), round(h, 2), state,
                                    f"{start:%Y-%m-%d %H:%M}Z {state}: {rate[state]:.4g}/min"))
    chart.y_ticks = [Tick(LEFT - 4, HEIGHT - BOTTOM - v / top * plot_h + 3, _number(v))
                     for v in ticks]
    chart.x_ticks = _x_ticks(starts, slot)
    return chart


def latency_chart(title: str, rows: Iterable[Mapping[str, Any]], *, now: datetime,
                  span: timedelta, bucket: timedelta) -> Chart:
    """Seconds from run_at to start, mean and maximum per bucket, over every final state."""
    starts = buckets(now, span, bucket)
    by_start = _index(rows)
    means: list[float | None] = []
    maxima: list[float | None] = []
    for t in starts:
        states = by_start.get(t, {}).values()
        started = sum(r["started"] for r in states)
        means.append(sum(r["latency_sum"] for r in states) / started if started else None)
        peaks = [r["latency_max"] for r in states if r["latency_max"] is not None]
        maxima.append(max(peaks) if peaks else None)
    top, ticks = _scale(max((m for m in maxima if m is not None), default=0.0))
    chart = Chart(title, "seconds")
    plot_h = HEIGHT - TOP - BOTTOM
    slot = (WIDTH - LEFT - RIGHT) / len(starts)
    for name, values in (("max", maxima), ("mean", means)):
        dots = [(f"{LEFT + (i + 0.5) * slot:.1f}", f"{HEIGHT - BOTTOM - v / top * plot_h:.1f}")
                for i, v in enumerate(values) if v is not None]
        if dots:
            chart.empty = False
            chart.lines.append(Line(name, " ".join(f"{x},{y}" for x, y in dots), dots))
    chart.y_ticks = [Tick(LEFT - 4, HEIGHT - BOTTOM - v / top * plot_h + 3, _seconds(v))
                     for v in ticks]
    chart.x_ticks = _x_ticks(starts, slot)
    return chart
