"""The ``skipjack demo`` and ``skipjack chaos`` commands.

``skipjack``'s command line loads them (and ``skipjack bench`` from
:mod:`skipjack_tools.bench.command`) when they are invoked; each reads the ``--dsn`` and
``--schema`` of the main command from ``ctx.obj``.
"""

from __future__ import annotations

import json
import logging
import math
import sys

import click
from rich.console import Console

from skipjack.cli import DURATION
from skipjack.db import server_of


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise click.BadParameter(f"{value!r} is not a number of milliseconds")
    return value


@click.command()
@click.option("--jobs", "n_jobs", default=5000, show_default=True,
              type=click.IntRange(1, 1_000_000))
@click.option("--concurrency", default=32, show_default=True, type=click.IntRange(1, 1000))
@click.option("--fail-rate", default=0.1, show_default=True, type=click.FloatRange(0, 0.9),
              help="Share of requests the receiver answers with 429 or 500.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.pass_context
def demo(ctx: click.Context, n_jobs: int, concurrency: int, fail_rate: float,
         as_json: bool) -> None:
    """Deliver webhooks to a flaky local receiver and audit the outcome."""
    from .demo import explain, run_demo

    console = Console(stderr=True)  # the progress bar and log lines; the summary: stdout
    # the summary counts every retry: per-job lines (hundreds of retries) would only scroll
    # through the progress bar; failures of the demo itself still show
    logging.getLogger("skipjack.jobs").setLevel(logging.ERROR)
    if as_json:
        logging.getLogger("skipjack").setLevel(logging.ERROR)
    summary = run_demo(ctx.obj["dsn"], schema=(ctx.obj["schema"] or "skipjack") + "_demo",
                       jobs=n_jobs, concurrency=concurrency, fail_rate=fail_rate,
                       progress=not as_json, console=console)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        Console().print(explain(summary))
    sys.exit(1 if summary["lost"] else 0)


@click.command()
@click.option("--jobs", "n_jobs", default=2000, show_default=True, type=click.IntRange(1, 10**7))
@click.option("--workers", default=4, show_default=True, type=click.IntRange(1, 64),
              help="Worker processes.")
@click.option("--concurrency", default=16, show_default=True, type=click.IntRange(1, 1000))
@click.option("--duration-ms", default=10.0, show_default=True,
              type=click.FloatRange(0, 600_000), callback=lambda ctx, param, v: _finite(v),
              help="Work per job.")
@click.option("--kill-every", default="0", type=DURATION,
              help="SIGKILL a random worker (e.g. 2s); 0: never.")
@click.option("--stall-every", default="0", type=DURATION,
              help="SIGSTOP a worker past its lease, then resume.")
@click.option("--term-every", default="0", type=DURATION,
              help="SIGTERM a worker (a graceful stop) and start its replacement at once, as a "
                   "rolling deploy does.")
@click.option("--restart-db-every", default="0", type=DURATION, help="Restart PostgreSQL.")
@click.option("--terminate-backends-every", default="0", type=DURATION,
              help="pg_terminate_backend every session of the workers.")
@click.option("--restart-cmd", default=None,
              help="Command that restarts an external server, e.g. "
                   "'pg_ctlcluster 15 main restart -m fast'.")
@click.option("--lease", default="2s", show_default=True, type=DURATION,
              help="The workers' lease.")
@click.option("--seed", default=None, type=int)
@click.option("--timeout", default="600s", show_default=True, type=DURATION,
              help="Give up after this long.")
@click.option("--json", "as_json", is_flag=True, help="Print the audit as one JSON object.")
@click.pass_context
def chaos(ctx: click.Context, n_jobs: int, workers: int, concurrency: int, duration_ms: float,
          kill_every: float, stall_every: float, term_every: float, restart_db_every: float,
          terminate_backends_every: float, restart_cmd: str | None, lease: float,
          seed: int | None, timeout: float, as_json: bool) -> None:
    """Run jobs while killing, stalling and cutting off workers and restarting PostgreSQL;
    audit lost, stuck and duplicated work (exit 1 on any)."""
    from .chaos import ChaosOptions, run_chaos

    opts = ChaosOptions(
        jobs=n_jobs, workers=workers, concurrency=concurrency, duration_ms=duration_ms,
        kill_every=kill_every, stall_every=stall_every, term_every=term_every,
        restart_db_every=restart_db_every, terminate_backends_every=terminate_backends_every,
        restart_cmd=restart_cmd, lease=lease, seed=seed, timeout=timeout,
        schema=(ctx.obj["schema"] or "skipjack") + "_chaos")
    logging.getLogger("skipjack.cli").info("database: %s, schema %s", server_of(ctx.obj["dsn"]),
                                           opts.schema)
    try:
        audit = run_chaos(ctx.obj["dsn"], opts, echo=None if as_json else click.echo)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        click.echo(json.dumps(audit))
    else:
        Console().print_json(json.dumps(audit))
    sys.exit(0 if audit["ok"] else 1)
