"""Runs the selected scenarios in order and gathers one JSON-ready result."""

from __future__ import annotations

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
from .common import BULK_CALLS, Settings, connect, server_answers, settle
from .peers.runner import PEERS, run_peer
from .report import dig, ratios, targets

SCENARIOS = ("ceiling", "raw", "w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8", "w9", "w10",
             "hosts", "memory", "dashboard")
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
    """Run skipjack's scenarios (``only``), then W1-W4 for each peer in ``compare``."""
    started = time.monotonic()
    host = machine(settings)
    sj: dict[str, Any] = {}
    steps = {
        "ceiling": lambda: ceiling.run(settings),
        "raw": lambda: raw.run(settings),
        "w1": lambda: enqueue.run(settings),
        "w2": lambda: drain.w2(settings),
        "w3": lambda: latency.w3(settings),
        "w4": lambda: drain.w4(settings),
        "w9": lambda: latency.w9(settings),
        "w10": lambda: scaling.w10(settings),
        "hosts": lambda: hosts_scaling.run(settings),
        "w5": lambda: latency.w5(settings, *_w5_inputs(sj)),
        "w6": lambda: claim_methods.run(settings),
        "w7": lambda: retry_storm.run(settings),
        "w8": lambda: history.run(settings),
        "memory": lambda: drain.memory(settings),
        "dashboard": lambda: dashboard.run(settings),
        "soak": lambda: soak.run(settings, dig(sj, ("w2", "by_concurrency", "10",
                                                     "jobs_per_s"))),
    }
    for name in SCENARIOS + OPTIONAL:
        if name in only:
            settle(settings.dsn)
            t0 = time.monotonic()
            sj[name] = _attempt(settings, name, steps[name])
            sj[name]["elapsed_s"] = round(time.monotonic() - t0, 1)
    results: dict[str, Any] = {
        "skipjack_version": importlib.metadata.version("skipjack"),
        "settings": {"scale": settings.scale, "runs": settings.runs, "quick": settings.quick,
                     "metrics": settings.metrics,
                     "scenarios": [s for s in SCENARIOS + OPTIONAL if s in only],
                     "compare": list(compare)},
        "machine": host,
        "skipjack": sj,
        "peers": {},
    }
    sizes = peer_sizes(settings)
    for name in compare:
        results["peers"][name] = run_peer(settings, name, sizes)
    results["ratios"] = ratios(results)
    results["targets"] = targets(results)
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    return results


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

