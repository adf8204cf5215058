"""Unit: the bench's targets table (skipjack_tools.bench.report.targets) sets skipjack's
figures against the limits measured in the same run: W3 against the bare enqueue + pickup
of one row, W1 one at a time against its own statement alone."""

from __future__ import annotations

from typing import Any

from skipjack_tools.bench.report import targets


def _row(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(r for r in rows if r["target"] == name)


def test_w3_and_w1_are_set_against_their_floors_in_the_same_run() -> None:
    results = {
        "skipjack": {
            "raw": {"pickup": {"p50_ms": 0.8, "total_p50_ms": 2.5},
                    "insert_each": {"jobs_per_s": 4000.0}},
            "w3": {"p50_ms": 2.8, "pickup_p50_ms": 1.0},
            "w1": {"single_jobs_per_s": 2400.0, "statement_jobs_per_s": 3000.0},
        },
        "peers": {"oban": {"w3": {"p50": 3.5}}, "pgqueuer": {"w3": {"p50": 4.0}}},
    }
    rows = targets(results)
    floor = _row(rows, "W3 p50: the best peer's / the bare enqueue + pickup's")
    assert floor["value"] == 1.4 and floor["met"] is None  # 3.5 / 2.5: oban is the best
    assert "oban: 3.5" in floor["goal"]
    assert _row(rows, "W3 p50: the best peer's / skipjack's")["value"] == 1.25
    assert _row(rows, "W1 one per call / its statement alone, on a held connection"
                )["value"] == 0.8
    assert _row(rows, "W1's statement alone / bare INSERT + commit")["value"] == 0.75
    assert _row(rows, "W1 one per call / bare INSERT + commit")["met"] is False  # 0.6
