"""Smoke run of ``skipjack bench --quick``: every scenario runs and reports its figures.

No thresholds: speed is measured by the bench itself, on a quiet machine, not by CI.
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from skipjack.cli import main

from support import Server

SCENARIO_KEYS = {
    "ceiling": {"bare_loop", "pgbench"},
    "w1": {"single_jobs_per_s", "statement_jobs_per_s", "bulk_jobs_per_s", "bulk_calls_per_run"},
    "raw": {"insert_each", "insert_unnest", "take_and_delete", "pickup", "sleep_loops"},
    "w2": {"by_concurrency", "best_jobs_per_s", "best_concurrency", "per_job"},
    "w3": {"p50_ms", "p95_ms", "p99_ms", "max_ms", "samples"},
    "w4": {"one_process", "eight_processes", "jobs_per_s"},
    "w5": {"by_load"},
    "w6": {"methods", "multi_queue"},
    "w7": {"cases"},
    "w8": {"plan", "claim_ms", "claim_ms_during_snapshot"},
    "w9": {"delayed", "retried"},
    "w10": {"by_processes", "concurrency"},
    "memory": {"peak_rss_mib", "idle_rss_mib"},
}


def test_quick_bench_reports_every_scenario(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["--dsn", server.dsn, "bench", "--quick", "--no-plot",
                                       "--output", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {"settings", "machine", "skipjack", "peers", "ratios", "targets"} <= set(data)
    for scenario, keys in SCENARIO_KEYS.items():
        assert keys <= set(data["skipjack"][scenario]), scenario
    assert set(data["skipjack"]["w2"]["by_concurrency"]) == {"1", "10", "100"}
    assert set(data["skipjack"]["w6"]["methods"]) == {"no_lock", "for_update", "skip_locked"}
    raw = data["skipjack"]["raw"]
    assert raw["pickup"]["p50_ms"] > 0 and raw["sleep_loops"]["jobs_per_s"] > 0, raw
    # the bare enqueue + pickup runs from before the INSERT: never shorter than the pickup
    assert raw["pickup"]["total_p50_ms"] >= raw["pickup"]["p50_ms"], raw["pickup"]
    assert data["machine"]["server"]["server_version"]
    # the claim probe (a process of its own) is ready before the drain starts: it times claims
    w10 = data["skipjack"]["w10"]["by_processes"]
    assert all(run["claim_ms"]["p50"] is not None for run in w10.values()), w10
    pgbench = data["skipjack"]["ceiling"]["pgbench"]
    if "skipped" not in pgbench:  # pgbench is installed: every client count ran
        assert all("error" not in run for run in pgbench.values()), pgbench
    hosts = data["skipjack"]["hosts"]  # simulated hosts need root: skipped, saying why
    assert hosts.get("skipped") or set(hosts["by_delay"]) == {"0", "2"}, hosts
    assert all({"target", "value", "goal", "met"} <= set(t) for t in data["targets"])


def test_quick_soak_reports_its_series_and_plot(server: Server, tmp_path: Path) -> None:
    """The soak (not in the default run): a 20 s quick run samples the claim latency and the
    table's size, reports both windows' p99 and the growth, and draws its plot."""
    out, plot = tmp_path / "soak.json", tmp_path / "bench.png"
    result = CliRunner().invoke(main, ["--dsn", server.dsn, "bench", "--quick", "--only",
                                       "soak", "--plot", str(plot), "--output", str(out)])
    assert result.exit_code == 0, result.output
    soak = json.loads(out.read_text())["skipjack"]["soak"]
    assert "error" not in soak, soak
    assert soak["enqueued"] > 0 and soak["sizes"] and soak["claim_ms"]
    assert soak["claim_p99_first_ms"] is not None and soak["claim_p99_last_ms"] is not None
    drawn = json.loads(out.read_text())["plot"]
    if drawn.get("skipped") is None:  # matplotlib is an extra of the tools: the plot if it is there
        assert (tmp_path / "bench-soak.png").stat().st_size > 0
        assert drawn["files"] == [str(tmp_path / "bench-soak.png")]  # what it said it wrote
    else:
        assert "matplotlib" in drawn["skipped"]
