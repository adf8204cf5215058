"""Hosts: one worker process on each of 1, 2 and 4 simulated hosts (``skipjack_tools.hosts``:
network namespaces, each joined to the server by a wire of its own) drains one backlog of
no-op jobs, with no added latency and with 2 ms added each way (4 ms a round trip); for
each: throughput against hosts (the median of ``--runs`` drains).

The server is a private one on the hosts' network (initdb's settings, autovacuum on), not
the one the bench was pointed at: a server must listen where the hosts can reach it. One
more run per latency shows what batching buys: one host claiming one job per round trip
(``--batch-size 1 --prefetch 0``). Every round trip a worker makes is measured beforehand
(``SELECT 1`` from a host). The wire is a process on the same machine: its CPU time is
reported with each run. Skipped, with the reason, where simulated hosts cannot be made
(not root, no network namespaces, no TUN devices, no PostgreSQL server binaries).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

from .. import hosts
from ..hosts import HostsUnavailable, Network, PrivateServer
from .common import Settings, connect, drain_span, fresh_app, percentiles, rate, repeat, wait_for
from .tasks import register
from .worker_run import StateCounter, WorkerProcesses

HOST_COUNTS = (1, 2, 4)
DELAYS = (0.0, 0.002)  # seconds added to each packet, each way
CONCURRENCY = 50

# Times SELECT 1 on one connection (inside a host's namespace): one line of JSON, the ms.
ROUND_TRIPS = """
import json, sys, time, psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True)
seen = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    conn.execute("SELECT 1")
    seen.append((time.perf_counter() - t) * 1000)
print(json.dumps(seen))
"""


def _round_trips(network: Network, server: PrivateServer, n: int) -> dict[str, float | None]:
    """Percentiles (ms) of ``n`` ``SELECT 1`` round trips from the first host."""
    host = network.hosts[0]
    done = subprocess.run(host.command([sys.executable, "-c", ROUND_TRIPS,
                                        server.dsn_for(host), str(n)]),
                          capture_output=True, text=True, timeout=120, check=True)
    return percentiles(json.loads(done.stdout))


def _settings(server: PrivateServer) -> dict[str, str]:
    """The private server's settings that matter here (as ``machine`` reports them for the
    bench's own server)."""
    names = ("server_version", "shared_buffers", "synchronous_commit", "fsync",
             "wal_sync_method", "max_connections", "autovacuum")
    with connect(server.dsn) as conn:
        return {n: str((conn.execute(f"SHOW {n}").fetchone() or ("",))[0]) for n in names}


def _cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 when unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _once(settings: Settings, network: Network, server: PrivateServer, jobs: int,
          count: int, *extra: str) -> dict[str, Any]:
    """One drain of ``jobs`` jobs by one worker on each of the first ``count`` hosts."""
    with fresh_app(server.dsn, "hosts") as app:
        noop = register(app)["noop"]
        placed = network.hosts[:count]
        workers = WorkerProcesses(app, count, "--concurrency", str(CONCURRENCY), *extra,
                                  place=lambda i: (placed[i].command([]),
                                                   server.dsn_for(placed[i])))
        counter = StateCounter(app)
        try:
            workers.wait_listening()
            wire_before = _cpu_seconds(network.wire_pid)
            app.enqueue_many(noop.job(i=i) for i in range(jobs))
            wait_for(lambda: counter() >= jobs, 120 + jobs / 100, what="hosts jobs")
            wire = _cpu_seconds(network.wire_pid) - wire_before
        finally:
            counter.close()
            workers.stop()
        done, span = drain_span(app)
    return {"jobs": done, "jobs_per_s": rate(done, span), "wire_cpu_s": round(wire, 2),
            "delay_ms": [network.delay(h) * 1000 for h in placed]}


def run(settings: Settings) -> dict[str, Any]:
    """The hosts scenario (see the module's doc); ``{"skipped": why}`` where simulated hosts
    cannot be made."""
    why = hosts.unavailable()
    if why:
        settings.log(f"hosts skipped: {why}")
        return {"skipped": why}
    counts = (1, 2) if settings.quick else HOST_COUNTS
    jobs = settings.n(20_000, minimum=500)
    unbatched_jobs = max(50, jobs // 20)
    out: dict[str, Any] = {"jobs": jobs, "concurrency": CONCURRENCY, "by_delay": {}}
    try:
        with hosts.hosts_with_server(max(counts)) as (network, server):
            out["server"] = _settings(server)

            def figures(delay: float) -> dict[str, Any]:
                """The figures of ``delay``, after setting every host's wire to it (set it
                before a measurement, not in the statement that stores it: the measurement
                would run first)."""
                for host in network.hosts:
                    network.set_delay(host, delay)
                by_delay: dict[str, dict[str, Any]] = out["by_delay"]
                return by_delay.setdefault(f"{delay * 1000:g}", {"by_hosts": {}})

            for delay in DELAYS:  # the latency as a worker sees it
                into = figures(delay)
                into["round_trip_ms"] = _round_trips(network, server,
                                                     20 if settings.quick else 200)
            for count in counts:  # the latencies alternate, so drift spoils neither
                for delay in DELAYS:
                    settings.log(f"hosts: {count} host(s) x concurrency {CONCURRENCY}, "
                                 f"{delay * 1000:g} ms each way, {jobs} jobs")
                    into = figures(delay)
                    into["by_hosts"][str(count)] = repeat(settings.runs, functools.partial(
                        _once, settings, network, server, jobs, count))
            for delay in DELAYS:
                settings.log(f"hosts: 1 host claiming one job per round trip, "
                             f"{delay * 1000:g} ms each way, {unbatched_jobs} jobs")
                into = figures(delay)
                into["one_per_claim"] = repeat(settings.runs, functools.partial(
                    _once, settings, network, server, unbatched_jobs, 1, "--batch-size", "1",
                    "--prefetch", "0"))
    except HostsUnavailable as exc:
        settings.log(f"hosts skipped: {exc}")
        return {"skipped": str(exc)}
    return out
