"""The PNG: throughput against concurrency, and the latency distributions (matplotlib,
optional: ``pip install './tools[bench]'``)."""

from __future__ import annotations

from typing import Any


def _scaling(ax: Any, by: dict[str, Any]) -> None:
    """W10: throughput (left axis) and claim p99 (right axis) against worker processes."""
    xs = [int(n) for n in by]
    ax.plot(xs, [by[n]["jobs_per_s"] or 0 for n in by], "o-", label="jobs/s")
    ax.set_xlabel("worker processes (concurrency 50 each)")
    ax.set_ylabel("jobs/s")
    ax.set_xticks(xs)
    other = ax.twinx()
    other.plot(xs, [by[n]["claim_ms"]["p99"] or 0 for n in by], "s--", color="tab:red",
               label="claim p99 (ms)")
    other.set_ylabel("claim p99 (ms)")
    ax.set_title("W10 many workers, one server")
    ax.legend(loc="upper left", fontsize=8)
    other.legend(loc="upper right", fontsize=8)


def _soak(axes: Any, soak: dict[str, Any]) -> None:
    """The soak: claim latency (top) and the table's size and backlog (bottom) over time."""
    top, bottom = axes
    series = soak["claim_ms"]
    minutes = [p["t"] / 60 for p in series]
    top.plot(minutes, [p["p50_ms"] or 0 for p in series], label="claim p50")
    top.plot(minutes, [p["p99_ms"] or 0 for p in series], label="claim p99")
    top.set_ylabel("ms (per 30 s)")
    top.set_title(f"soak: {soak['jobs_per_s']:,} jobs/s for {soak['seconds'] / 60:.0f} min, "
                  f"retention {soak['retention_s'] / 60:.0f} min")
    top.legend(fontsize=8)
    sizes = soak["sizes"]
    at = [s["t"] / 60 for s in sizes]
    bottom.plot(at, [s["table_bytes"] / 2**20 for s in sizes], label="jobs table (MiB)")
    bottom.plot(at, [s["index_bytes"] / 2**20 for s in sizes], label="its indexes (MiB)")
    bottom.axvline(soak["retention_s"] / 60, linestyle=":", color="grey",
                   label="retention reached")
    bottom.set_xlabel("minutes")
    bottom.set_ylabel("MiB")
    other = bottom.twinx()
    other.plot(at, [s["backlog"] for s in sizes], "--", color="tab:red", label="backlog (jobs)")
    other.set_ylabel("runnable backlog (jobs)")
    bottom.legend(loc="upper left", fontsize=8)
    other.legend(loc="lower right", fontsize=8)


def _hosts(ax: Any, by_delay: dict[str, Any]) -> None:
    """Hosts: throughput against simulated hosts, one line per added latency; the runs that
    claim one job per round trip as single points at one host."""
    for i, (delay, figures) in enumerate(by_delay.items()):
        by = figures["by_hosts"]
        xs = [int(n) for n in by]
        label = "no added latency" if float(delay) == 0 else f"{delay} ms added each way"
        ax.plot(xs, [by[n]["jobs_per_s"] or 0 for n in by], "o-", color=f"C{i}",
                label=f"{label}, batched claims")
        one = figures.get("one_per_claim", {}).get("jobs_per_s")
        if one:
            ax.plot([1], [one], "x", color=f"C{i}", markersize=9,
                    label=f"{label}, one job per claim")
        ax.set_xticks(xs)
    ax.set_xlabel("hosts (one worker process of concurrency 50 each)")
    ax.set_ylabel("jobs/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Worker hosts over a network, one server")
    ax.legend(fontsize=8)


def _side_figure(plt: Any, draw: Any, data: dict[str, Any], path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax, data)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plot(results: dict[str, Any], path: str) -> tuple[str | None, list[str]]:
    """Draw the plot into ``path`` (W10's, when measured, into ``<path>-w10.png``, the hosts
    scenario's into ``<path>-hosts.png`` and the soak's into ``<path>-soak.png``; ``path``
    itself only when W2 or W3 ran, or nothing else did); returns why it was skipped (None
    when drawn) and the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter, ScalarFormatter
    except ImportError:
        return "matplotlib is not installed (pip install './tools[bench]')", []
    sj = results["skipjack"]
    written: list[str] = []
    scaling = sj.get("w10", {}).get("by_processes", {})
    if scaling:  # a figure of its own, beside the main one: <path>-w10.png
        written.append(path.removesuffix(".png") + "-w10.png")
        _side_figure(plt, _scaling, scaling, written[-1])
    over_network = sj.get("hosts", {}).get("by_delay", {})
    if over_network:  # <path>-hosts.png
        written.append(path.removesuffix(".png") + "-hosts.png")
        _side_figure(plt, _hosts, over_network, written[-1])
    soak = sj.get("soak", {})
    if soak.get("sizes"):
        fig, axes = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
        _soak(axes, soak)
        fig.tight_layout()
        written.append(path.removesuffix(".png") + "-soak.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    if (scaling or over_network or soak) and not sj.get("w2") and not sj.get("w3"):
        return None, written
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    by = sj.get("w2", {}).get("by_concurrency", {})
    if by:
        xs = [int(c) for c in by]
        left.plot(xs, [by[c]["jobs_per_s"] or 0 for c in by], "o-", label="skipjack W2 drain")
    bare = sj.get("ceiling", {}).get("bare_loop", {}).get("1", {}).get("jobs_per_s")
    if bare:
        left.axhline(bare, linestyle="--", color="grey", label="bare SQL loop, 1 connection")
    for name, peer in results.get("peers", {}).items():
        value = peer.get("w2", {}).get("jobs_per_s")
        if value:
            left.plot([10], [value], "s", label=f"{name} W2 drain")
    left.set_xscale("log")
    left.set_xticks([1, 10, 100])
    left.xaxis.set_major_formatter(ScalarFormatter())
    left.set_xlabel("worker concurrency")
    left.set_ylabel("jobs/s")
    left.set_title("throughput (no-op jobs, one worker process)")
    left.legend(fontsize=8)
    series = {"skipjack": sj.get("w3", {}).get("samples", [])}
    for name, peer in results.get("peers", {}).items():
        runs = peer.get("w3", {}).get("runs", [])
        if runs and "samples" in runs[-1]:
            series[name] = runs[-1]["samples"]
    for name, samples in series.items():
        if samples:
            ordered = sorted(samples)
            right.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))],
                       label=name)
    right.set_xscale("log")
    right.set_xticks([0.5, 1, 2, 5, 10, 20, 50, 100])
    right.xaxis.set_major_formatter(ScalarFormatter())
    right.xaxis.set_minor_formatter(NullFormatter())
    right.set_xlabel("enqueue-to-start latency (ms)")
    right.set_ylabel("share of jobs")
    right.set_title("W3 latency distribution (idle worker)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None, [path, *written]
