"""Ratios, the targets (docs/performance.md), and the printed tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# (label, how to read skipjack's figure, how to read a peer's, higher is better)
COMPARED: list[tuple[str, tuple[str, ...], tuple[str, ...], bool]] = [
    ("W1 enqueue one at a time (jobs/s)", ("w1", "single_jobs_per_s"),
     ("w1", "single_jobs_per_s"), True),
    ("W1 bulk, 10,000 a call (jobs/s)", ("w1", "bulk_jobs_per_s"), ("w1", "bulk_jobs_per_s"), True),
    ("W2 drain, best concurrency (jobs/s)", ("w2", "best_jobs_per_s"), ("w2", "jobs_per_s"),
     True),
    ("W2 drain, concurrency 10 (jobs/s)", ("w2", "by_concurrency", "10", "jobs_per_s"),
     ("w2", "jobs_per_s"), True),
    ("W3 latency p50 (ms)", ("w3", "p50_ms"), ("w3", "p50"), False),
    ("W3 latency p99 (ms)", ("w3", "p99_ms"), ("w3", "p99"), False),
    ("W4 8 x 2 ms, one process (jobs/s)", ("w4", "jobs_per_s"), ("w4", "jobs_per_s"), True),
]


def dig(data: Any, path: tuple[str, ...]) -> float | None:
    """``data[path[0]][path[1]]...``, or None when any step is missing."""
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return float(data) if isinstance(data, int | float) else None


def ratio(ours: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    """How many times better skipjack is (>1 means skipjack wins), rounded to 2 decimals."""
    if not ours or not theirs:
        return None
    return round(ours / theirs if higher_is_better else theirs / ours, 2)


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """skipjack/peer for every compared figure and every peer (latency: peer/skipjack)."""
    out: dict[str, Any] = {}
    for peer, figures in results.get("peers", {}).items():
        out[peer] = {label: ratio(dig(results["skipjack"], ours), dig(figures, theirs), hib)
                     for label, ours, theirs, hib in COMPARED}
    return out


def _best_peer(results: dict[str, Any], path: tuple[str, ...], highest: bool
               ) -> tuple[str | None, float | None]:
    found = [(name, dig(p, path)) for name, p in results.get("peers", {}).items()]
    present = [(n, v) for n, v in found if v is not None]
    if not present:
        return None, None
    return (max if highest else min)(present, key=lambda nv: nv[1])


def _target(name: str, value: float | None, goal: str, met: bool | None) -> dict[str, Any]:
    return {"target": name, "value": value, "goal": goal, "met": met}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The benchmark's targets, each with the measured value and whether it is met (None: not
    measured in this run): against the best peer, against the database's raw limits of the
    same run, and absolute ones (docs/performance.md, "What is left")."""
    sj = {k: v for k, v in results["skipjack"].items() if "error" not in v}
    out = []

    def vs_peer(name: str, ours: tuple[str, ...], theirs: tuple[str, ...], factor: float,
                highest: bool, goal: str, strictly: bool = False) -> None:
        """``ratio`` to the best peer (>1: skipjack better), met when at least ``factor``
        (above it, when ``strictly``)."""
        peer, best = _best_peer(results, theirs, highest)
        r = ratio(dig(sj, ours), best, highest)
        seen = f"{peer}: {best}" if peer else "no peer in this run"
        met = None if r is None else (r > factor if strictly else r >= factor)
        out.append(_target(name, r, f"{goal} ({seen})", met))

    vs_peer("W1 one at a time vs best peer", ("w1", "single_jobs_per_s"),
            ("w1", "single_jobs_per_s"), 1.0, True, "> 1x: ahead of every peer", strictly=True)
    vs_peer("W1 bulk vs best peer", ("w1", "bulk_jobs_per_s"), ("w1", "bulk_jobs_per_s"),
            2.0, True, ">= 2x the best peer")
    vs_peer("W2 drain vs best peer", ("w2", "best_jobs_per_s"), ("w2", "jobs_per_s"), 4.0, True,
            ">= 4x the best peer")
    drain, bare = dig(sj, ("w2", "best_jobs_per_s")), dig(sj, ("ceiling", "bare_loop", "1",
                                                             "jobs_per_s"))
    share = round(drain / bare, 2) if drain and bare else None
    out.append(_target("W2 drain / skipjack's claim + outcome SQL in a bare loop", share,
                       "(reported)", None))
    for label, path, least in (("one process", ("w4", "jobs_per_s"), 3800),
                               ("8 processes x 1", ("w4", "eight_processes", "jobs_per_s"),
                                3000)):
        w4 = dig(sj, path)
        out.append(_target(f"W4 8 x 2 ms, {label} (jobs/s)", w4, f">= {least}",
                           None if w4 is None else w4 >= least))
    vs_peer("W3 p50: the best peer's / skipjack's", ("w3", "p50_ms"), ("w3", "p50"),
            round(1 / 0.7, 2), False, ">= 1.43: at most 0.7x the best peer's")
    # W3's floor: the bare enqueue and pickup of one row, no queue (raw), from before the
    # INSERT to the take, against the best peer's p50: below 1.43, a queue at 0.7x that
    # peer would start jobs sooner than the database alone can hand one over on this machine
    peer, best = _best_peer(results, ("w3", "p50"), False)
    floor = dig(sj, ("raw", "pickup", "total_p50_ms"))
    out.append(_target("W3 p50: the best peer's / the bare enqueue + pickup's", ratio(
        floor, best, False), f"(reported; {peer}: {best})" if peer else "(reported)", None))
    p99 = dig(sj, ("w3", "p99_ms"))
    out.append(_target("W3 p99 (ms)", p99, "< 10", None if p99 is None else p99 < 10))
    pickup = dig(sj, ("w3", "pickup_p50_ms"))
    out.append(_target("W3 pickup after the enqueue's commit, p50 (ms)", pickup, "<= 0.4",
                       None if pickup is None else pickup <= 0.4))
    w8 = dig(sj, ("w8", "claim_ms", "p99"))
    seq = sj.get("w8", {}).get("plan", {}).get("seq_scan")
    out.append(_target("W8 claim p99 with history (ms)", w8, "< 10, no Seq Scan",
                       None if w8 is None else (w8 < 10 and seq is False)))
    for name, ours, limit, goal, higher in (
            ("W1 one per call / bare INSERT + commit", ("w1", "single_jobs_per_s"),
             ("raw", "insert_each", "jobs_per_s"), 0.75, True),
            ("W1 one per call / its statement alone, on a held connection",
             ("w1", "single_jobs_per_s"), ("w1", "statement_jobs_per_s"), None, True),
            ("W1's statement alone / bare INSERT + commit", ("w1", "statement_jobs_per_s"),
             ("raw", "insert_each", "jobs_per_s"), None, True),
            ("W1 bulk / one INSERT ... unnest", ("w1", "bulk_jobs_per_s"),
             ("raw", "insert_unnest", "jobs_per_s"), None, True),
            ("W2 drain / bare claim 100 + DELETE loop", ("w2", "best_jobs_per_s"),
             ("raw", "take_and_delete", "jobs_per_s"), 0.4, True),
            ("W3 pickup p50: the bare pickup's / skipjack's", ("w3", "pickup_p50_ms"),
             ("raw", "pickup", "p50_ms"), None, False),
            ("W4 one process / 8 bare 2 ms sleep loops", ("w4", "jobs_per_s"),
             ("raw", "sleep_loops", "jobs_per_s"), None, True)):
        share = ratio(dig(sj, ours), dig(sj, limit), higher)
        out.append(_target(name, share, f">= {goal}" if goal else "(reported)",
                           None if share is None or goal is None else share >= goal))
    for key, label in (("server_cpu_us", "server CPU"), ("wal_bytes", "WAL bytes")):
        ours_cost = dig(sj, ("w2", "per_job", key))
        bare_cost = dig(sj, ("raw", "take_and_delete", "per_job", key))
        times = round(ours_cost / bare_cost, 2) if ours_cost and bare_cost else None
        out.append(_target(f"W2 {label} per job / the bare loop's", times, "<= 2",
                           None if times is None else times <= 2))
    for kind in ("delayed", "retried"):
        late = dig(sj, ("w9", kind, "p99_ms"))
        out.append(_target(f"W9 {kind} jobs' lateness p99 (ms)", late, "< 50",
                           None if late is None else late < 50))
    if "soak" in sj:
        kept = sj["soak"]["kept_up"]
        out.append(_target("soak: the worker kept up (last window's backlog, jobs)",
                           sj["soak"]["backlog_last_max"], "< one second's jobs", kept))
    soak = dig(sj, ("soak", "claim_p99_last_over_first"))
    out.append(_target("soak: claim p99, last window / first", soak, "<= 1.2",
                       None if soak is None else soak <= 1.2))
    growth = dig(sj, ("soak", "size_end_over_half"))
    out.append(_target("soak: table + index size, end / half time", growth, "<= 1.1",
                       None if growth is None else growth <= 1.1))
    d1 = dig(sj, ("dashboard", "slowest_p95_ms"))
    out.append(_target("D1 slowest dashboard page p95 (ms)", d1, "< 200",
                       None if d1 is None else d1 < 200))
    methods = sj.get("w6", {}).get("methods", {})
    if methods:
        dup = methods["no_lock"]["duplicate_executions"]
        serial = methods["for_update"]["jobs_per_s"] < methods["skip_locked"]["jobs_per_s"]
        mq = sj["w6"]["multi_queue"]
        slower = mq["any_ms"] > mq["one_queue_ms"]
        out.append(_target("W6 direction (dups without lock, FOR UPDATE slower, ANY slower)",
                           dup, "dups > 0, both slower", dup > 0 and serial and slower))
    cases = sj.get("w7", {}).get("cases", {})
    if cases:
        fixed = cases["fixed_60s"]["max_retries_in_one_second"]
        spread = cases["default_attempt_7"]["max_retries_in_one_second"]
        out.append(_target("W7 jitter spreads retries (max/s fixed vs jittered)",
                           spread, f"< fixed ({fixed})", spread < fixed))
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_report(results: dict[str, Any], console: Console) -> None:
    """The comparison table (when peers ran), skipjack's other figures, and the targets."""
    sj = results["skipjack"]
    peers = results.get("peers", {})
    table = Table(title="skipjack bench: medians of "
                        f"{results['settings']['runs']} interleaved round(s), same server")
    table.add_column("scenario")
    table.add_column("skipjack", justify="right")
    for name in peers:
        table.add_column(f"{name} (skipjack x)", justify="right")
    for label, ours, theirs, hib in COMPARED:
        digits = 2 if label.endswith("(ms)") else 0
        row = [label, _fmt(dig(sj, ours), digits)]
        for figures in peers.values():
            theirs_v = dig(figures, theirs)
            times = _fmt(ratio(dig(sj, ours), theirs_v, hib), 2)
            row.append(f"{_fmt(theirs_v, digits)} ({times}x)")
        table.add_row(*row)
    console.print(table)
    console.print(_other_table(sj))
    # --quick runs each scenario on a hundredth of its jobs, once: too few for a verdict
    quick = results.get("settings", {}).get("quick", False)
    tt = Table(title="targets (--quick: too few jobs for a verdict)" if quick else "targets")
    for col in ("target", "value", "goal", "met"):
        tt.add_column(col)
    for t in results.get("targets", []):
        met = {True: "[green]yes[/]", False: "[red]no[/]", None: "n/a"}[t["met"]]
        tt.add_row(t["target"], _fmt(t["value"], 2), t["goal"], "-" if quick else met)
    console.print(tt)
    for name, figures in peers.items():
        if "error" in figures:
            console.print(f"{name}: {figures['error']}", style="red", markup=False)


