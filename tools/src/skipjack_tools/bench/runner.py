"""Runs the selected scenarios in order and gathers one JSON-ready result."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import psycopg

from . import (
    ceiling,
    claim_methods,
    dashboard,
    drain,
    enqueue,
    history,
    hosts_scaling,
    latency,
    raw,
    retry_storm,
    scaling,
    soak,
)
from .common import BULK_CALLS, Settings, connect, merge_rounds, server_answers, settle
from .peers.runner import PEERS, run_peer
from .report import dig, ratios, targets

SCENARIOS = ("ceiling", "raw", "w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8", "w9", "w10",
             "hosts", "memory", "dashboard")
# Run in rounds with the peers' W1-W4 (see run_bench): what is compared with a peer or with
# the database's limits.
ROUNDS = ("ceiling", "raw", "w1", "w2", "w3", "w4")
# Run only when named in --only: the soak takes 20 minutes at scale 1.
OPTIONAL = ("soak",)


def machine(settings: Settings) -> dict[str, Any]:
    """nproc, memory, Python and the server's version and settings that matter here."""
    with connect(settings.dsn) as conn:
        names = ("server_version", "shared_buffers", "synchronous_commit", "fsync",
                 "wal_sync_method", "max_connections", "work_mem", "autovacuum")
        server = {n: conn.execute(f"SHOW {n}").fetchone()[0] for n in names}  # type: ignore[index]
    mem_kib = 0
    try:
        with open("/proc/meminfo") as info:
            mem_kib = int(info.readline().split()[1])
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1),
            "python": platform.python_version(), "platform": platform.platform(),
            "server": server}


def run_bench(settings: Settings, only: tuple[str, ...] = SCENARIOS,
              compare: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run skipjack's scenarios (``only``) and W1-W4 for each peer in ``compare``.

    The scenarios of ``ROUNDS`` and the peers' W1-W4 run in ``settings.runs`` rounds, one run
    of each a round, each of skipjack's followed by the same scenario of each peer, and
    report the medians over the rounds: a machine that slows down or speeds up during the
    run (its neighbours, its own background work) then weighs on every library and limit
    alike, instead of on whichever ran last. The other scenarios run after them, once
    each."""
    started = time.monotonic()
    host = machine(settings)
    sj: dict[str, Any] = {}
    steps: dict[str, Callable[[Settings], dict[str, Any]]] = {
        "ceiling": ceiling.run,
        "raw": raw.run,
        "w1": enqueue.run,
        "w2": drain.w2,
        "w3": latency.w3,
        "w4": drain.w4,
        "w9": latency.w9,
        "w10": scaling.w10,
        "hosts": hosts_scaling.run,
        "w5": lambda s: latency.w5(s, *_w5_inputs(sj)),
        "w6": claim_methods.run,
        "w7": retry_storm.run,
        "w8": history.run,
        "memory": drain.memory,
        "dashboard": dashboard.run,
        "soak": lambda s: soak.run(s, dig(sj, ("w2", "by_concurrency", "10", "jobs_per_s"))),
    }

    def timed(name: str, with_settings: Settings) -> dict[str, Any]:
        settle(settings.dsn)
        t0 = time.monotonic()
        result = _attempt(settings, name, lambda: steps[name](with_settings))
        result["elapsed_s"] = round(time.monotonic() - t0, 1)
        return result

    one = dataclasses.replace(settings, runs=1)
    sizes = peer_sizes(settings)
    measured: dict[str, list[dict[str, Any]]] = {n: [] for n in ROUNDS if n in only}
    # peer -> scenario -> its result in each round
    peer_rounds: dict[str, dict[str, list[dict[str, Any]]]] = {
        p: {n: [] for n in sizes} for p in compare}
    for number in range(settings.runs):
        if settings.runs > 1:
            settings.log(f"round {number + 1} of {settings.runs}")
        for name, rounds in measured.items():
            rounds.append(timed(name, one))
            for peer, by_scenario in peer_rounds.items():  # the same scenario, right after
                if name in by_scenario:
                    by_scenario[name].append(run_peer(one, peer, {name: sizes[name]}))
        for peer, by_scenario in peer_rounds.items():  # those skipjack did not run
            for name in by_scenario:
                if name not in measured:
                    by_scenario[name].append(run_peer(one, peer, {name: sizes[name]}))
    for name, rounds in measured.items():
        sj[name] = merge_rounds(rounds)
        sj[name]["elapsed_s"] = round(sum(r["elapsed_s"] for r in rounds), 1)
        if name == "w2" and "by_concurrency" in sj[name]:
            drain.choose_best(sj[name])
    for name in SCENARIOS + OPTIONAL:
        if name in only and name not in ROUNDS:
            sj[name] = timed(name, settings)
    results: dict[str, Any] = {
        "skipjack_version": importlib.metadata.version("skipjack"),
        "settings": {"scale": settings.scale, "runs": settings.runs, "quick": settings.quick,
                     "metrics": settings.metrics,
                     "scenarios": [s for s in SCENARIOS + OPTIONAL if s in only],
                     "compare": list(compare)},
        "machine": host,
        "skipjack": sj,
        "peers": {peer: merge_peer_rounds([r for rounds in by_scenario.values() for r in rounds])
                  for peer, by_scenario in peer_rounds.items()},
    }
    results["ratios"] = ratios(results)
    results["targets"] = targets(results)
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    return results


def merge_peer_rounds(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One peer's result from its runs of one scenario each (``run_peer`` of one scenario, in
    every round): its version, and each scenario merged over the rounds; an error that
    stopped every run (the peer could not be installed) as it is."""
    ran = [p for p in parts if "error" not in p]
    if not ran:
        return parts[0] if parts else {"error": "not run"}
    out: dict[str, Any] = {"version": ran[-1].get("version")}
    for name in dict.fromkeys(k for p in ran for k in p if k != "version"):
        out[name] = merge_rounds([p[name] for p in ran if name in p])
    return out


def _attempt(settings: Settings, name: str, step: Callable[[], dict[str, Any]]
             ) -> dict[str, Any]:
    """Run one scenario; once more if the server went away meanwhile (a restart by someone
    else spoils that measurement); an error is recorded, never raised."""
    for attempt in (1, 2):
        try:
            return step()
        except Exception as exc:  # one failed scenario must not lose the others
            settings.log(f"{name} failed: {type(exc).__name__}: {exc}")
            lost = isinstance(exc, psycopg.OperationalError)
            if attempt == 1 and lost and server_answers(settings.dsn):
                settings.log(f"{name}: the server is back, running it again")
                continue
            return {"error": f"{type(exc).__name__}: {exc}"}
    raise AssertionError("unreachable")


def peer_sizes(settings: Settings) -> dict[str, dict[str, Any]]:
    """W1-W4 for the peers, with the sizes skipjack ran."""
    return {
        "w1": {"single": settings.n(2000), "bulk": settings.n(10_000), "bulk_calls": BULK_CALLS},
        "w2": {"jobs": settings.n(10_000), "concurrency": 10},
        "w3": {"jobs": settings.n(300, minimum=30)},
        "w4": {"jobs": settings.n(2000), "seconds": 0.002},
    }


def _w5_inputs(sj: dict[str, Any]) -> tuple[float, int]:
    w2 = sj.get("w2")
    if w2 and w2.get("best_jobs_per_s"):
        return float(w2["best_jobs_per_s"]), int(w2["best_concurrency"])
    return 2000.0, 100  # W2 was not run: a modest fixed rate


def known_peers() -> tuple[str, ...]:
    """Names accepted by ``--compare``."""
    return tuple(PEERS)

