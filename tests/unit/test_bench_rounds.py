"""Unit: the bench's rounds (skipjack_tools.bench.common.merge_rounds) report one result per
scenario: medians of the numbers, every run kept, failed rounds left out."""

from __future__ import annotations

from skipjack_tools.bench.common import merge_rounds
from skipjack_tools.bench.drain import choose_best
from skipjack_tools.bench.runner import merge_peer_rounds


def test_numbers_are_medians_runs_are_joined_and_the_rest_is_the_last_rounds() -> None:
    rounds = [{"jobs_per_s": 10.0, "p50_ms": None, "plan": "a", "seq_scan": False,
               "runs": [{"jobs_per_s": 10.0}], "by": {"1": {"jobs_per_s": 3}}},
              {"jobs_per_s": 30.0, "p50_ms": 2.0, "plan": "b", "seq_scan": True,
               "runs": [{"jobs_per_s": 30.0}], "by": {"1": {"jobs_per_s": 1}}},
              {"jobs_per_s": 20.0, "p50_ms": 4.0, "plan": "c", "seq_scan": False,
               "runs": [{"jobs_per_s": 20.0}], "by": {"1": {"jobs_per_s": 2}}}]
    assert merge_rounds(rounds) == {
        "jobs_per_s": 20.0, "p50_ms": 3.0, "plan": "c", "seq_scan": False,
        "runs": [{"jobs_per_s": 10.0}, {"jobs_per_s": 30.0}, {"jobs_per_s": 20.0}],
        "by": {"1": {"jobs_per_s": 2}}}


def test_a_failed_round_is_left_out_unless_every_round_failed() -> None:
    assert merge_rounds([{"x": 1.0}, {"error": "lost"}, {"x": 3.0}]) == {"x": 2.0}
    assert merge_rounds([{"w1": {"error": "e", "runs": [1]}}, {"w1": {"x": 5, "runs": [2]}}]
                        ) == {"w1": {"x": 5, "runs": [2]}}
    assert merge_rounds([{"error": "a"}, {"error": "b"}]) == {"error": "b"}


def test_w2s_best_concurrency_is_chosen_again_from_the_merged_medians() -> None:
    # round 1's best was 100, round 2's was 10; the medians say 10
    w2 = merge_rounds([{"by_concurrency": {"10": {"jobs_per_s": 90}, "100": {"jobs_per_s": 95}}},
                       {"by_concurrency": {"10": {"jobs_per_s": 110}, "100": {"jobs_per_s": 80}}}])
    assert choose_best(w2) == 10
    assert (w2["best_concurrency"], w2["best_jobs_per_s"]) == (10, 100.0)


def test_a_peers_scenarios_from_every_round_make_one_result() -> None:
    parts = [{"version": "1.6.0", "w1": {"single_jobs_per_s": 10.0, "runs": [{"s": 10.0}]}},
             {"version": "1.6.0", "w2": {"jobs_per_s": 5.0, "runs": [{"j": 5.0}]}},
             {"version": "1.6.0", "w1": {"single_jobs_per_s": 30.0, "runs": [{"s": 30.0}]}},
             {"error": "the server went away"}]
    assert merge_peer_rounds(parts) == {
        "version": "1.6.0",
        "w1": {"single_jobs_per_s": 20.0, "runs": [{"s": 10.0}, {"s": 30.0}]},
        "w2": {"jobs_per_s": 5.0, "runs": [{"j": 5.0}]}}
    assert merge_peer_rounds([{"error": "pip install failed"}]) == {"error": "pip install failed"}