def _other_table(sj: dict[str, Any]) -> Table:
    t = Table(title="skipjack: everything else")
    t.add_column("scenario")
    t.add_column("figures")
    for name, figures in sj.items():
        if "error" in figures:
            t.add_row(f"{name} FAILED", escape(str(figures["error"])))
    sj = {k: v for k, v in sj.items() if "error" not in v}
    w2 = sj.get("w2", {})
    if w2:
        by = ", ".join(f"c={c}: {_fmt(v['jobs_per_s'], 0)}"
                       for c, v in w2.get("by_concurrency", {}).items())
        large = w2.get("large")
        if large:
            by += f"; {large['jobs']:,} jobs at c={large['concurrency']}: " \
                  f"{_fmt(large['jobs_per_s'], 0)}"
        t.add_row(f"W2 drain {w2.get('jobs', 0):,} jobs (jobs/s)", by)
    w4 = sj.get("w4", {})
    if w4:
        t.add_row("W4 8 x 2 ms (jobs/s)",
                  f"1 process: {_fmt(w4['one_process']['jobs_per_s'], 0)}, 8 processes: "
                  f"{_fmt(w4['eight_processes']['jobs_per_s'], 0)} (ideal 4,000)")
    w3 = sj.get("w3", {})
    if w3:
        t.add_row("W3 latency (ms)", f"p50 {_fmt(w3['p50_ms'], 2)}, p95 {_fmt(w3['p95_ms'], 2)},"
                  f" p99 {_fmt(w3['p99_ms'], 2)}, max {_fmt(w3['max_ms'], 2)}; after the "
                  f"commit: p50 {_fmt(w3.get('pickup_p50_ms'), 2)}, p99 "
                  f"{_fmt(w3.get('pickup_p99_ms'), 2)}")
    for load, v in sj.get("w5", {}).get("by_load", {}).items():
        t.add_row(f"W5 at {load} of W2 max ({_fmt(v['target_jobs_per_s'], 0)}/s)",
                  f"p50 {_fmt(v['p50_ms'], 2)}, p95 {_fmt(v['p95_ms'], 2)}, "
                  f"p99 {_fmt(v['p99_ms'], 2)}, max {_fmt(v['max_ms'], 2)} ms; "
                  f"{v['backlog_left']:,} of {v['enqueued']:,} not started in time")
    for method, v in sj.get("w6", {}).get("methods", {}).items():
        t.add_row(f"W6 {method}", f"{_fmt(v['jobs_per_s'], 0)} jobs/s, "
                  f"{v['duplicate_executions']} duplicate executions, per worker "
                  f"{min(v['per_worker'])}-{max(v['per_worker'])}")
    mq = sj.get("w6", {}).get("multi_queue")
    if mq:
        t.add_row("W6 = ANY vs one queue", f"{_fmt(mq['any_ms'], 2)} ms vs "
                  f"{_fmt(mq['one_queue_ms'], 3)} ms on {mq['pending_rows']:,} pending rows")
    for case, v in sj.get("w7", {}).get("cases", {}).items():
        t.add_row(f"W7 {case}", f"max {v['max_retries_in_one_second']} retries in one second,"
                  f" spread over {_fmt(v['retries_spread_s'], 1)} s")
    w8 = sj.get("w8")
    if w8:
        t.add_row("W8 claim with history (ms)",
                  f"p50 {_fmt(w8['claim_ms']['p50'], 2)}, p99 {_fmt(w8['claim_ms']['p99'], 2)};"
                  f" under a {w8['snapshot_seconds']:g} s snapshot: p50 "
                  f"{_fmt(w8['claim_ms_during_snapshot']['p50'], 2)}, p99 "
                  f"{_fmt(w8['claim_ms_during_snapshot']['p99'], 2)}; seq scan: "
                  f"{w8['plan']['seq_scan']}")
        pruned = w8.get("prune")
        if pruned:
            cost = pruned["per_job"]
            t.add_row("W8 prune of the history",
                      f"{_fmt(pruned['jobs_per_s'], 0)} jobs/s; per job: server CPU "
                      f"{_fmt(cost['server_cpu_us'], 1)} µs, WAL {_fmt(cost['wal_bytes'], 0)} B")
    limits = sj.get("raw")
    if limits:
        t.add_row("raw limits (jobs/s)",
                  f"INSERT + commit: {_fmt(dig(limits, ('insert_each', 'jobs_per_s')), 0)}, "
                  f"one INSERT unnest: {_fmt(dig(limits, ('insert_unnest', 'jobs_per_s')), 0)}, "
                  f"take 100 + DELETE: "
                  f"{_fmt(dig(limits, ('take_and_delete', 'jobs_per_s')), 0)}, 8 x 2 ms "
                  f"sleep loops: {_fmt(dig(limits, ('sleep_loops', 'jobs_per_s')), 0)}")
        t.add_row("raw pickup of one row (ms)",
                  f"p50 {_fmt(dig(limits, ('pickup', 'p50_ms')), 2)}, p99 "
                  f"{_fmt(dig(limits, ('pickup', 'p99_ms')), 2)} (INSERT + NOTIFY commits; "
                  f"LISTEN hears it; the row is taken and deleted; 20 ms apart); from before "
                  f"the INSERT: p50 {_fmt(dig(limits, ('pickup', 'total_p50_ms')), 2)}")
    for label, path in (("W2 per job", ("w2", "per_job")),
                        ("bare loop per job", ("raw", "take_and_delete", "per_job"))):
        per: Any = sj
        for key in path:
            per = per.get(key) if isinstance(per, dict) else None
        if per:
            t.add_row(f"{label}", f"server CPU {_fmt(per['server_cpu_us'], 1)} µs, client CPU "
                      f"{_fmt(per['client_cpu_us'], 1)} µs, WAL {_fmt(per['wal_bytes'], 0)} B, "
                      f"commits {per['commits']}")
    for n, v in sj.get("w10", {}).get("by_processes", {}).items():
        waits = ", ".join(f"{k} {c}" for k, c in list(v["wait_events"].items())[:3]) or "none"
        t.add_row(f"W10 {n} process(es) x 50",
                  f"{_fmt(v['jobs_per_s'], 0)} jobs/s; claim p50 {_fmt(v['claim_ms']['p50'], 2)}"
                  f" ms, p99 {_fmt(v['claim_ms']['p99'], 2)} ms; waits: {waits}")
    soak = sj.get("soak")
    if soak:
        t.add_row(f"soak {soak['seconds']:.0f} s at {soak['jobs_per_s']:,} jobs/s",
                  f"claim p99 first {_fmt(soak['claim_p99_first_ms'], 2)} ms, last "
                  f"{_fmt(soak['claim_p99_last_ms'], 2)} ms (x"
                  f"{_fmt(soak['claim_p99_last_over_first'], 2)}); table + indexes "
                  f"{_fmt((soak['size_end_bytes'] or 0) / 2**20, 0)} MiB at the end, x"
                  f"{_fmt(soak['size_end_over_half'], 2)} of half time (retention "
                  f"{soak['retention_s']:.0f} s); WAL {_fmt(soak.get('wal_bytes_per_job'), 0)}"
                  f" B a job; checkpoints: {soak.get('checkpoints_requested')} requested "
                  f"(by WAL volume or a command), {soak.get('checkpoints_timed')} timed")
    over_network = sj.get("hosts", {})
    if "skipped" in over_network:
        t.add_row("hosts skipped", escape(str(over_network["skipped"])))
    for delay, v in over_network.get("by_delay", {}).items():
        by = ", ".join(f"{n}: {_fmt(r['jobs_per_s'], 0)}" for n, r in v["by_hosts"].items())
        one = v.get("one_per_claim", {}).get("jobs_per_s")
        t.add_row(f"hosts, {delay} ms added each way (jobs/s)",
                  f"by hosts {by}; one job per claim: {_fmt(one, 0)}; round trip p50 "
                  f"{_fmt(v['round_trip_ms']['p50'], 2)} ms")
    w9 = sj.get("w9")
    if w9:
        t.add_row("W9 lateness from due time (ms)",
                  "; ".join(f"{kind}: p50 {_fmt(w9[kind]['p50_ms'], 1)}, p99 "
                            f"{_fmt(w9[kind]['p99_ms'], 1)}, max {_fmt(w9[kind]['max_ms'], 1)}"
                            for kind in ("delayed", "retried")))
    ceiling = sj.get("ceiling")
    if ceiling:
        bare = ", ".join(f"{c} conn: {_fmt(v['jobs_per_s'], 0)}"
                         for c, v in ceiling["bare_loop"].items())
        pgb = ", ".join(f"-c {c}: {_fmt(v.get('jobs_per_s'), 0)}"
                        for c, v in ceiling["pgbench"].items() if isinstance(v, dict))
        t.add_row("ceiling, batches of 100 (jobs/s)", f"bare loop {bare}; pgbench {pgb}")
    d1 = sj.get("dashboard")
    if d1 and "skipped" in d1:
        t.add_row("D1 skipped", escape(str(d1["skipped"])))
    elif d1:
        slowest = max(d1["pages_ms"].items(), key=lambda item: item[1]["p95"])
        t.add_row("D1 dashboard pages (ms)",
                  f"{d1['finished_jobs']:,} finished + {d1['waiting_jobs']:,} waiting: "
                  f"slowest p95 {_fmt(slowest[1]['p95'], 1)} ({slowest[0]}), overview p50 "
                  f"{_fmt(d1['pages_ms']['overview']['p50'], 1)}")
    mem = sj.get("memory")
    if mem:
        t.add_row("worker memory", f"peak RSS {_fmt(mem['peak_rss_mib'], 1)} MiB at "
                  f"concurrency 100, {mem['jobs']:,} jobs of 2.4 KB (idle "
                  f"{_fmt(mem['idle_rss_mib'], 1)} MiB)")
    return t
