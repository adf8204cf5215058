"""W1 enqueue: one job per call (each its own commit), and one call of 10,000 jobs."""

from __future__ import annotations

import time
from typing import Any

from .common import Settings, fresh_app, repeat
from .tasks import register


def _once(settings: Settings, single: int, bulk: int) -> dict[str, Any]:
    with fresh_app(settings.dsn, "w1") as app:
        noop = register(app)["noop"]
        noop.enqueue(i=-1)  # opens the pool's connection: not part of the measure
        started = time.perf_counter()
        for i in range(single):
            noop.enqueue(i=i)
        single_s = time.perf_counter() - started
        started = time.perf_counter()
        app.enqueue_many(noop.job(i=i) for i in range(bulk))
        bulk_s = time.perf_counter() - started
    return {"single_jobs_per_s": round(single / single_s, 1),
            "bulk_jobs_per_s": round(bulk / bulk_s, 1)}


def run(settings: Settings) -> dict[str, Any]:
    """W1 for skipjack: medians of ``settings.runs`` runs.

    One at a time is ``Task.enqueue`` (a pooled connection, one INSERT and one commit per
    job); bulk is one ``App.enqueue_many`` of 10,000 jobs from a generator (one
    transaction; the specs are built, validated and serialised while earlier statements run),
    timed with building the job specs.
    """
    single, bulk = settings.n(2000), settings.n(10_000)
    settings.log(f"W1 enqueue: {single} one at a time, {bulk} in one call")
    result = repeat(settings.runs, lambda: _once(settings, single, bulk))
    result.update(single_jobs=single, bulk_jobs=bulk)
    return result
