"""W1 enqueue: one job per call (each its own commit), and calls of 10,000 jobs each."""

from __future__ import annotations

import time
from typing import Any

from skipjack.enqueue import insert_statement

from .common import BULK_CALLS, Settings, connect, fresh_app, median, repeat
from .tasks import register


def _once(settings: Settings, single: int, bulk: int) -> dict[str, Any]:
    with fresh_app(settings.dsn, "w1") as app:
        noop = register(app)["noop"]
        noop.enqueue(i=-1)  # opens the pool's connection: not part of the measure
        started = time.perf_counter()
        for i in range(single):
            noop.enqueue(i=i)
        single_s = time.perf_counter() - started
        # the same statement, built once and sent again and again on a connection held open:
        # what the server and the driver take for one enqueue, without skipjack's Python
        statement, params = insert_statement(app.queries, [noop.job(i=0)])
        with connect(app.dsn) as conn:
            started = time.perf_counter()
            for _ in range(single):
                conn.execute(statement, params)
            statement_s = time.perf_counter() - started
        calls = []
        for _ in range(BULK_CALLS):
            started = time.perf_counter()
            app.enqueue_many(noop.job(i=i) for i in range(bulk))
            calls.append(round(bulk / (time.perf_counter() - started), 1))
    return {"single_jobs_per_s": round(single / single_s, 1),
            "statement_jobs_per_s": round(single / statement_s, 1),
            "bulk_jobs_per_s": median(calls), "bulk_calls": calls}


def run(settings: Settings) -> dict[str, Any]:
    """W1 for skipjack: medians of ``settings.runs`` runs.

    One at a time is ``Task.enqueue`` (a pooled connection, one INSERT and one commit per
    job); ``statement_jobs_per_s`` is its statement alone, built once and executed as many
    times on a connection held open (W1 one at a time's bound, skipjack's own row); bulk is
    ``App.enqueue_many`` of 10,000 jobs from a generator (one transaction; the specs are
    built, validated and serialised while earlier statements run), timed with building the
    job specs: the median of BULK_CALLS such calls, one after another.
    """
    single, bulk = settings.n(2000), settings.n(10_000)
    settings.log(f"W1 enqueue: {single} one at a time, {BULK_CALLS} calls of {bulk}")
    result = repeat(settings.runs, lambda: _once(settings, single, bulk))
    result.pop("bulk_calls")  # each run's calls stay in its entry of "runs"
    result.update(single_jobs=single, bulk_jobs=bulk, bulk_calls_per_run=BULK_CALLS)
    return result
