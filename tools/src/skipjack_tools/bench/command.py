"""``skipjack bench``: the command line of the benchmark suite."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from skipjack.db import resolve_dsn, server_of

from .common import Settings
from .plot import write_plot
from .report import print_report
from .runner import OPTIONAL, SCENARIOS, known_peers, run_bench


def _names(value: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(n.strip().lower() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise click.BadParameter(f"unknown {what} {unknown}; choose from {', '.join(allowed)}")
    return names


@click.command()
@click.option("--json", "as_json", is_flag=True,
              help="Print the results as one JSON object on stdout (tables go to stderr).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the JSON results to this file.")
@click.option("--plot", "plot_path", default="skipjack-bench.png", show_default=True,
              type=click.Path(dir_okay=False, writable=True),
              help="PNG of throughput vs concurrency and of latency (needs matplotlib).")
@click.option("--no-plot", is_flag=True, help="Do not draw the PNG.")
@click.option("--compare", default="", metavar="PEERS",
              help="Also run W1-W4 for these libraries, e.g. pgqueuer,oban (known: "
                   f"{', '.join(known_peers())}).")
@click.option("--only", default=",".join(SCENARIOS), show_default=True, metavar="SCENARIOS",
              help="Run only these of skipjack's scenarios; also: "
                   f"{', '.join(OPTIONAL)} (20 minutes at scale 1).")
@click.option("--scale", default=1.0, show_default=True, type=click.FloatRange(0.001, 100),
              help="Multiply every job count (1 = the sizes in docs/performance.md).")
@click.option("--runs", default=3, show_default=True, type=click.IntRange(1, 20),
              help="Repetitions of the compared scenarios (medians are reported).")
@click.option("--quick", is_flag=True,
              help="Seconds-long smoke run: scale 0.01, one run, short waits, no 100k drain.")
@click.option("--metrics", is_flag=True,
              help="Run the W2 and W4 workers with Prometheus metrics on (needs "
                   "prometheus_client), to measure their cost against a run without.")
@click.option("--soak-rate", type=click.FloatRange(1, 1_000_000), default=None,
              help="Jobs/s the soak enqueues [half of W2 at concurrency 10, measured in the "
                   "same run].")
@click.pass_context
def bench(ctx: click.Context, as_json: bool, output: str | None, plot_path: str,
          no_plot: bool, compare: str, only: str, scale: float, runs: int,
          quick: bool, metrics: bool, soak_rate: float | None) -> None:
    """Benchmark skipjack (the database's raw limits, the SQL ceiling, W1-W10, worker hosts,
    memory, the dashboard; the soak on request), optionally side by side with other
    PostgreSQL queues (W1-W4; see docs/performance.md). Each scenario runs in a schema or
    database of its own, dropped afterwards. Use --dsn on the main command for a server;
    else the embedded one."""
    obj: dict[str, Any] = ctx.obj or {}
    console = Console(stderr=as_json)
    peers = _names(compare, known_peers(), "peer")
    scenarios = _names(only, SCENARIOS + OPTIONAL, "scenario")
    if quick:
        scale, runs = min(scale, 0.01), 1
    logging.getLogger("skipjack").setLevel(logging.WARNING)
    settings = Settings(dsn=resolve_dsn(obj.get("dsn")), scale=scale, runs=runs, quick=quick,
                        metrics=metrics, soak_rate=soak_rate,
                        log=lambda line: console.print(f"[dim]{escape(line)}[/]"))
    settings.log(f"database: {server_of(obj.get('dsn'))} (each scenario in a schema or database "
                 "of its own)")
    results = run_bench(settings, scenarios, peers)
    if not no_plot:
        skipped, files = write_plot(results, plot_path)
        results["plot"] = {"path": None, "skipped": skipped} if skipped else {
            "path": files[0] if files else None, "files": files}
        console.print(f"plot skipped: {skipped}" if skipped
                      else f"plot written to {', '.join(files)}", markup=False)
    text = json.dumps(results, indent=1, default=str)
    if output:
        with open(output, "w") as out:
            out.write(text + "\n")
    print_report(results, console)
    if as_json:
        sys.stdout.write(text + "\n")
