"""The ``skipjack`` command line."""

from __future__ import annotations

import difflib
import importlib
import json
import logging
import os
import signal
import sys
import traceback
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

import click
import psycopg
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import actions, durations, embedded
from .app import App
from .db import connection_lost
from .errors import ConfigError, SkipjackError
from .jobs import DEFAULT_RETENTION, STATES
from .logs import LogFormat, configure, parse_levels
from .migrate import LOCK_ATTEMPTS, LOCK_ATTEMPTS_MAX, LOCK_TIMEOUT
from .search import JobFilter


def parse_duration(value: str) -> float:
    """``skipjack.durations.parse_duration`` for the command line.

    Raises:
        click.BadParameter: the text is not a duration.
    """
    try:
        return durations.parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


class Duration(click.ParamType):  # type: ignore[type-arg]
    """A duration option: ``500ms``, ``30s``, ``5m``, ``12h``, ``7d`` or seconds; given to
    the command as seconds (``float``). With ``off=True``, ``off`` gives None."""

    name = "duration"

    def __init__(self, off: bool = False) -> None:
        self.off = off

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float | None:
        if value is None or isinstance(value, float):
            return value
        if self.off and str(value).strip().lower() in ("off", "never", "none"):
            return None
        try:
            return durations.parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = Duration()
DURATION_OR_OFF = Duration(off=True)
DEFAULT_RETENTION_DAYS = round(DEFAULT_RETENTION / 86400)


def _app(ctx: click.Context, app_path: str | None = None) -> App:
    """The app of MODULE:APP when given, else the one the caller set (``obj["app"]``: the
    Django management command's), else one of --dsn and --schema."""
    obj: dict[str, Any] = ctx.obj
    if app_path:
        app = load_app(app_path, obj["dsn"], obj["schema"])
    elif obj.get("app") is not None:
        app = obj["app"]
    else:
        app = App(obj["dsn"], schema=obj["schema"])
        ctx.call_on_close(app.close)  # its pool's threads end before the interpreter does
    _say_where(ctx, app)
    return app


def _say_where(ctx: click.Context, app: App) -> None:
    """Name the database a command works on, in the log (stderr), once per command."""
    obj: dict[str, Any] = ctx.obj
    if obj.get("told") is not app:
        logging.getLogger("skipjack.cli").info("database: %s", app.db.where())
        obj["told"] = app


def _task_app(ctx: click.Context, app_path: str | None) -> App:
    """``_app`` for the commands that need the app's tasks: MODULE:APP is required
    unless the caller set the app."""
    if not app_path and ctx.obj.get("app") is None:
        raise click.UsageError("Missing argument 'MODULE:APP'.")
    return _app(ctx, app_path)


def _exit_before_start(_sig: int, _frame: object) -> None:
    logging.getLogger("skipjack.worker").info("stopped before it started")
    embedded.release()
    os._exit(0)


def load_app(path: str, dsn: str | None, schema: str | None) -> App:
    """Import ``module:attribute`` (an ``App``) from the current directory or sys.path.

    Raises:
        click.BadParameter: ``path`` is not MODULE:APP, the module is not found, or its
            attribute is not an App.
        click.exceptions.Exit: (status 2) importing the module raised; the module's own
            frames of the traceback and an ``error: ...`` line are printed first.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise click.BadParameter(f"{path!r}: expected MODULE:APP, e.g. myproject.jobs:app")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:  # SystemExit or KeyboardInterrupt from a module too
        if isinstance(exc, ModuleNotFoundError) and exc.name is not None \
                and (module_name + ".").startswith(exc.name + "."):
            raise click.BadParameter(
                f"{path!r}: no module {exc.name!r} in the current directory ({os.getcwd()}) "
                "or on sys.path; run from the directory that holds it, or add that to "
                "PYTHONPATH") from None
        _import_failed(path, module_name, exc)
    app = getattr(module, attr, None)
    if not isinstance(app, App):
        raise click.BadParameter(f"{path!r} is not a skipjack App")
    if dsn:
        app.db.dsn = dsn
    if schema and schema != app.schema:
        raise click.BadParameter(f"--schema (or $SKIPJACK_SCHEMA) {schema!r} differs from the "
                                 f"app's schema {app.schema!r}")
    return app


def _import_failed(path: str, module_name: str, exc: BaseException) -> NoReturn:
    """Say that importing ``module_name`` (of MODULE:APP ``path``) raised ``exc``: the
    traceback's frames outside the import machinery and this module (the application's
    own), the exception, and an ``error: ...`` line; then exit with status 2."""
    machinery = os.path.dirname(importlib.__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(("<frozen importlib", machinery))
              and f.filename != __file__]
    click.echo("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
               + "".join(traceback.format_exception_only(exc)), err=True, nl=False)
    click.echo(f"error: importing {module_name!r} (of {path!r}) raised "
               f"{type(exc).__name__}: {str(exc).strip()}", err=True)
    raise click.exceptions.Exit(2)


# Commands of the separate skipjack-tools distribution: name -> (module, attribute, the
# summary --help lists). The module is imported only when the command is invoked or its own
# help is asked for.
_TOOL_COMMANDS: dict[str, tuple[str, str, str]] = {
    "bench": ("skipjack_tools.bench.command", "bench",
              "Benchmark skipjack (W1-W8, the SQL ceiling, memory), optionally side by side "
              "with other PostgreSQL queues."),
    "chaos": ("skipjack_tools.commands", "chaos",
              "Run jobs while killing, stalling and cutting off workers and restarting "
              "PostgreSQL; audit lost, stuck and duplicated work (exit 1 on any)."),
    "demo": ("skipjack_tools.commands", "demo",
             "Deliver webhooks to a flaky local receiver and audit the outcome."),
}
_TOOLS_MISSING = ("error: `skipjack {name}` is part of skipjack-tools, a separate distribution "
                  "that is not installed; install it with `pip install ./tools` from a "
                  "checkout of skipjack (`pip install './tools[bench]'` adds the benchmark's "
                  "plot)")


class _Main(click.Group):
    """The main group: the library's commands, and those of skipjack-tools loaded lazily."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_TOOL_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _TOOL_COMMANDS:
            return super().get_command(ctx, cmd_name)
        module_name, attr, _ = _TOOL_COMMANDS[cmd_name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != "skipjack_tools":
                raise  # skipjack-tools is installed; something it imports is not
            if ctx.resilient_parsing:  # shell completion: just no such command
                return None
            click.echo(_TOOLS_MISSING.format(name=cmd_name), err=True)
            ctx.exit(2)
        command = getattr(module, attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{module_name}.{attr} is not a click command")
        name_env_vars(command, f"SKIPJACK_{cmd_name.upper()}")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list of ``--help``, without importing skipjack-tools."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            if name in _TOOL_COMMANDS:  # a summary, not the command (not imported)
                command: click.Command | None = click.Command(name, help=_TOOL_COMMANDS[name][2])
            else:
                command = super().get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_Main)
@click.version_option(package_name="skipjack", message="skipjack %(version)s")
@click.option("--dsn", envvar="SKIPJACK_DATABASE_URL", default=None,
              help="PostgreSQL URI. Default: $SKIPJACK_DATABASE_URL, $DATABASE_URL, "
                   "else the embedded server.")
@click.option("--schema", envvar="SKIPJACK_SCHEMA", default=None,
              help="Schema of skipjack's tables [$SKIPJACK_SCHEMA, else skipjack].")
@click.option("--log-level", "log_levels", multiple=True, envvar="SKIPJACK_LOG_LEVEL",
              metavar="[LOGGER=]LEVEL",
              help="Log level (DEBUG, INFO, WARNING, ERROR), or one logger's, e.g. "
                   "skipjack.jobs=WARNING to drop the line per succeeded job; repeat, or join "
                   "with commas [$SKIPJACK_LOG_LEVEL, else INFO].")
@click.option("--log-format", type=click.Choice(["text", "json"], case_sensitive=False),
              default="text", envvar="SKIPJACK_LOG_FORMAT", show_default=True,
              help="text, or one JSON object per line with every field of the record "
                   "[$SKIPJACK_LOG_FORMAT].")
@click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level.")
@click.option("-q", "--quiet", is_flag=True, help="Log warnings and errors only.")
@click.pass_context
def main(ctx: click.Context, dsn: str | None, schema: str | None, log_levels: tuple[str, ...],
         log_format: LogFormat, verbose: bool, quiet: bool) -> None:
    """skipjack: a PostgreSQL job queue built on FOR UPDATE SKIP LOCKED.

    Every option can also be set in the environment, under the name its help shows
    (env var: ...): SKIPJACK_<COMMAND>_<OPTION> unless named otherwise, e.g.
    SKIPJACK_WORKER_CONCURRENCY=20, SKIPJACK_JOBS_LIST_LIMIT=10. Durations take a unit:
    500ms, 30s, 5m, 12h, 7d.
    """
    _configure_logging(log_levels, log_format, verbose, quiet)
    given = (ctx.obj or {}).get("app")
    for name in ("dsn", "schema"):
        if given is not None and \
                ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            raise click.UsageError(f"--{name} is not used here: the commands work on "
                                   f"{given.db.where()}")
    ctx.obj = {**(ctx.obj or {}), "dsn": dsn, "schema": schema,
               "logging": (log_levels, log_format, verbose, quiet)}


def _configure_logging(log_levels: tuple[str, ...], log_format: LogFormat, verbose: bool,
                       quiet: bool) -> None:
    if verbose and quiet:
        raise click.UsageError("give -v (DEBUG) or -q (warnings only), not both")
    try:
        root, loggers = parse_levels(log_levels)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--log-level") from None
    if verbose or quiet:
        root = logging.DEBUG if verbose else logging.WARNING
    fmt: LogFormat = "json" if log_format.lower() == "json" else "text"
    configure(logging.INFO if root is None else root, fmt, loggers)


def _serving(what: str, host: str, port: int) -> ConfigError:
    return ConfigError(f"cannot listen on {host}:{port} for {what}: the port is in "
                                "use, or the address is not this host's")


@main.command()
@click.argument("app_path", metavar="[MODULE:APP]", required=False)
@click.option("--lock-timeout", default=f"{LOCK_TIMEOUT:g}s", show_default=True,
              type=DURATION,
              help="The longest each lock wait lasts (the queue's statements on a table "
                   "wait behind it meanwhile).")
@click.option("--attempts", default=LOCK_ATTEMPTS, show_default=True,
              type=click.IntRange(1, LOCK_ATTEMPTS_MAX),
              help="Tries when a lock wait timed out, with a backoff between.")
@click.option("--check", is_flag=True,
              help="Apply nothing: list the pending migrations, exit 1 if there are any.")
@click.option("--sql", "as_sql", is_flag=True,
              help="Apply nothing: print the SQL of the pending migrations (rendered for the "
                   "schema) for a DBA to run: one transaction, each migration followed by "
                   "its record.")
@click.pass_context
def migrate(ctx: click.Context, app_path: str | None, lock_timeout: float, attempts: int,
            check: bool, as_sql: bool) -> None:
    """Create or upgrade the schema (safe to run from many processes at once, and while
    workers run: it gives up a lock wait after --lock-timeout and tries again). With
    MODULE:APP, the database and schema of that app."""
    app = _app(ctx, app_path)
    if check or as_sql:
        from .migrate import pending, pending_sql

        with app.connect() as conn:
            waiting = pending(conn, app.schema)
            if as_sql:
                click.echo(pending_sql(conn, app.schema, waiting), nl=False)
        if check:
            click.echo(f"pending migrations: {[m.version for m in waiting]}" if waiting
                       else "schema is up to date", err=as_sql)
            ctx.exit(1 if waiting else 0)
        return
    applied = app.migrate(lock_timeout=lock_timeout, attempts=attempts)
    click.echo(f"applied migrations {applied}" if applied else "schema is up to date")


@main.command()
@click.option("--worker", "worker_role", metavar="ROLE", default=None,
              help="Role that workers, the dashboard and the operating commands log in as: "
                   "rows of every table, no DDL.")
@click.option("--enqueuer", "enqueuer_role", metavar="ROLE", default=None,
              help="Role of an application that enqueues and reads jobs (and waits for "
                   "results) only: it cannot claim, change or delete jobs.")
@click.option("--sql", "as_sql", is_flag=True,
              help="Grant nothing: print the statements for a DBA to run.")
@click.pass_context
def roles(ctx: click.Context, worker_role: str | None, enqueuer_role: str | None,
          as_sql: bool) -> None:
    """Grant least-privilege roles their privileges on the migrated schema. Run it as the
    schema's owner (the role that migrates) or a superuser, and again after upgrades; the
    roles must exist (CREATE ROLE). See docs/deployment.md, "Roles"."""
    from . import roles as grants

    if worker_role is None and enqueuer_role is None:
        raise click.UsageError("give --worker ROLE, --enqueuer ROLE, or both")
    app = _app(ctx)
    with app.connect() as conn:
        if as_sql:
            done = grants.grants(conn, app.schema, worker=worker_role, enqueuer=enqueuer_role)
            click.echo(grants.grants_sql(conn, done), nl=False)
            return
        done = grants.grant(conn, app.schema, worker=worker_role, enqueuer=enqueuer_role)
    given = [f"{kind} {role!r}" for kind, role in (("worker", worker_role),
                                                   ("enqueuer", enqueuer_role)) if role]
    click.echo(f"granted {' and '.join(given)} their privileges on schema {app.schema!r} "
               f"({len(done)} statements)")


@main.command()
@click.argument("app_path", metavar="[MODULE:APP]", required=False)
@click.option("-q", "--queue", "queues", multiple=True, default=["default"], show_default=True,
              help="Queue to serve; repeat for several.")
@click.option("-c", "--concurrency", default=10, show_default=True, type=int)
@click.option("--processes", default="1", show_default=True,
              help="Worker processes to run and supervise (restarting one that dies, "
                   "forwarding SIGTERM/SIGINT, one metrics endpoint for all); auto: one per "
                   "core.")
@click.option("--batch-size", default=None, type=int,
              help="Jobs per claim [concurrency + prefetch, at most 1000].")
@click.option("--lease", default="30s", show_default=True, type=DURATION,
              help="How long a claim lasts without renewal.")
@click.option("--heartbeat", default=None, type=DURATION, help="[lease/6, at most 10s].")
@click.option("--poll-interval", default="5s", show_default=True, type=DURATION,
              help="Polling when no notification comes.")
@click.option("--rescue-interval", default=None, type=DURATION,
              help="[lease/2, at most 15s].")
@click.option("--grace", default="30s", show_default=True, type=DURATION,
              help="How long running jobs get after SIGTERM.")
@click.option("--stage-interval", default="1s", show_default=True, type=DURATION,
              help="Between runs of the stager (makes due scheduled jobs runnable).")
@click.option("--retention", default=f"{DEFAULT_RETENTION_DAYS}d", show_default=True,
              type=DURATION_OR_OFF,
              help="Prune succeeded/cancelled jobs older than this; off keeps them forever.")
@click.option("--discarded-retention", default=None, type=DURATION,
              help="Prune discarded jobs older than this [10 x retention].")
@click.option("--prefetch", default=None, type=click.IntRange(0, 10_000),
              help="Jobs claimed ahead of free slots, 0 to 10000 [adaptive: about 50 ms of "
                   "work at the handlers' average run time, 0 to 1000].")
@click.option("--fairness-every", default=10, show_default=True, type=click.IntRange(0),
              help="Every n-th claim that takes jobs from a queue takes the oldest ones "
                   "of the priority that has waited longest (0: strict priority).")
@click.option("--unknown-task-grace", default="10m", show_default=True, type=DURATION,
              help="A job of a task this worker does not know is released for other workers "
                   "(its attempt not counted) until it has waited this long since its "
                   "enqueue, then discarded.")
@click.option("--name", default="", help="Worker name shown on claimed jobs.")
@click.option("--migrate/--no-migrate", default=False, help="Migrate the schema first.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              envvar="SKIPJACK_METRICS_PORT",
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (needs "
                   "prometheus_client: pip install 'skipjack[prometheus]') "
                   "[$SKIPJACK_METRICS_PORT; off].")
@click.option("--metrics-host", default="0.0.0.0", show_default=True,
              envvar="SKIPJACK_METRICS_HOST", help="Address the metrics listen on.")
@click.option("--health-port", type=click.IntRange(1, 65535), default=None,
              envvar="SKIPJACK_HEALTH_PORT",
              help="Serve /livez and /readyz for probes [$SKIPJACK_HEALTH_PORT; off].")
@click.option("--health-host", default="0.0.0.0", show_default=True,
              envvar="SKIPJACK_HEALTH_HOST", help="Address the health checks listen on.")
@click.option("--log-level", "log_levels", multiple=True, metavar="[LOGGER=]LEVEL",
              help="As `skipjack --log-level`, added to it.")
@click.option("--log-format", type=click.Choice(["text", "json"], case_sensitive=False),
              default=None, help="As `skipjack --log-format`.")
@click.option("-v", "--verbose", is_flag=True, help="As `skipjack -v`.")
@click.option("--reload", is_flag=True,
              help="Development: restart the worker when a Python file under --reload-dir "
                   "changes (needs watchfiles: pip install 'skipjack[reload]').")
@click.option("--reload-dir", "reload_dirs", multiple=True, metavar="DIR",
              type=click.Path(file_okay=False), help="Directory --reload watches; repeat for "
                                                    "several [the current directory].")
@click.pass_context
def worker(ctx: click.Context, app_path: str | None, queues: tuple[str, ...], concurrency: int,
           processes: str, batch_size: int | None, lease: float, heartbeat: float | None,
           poll_interval: float, rescue_interval: float | None, grace: float,
           stage_interval: float, retention: float | None, discarded_retention: float | None,
           prefetch: int | None, fairness_every: int, unknown_task_grace: float, name: str,
           migrate: bool, metrics_port: int | None, metrics_host: str,
           health_port: int | None, health_host: str, log_levels: tuple[str, ...],
           log_format: LogFormat | None, verbose: bool, reload: bool,
           reload_dirs: tuple[str, ...]) -> None:
    """Run a worker for the tasks of MODULE:APP (under Django's manage.py: of the project's
    app, without MODULE:APP)."""
    count = _process_count(processes)
    if reload:
        from . import reload as reloading
        from .supervisor import command_line

        argv = [*command_line(), *reloading.without_reload(sys.argv[1:])]
        reloading.run(argv, reload_dirs or [os.getcwd()], grace=grace)
        return
    if count > 1 and not os.environ.get("SKIPJACK_WORKER_PROCESS"):
        from .runtime.worker import NAME_MAX_BYTES
        from .supervisor import Supervisor, child_argv, command_line

        longest = f"{name}-{count - 1}".encode(errors="replace")
        if name and len(longest) > NAME_MAX_BYTES:
            raise click.BadParameter(
                f"{len(longest)} bytes with the process number appended ({name}-{count - 1}"
                f"), at most {NAME_MAX_BYTES}", param_hint="--name")

        argv = child_argv(sys.argv[1:], ["--processes", "--metrics-port", "--metrics-host",
                                         "--health-port", "--health-host", "--name"])
        metrics = (metrics_host, metrics_port) if metrics_port is not None else None
        health = (health_host, health_port) if health_port is not None else None
        sys.exit(Supervisor([*command_line(), *argv], count, grace=grace, name=name,
                            metrics=metrics, health=health).run())
    if log_levels or log_format or verbose:  # the worker's own logging options
        levels, fmt, loud, quiet = ctx.obj["logging"]
        _configure_logging((*levels, *log_levels), log_format or fmt, loud or verbose,
                           quiet and not verbose)
    # a stop that comes while the worker starts (nothing claimed yet) ends it quietly, with
    # status 0; once it runs, the worker's own handlers stop it gracefully
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_before_start)
    from .runtime.worker import Worker

    app = _task_app(ctx, app_path)
    w = Worker(app, list(queues), concurrency=concurrency, batch_size=batch_size, lease=lease,
               heartbeat=heartbeat, poll_interval=poll_interval, rescue_interval=rescue_interval,
               shutdown_grace=grace, stage_interval=stage_interval,
               retention=retention, discarded_retention=discarded_retention,
               prefetch=prefetch, fairness_every=fairness_every,
               unknown_task_grace=unknown_task_grace, name=name)
    if os.environ.get("SKIPJACK_WORKER_PROCESS"):
        from .supervisor import follow_supervisor

        follow_supervisor(w.started, w.stop)
    if migrate:
        app.migrate()
    if metrics_port is not None:
        serve_metrics = _metrics_module().serve_worker
        try:
            serve_metrics(w, metrics_port, metrics_host)
        except OSError:
            raise _serving("metrics", metrics_host, metrics_port) from None
        _log_address("metrics at http://%s:%d/metrics", metrics_host, metrics_port)
    if health_port is not None:
        from .runtime.health import serve_health

        try:
            serve_health(w, health_port, health_host)
        except OSError:
            raise _serving("health checks", health_host, health_port) from None
        _log_address("health checks at http://%s:%d/livez and /readyz", health_host,
                     health_port)
    w.run()
    embedded.release()  # os._exit skips the atexit hook that would
    logging.shutdown()
    os._exit(0)  # do not wait for sync handler threads that ignored the shutdown


def _log_address(message: str, host: str, port: int) -> None:
    """Log where the worker serves an endpoint; under ``--processes`` only at DEBUG (the
    address is the supervisor's to read, which logs its own)."""
    supervised = bool(os.environ.get("SKIPJACK_WORKER_PROCESS"))
    logging.getLogger("skipjack.worker").log(logging.DEBUG if supervised else logging.INFO,
                                             message, host, port)


def _process_count(value: str) -> int:
    """``--processes``: a count 1..1,024, or ``auto`` (one per core)."""
    if value.strip().lower() == "auto":
        return max(1, os.cpu_count() or 1)
    try:
        count = int(value)
    except ValueError:
        count = 0
    if not 1 <= count <= 1024:
        raise click.BadParameter(f"{value!r} must be 1..1024 or auto", param_hint="--processes")
    return count


def _metrics_module() -> Any:
    try:
        from . import metrics
    except ModuleNotFoundError as exc:
        if exc.name != "prometheus_client":
            raise
        raise ConfigError("metrics need prometheus_client: pip install "
                          "'skipjack[prometheus]'") from None
    return metrics


@main.command("metrics")
@click.option("--port", type=click.IntRange(1, 65535), default=9808, show_default=True,
              envvar="SKIPJACK_QUEUE_METRICS_PORT", help="[$SKIPJACK_QUEUE_METRICS_PORT]")
@click.option("--host", default="0.0.0.0", show_default=True,
              envvar="SKIPJACK_QUEUE_METRICS_HOST",
              help="Address to listen on [$SKIPJACK_QUEUE_METRICS_HOST].")
@click.option("--cache", "cache_seconds", default="10s", show_default=True, type=DURATION,
              envvar="SKIPJACK_QUEUE_METRICS_CACHE",
              help="How long one reading of the database serves scrapes "
                   "[$SKIPJACK_QUEUE_METRICS_CACHE].")
@click.pass_context
def metrics_command(ctx: click.Context, port: int, host: str, cache_seconds: float) -> None:
    """Serve queue-level Prometheus gauges read from the database (depth per queue and
    state, oldest runnable age, dead letter size, paused queues, limits, live workers) at
    http://HOST:PORT/metrics, until stopped. Counts use the partial indexes of the waiting,
    running and discarded jobs, never the history; one reading serves --cache seconds."""
    cache = cache_seconds
    if not 0 <= cache <= 3600:
        raise click.BadParameter(f"{cache_seconds!r} must be 0 to 1h", param_hint="--cache")
    app = _app(ctx)
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # for sigwait (the server thread inherits it)
    try:
        server = _metrics_module().serve_queue(app, port, host, cache)
    except OSError:
        raise _serving("queue metrics", host, port) from None
    click.echo(f"serving queue metrics of schema {app.schema!r} at "
               f"http://{host}:{server.server_port}/metrics (Ctrl-C stops)", err=True)
    try:
        signal.sigwait(stop)
    finally:
        server.shutdown()


@main.command()
@click.argument("app_path", metavar="[MODULE:APP]", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, envvar="SKIPJACK_DASHBOARD_HOST",
              help="Address to listen on; any but a loopback one needs credentials "
                   "[$SKIPJACK_DASHBOARD_HOST].")
@click.option("--port", type=click.IntRange(0, 65535), default=8700, show_default=True,
              envvar="SKIPJACK_DASHBOARD_PORT", help="[$SKIPJACK_DASHBOARD_PORT]")
@click.option("--read-only", is_flag=True, envvar="SKIPJACK_DASHBOARD_READ_ONLY",
              help="Pages only: refuse every action [$SKIPJACK_DASHBOARD_READ_ONLY].")
@click.pass_context
def dashboard(ctx: click.Context, app_path: str | None, host: str, port: int,
              read_only: bool) -> None:
    """Serve the web dashboard at http://HOST:PORT/ until stopped: queues, jobs (filter,
    retry, cancel, discard), cron schedules, workers, and enqueue by hand. Give the app
    (MODULE:APP) to list its tasks and run its cron schedules. Credentials come from
    $SKIPJACK_DASHBOARD_TOKEN, or $SKIPJACK_DASHBOARD_USER and $SKIPJACK_DASHBOARD_PASSWORD
    (HTTP basic auth; with a token, any user name and the token as password)."""
    try:
        from . import dashboard as web
    except ModuleNotFoundError as exc:
        if exc.name not in ("starlette", "jinja2", "uvicorn", "multipart",
                            "python_multipart"):
            raise
        raise ConfigError("the dashboard needs its extra: pip install "
                          "'skipjack[dashboard]'") from None
    app = _app(ctx, app_path)
    credentials = web.Credentials.from_env()
    if credentials is None and not web.is_loopback(host):
        raise click.UsageError(f"--host {host}: the dashboard listens beyond this machine "
                               "only with credentials; set SKIPJACK_DASHBOARD_TOKEN, or "
                               "SKIPJACK_DASHBOARD_USER and SKIPJACK_DASHBOARD_PASSWORD")
    try:
        sock = web.listen(host, port)
    except OSError:
        raise _serving("the dashboard", host, port) from None
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"serving the dashboard of schema {app.schema!r} at "
               f"http://{shown}:{sock.getsockname()[1]}/"
               f"{' (read-only)' if read_only else ''}"
               f"{' (sign-in required)' if credentials else ''} (Ctrl-C stops)", err=True)
    web.serve(app, sock, read_only=read_only, credentials=credentials)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per worker.")
@click.pass_context
def workers(ctx: click.Context, as_json: bool) -> None:
    """The live workers: name, host, pid, version, queues, concurrency, jobs running, when
    they started and were last seen (a worker that stopped without saying so drops out
    once its row expires, within about 3 heartbeats + 5 s)."""
    rows = _app(ctx).workers()
    if as_json:
        for row in rows:
            click.echo(json.dumps(row, default=str))
        return
    table = Table(title=f"live workers: {len(rows)}")
    for col in ["name", "host", "pid", "version", "queues", "concurrency", "running",
                "started", "last seen"]:
        table.add_column(col)
    for row in rows:  # names are the workers' own: shown as text, never as markup
        table.add_row(escape(row["name"]), escape(row["host"]), str(row["pid"]),
                      escape(row["version"]), escape(", ".join(row["queues"])),
                      str(row["concurrency"]), str(row["running"]),
                      row["started_at"].isoformat(timespec="seconds"),
                      row["last_seen"].isoformat(timespec="seconds"))
    _console().print(table)


def _console() -> Console:
    """Where tables go: the terminal's width, or 200 columns when the output is piped (rich's
    80 cut task names and times short)."""
    return Console(width=None if sys.stdout.isatty() else 200)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Queue depth (scheduled, available, running), the oldest runnable job's age, and the
    newest discarded jobs."""
    data = _app(ctx).stats()
    if as_json:
        click.echo(json.dumps(data, default=str))
        return
    console = _console()
    table = Table(title="jobs")
    states = ["scheduled", "available", "running"]
    for col in ["queue", *states, "oldest runnable (s)"]:
        table.add_column(col, justify="left" if col == "queue" else "right")
    for queue, counts in sorted(data["queues"].items()):
        age = data["oldest_runnable_seconds"].get(queue)
        table.add_row(escape(queue), *(str(counts.get(s, 0)) for s in states),
                      f"{age:.1f}" if age is not None else "-")
    console.print(table)
    if data["settings"]:
        settings = Table(title="queue settings")
        for col in ["queue", "paused", "concurrency limit", "rate limit"]:
            settings.add_column(col)
        for queue, row in sorted(data["settings"].items()):
            rate = (f"{row['rate_limit']} per {row['rate_period']:g}s" if row["rate_limit"]
                    else "-")
            settings.add_row(escape(queue), "paused" if row["paused"] else "-",
                             str(row["concurrency_limit"] or "-"), rate)
        console.print(settings)
    if data["discarded"]:
        dead = Table(title="discarded (newest first)")
        for col in ["id", "queue", "task", "attempt", "finished_at", "last error"]:
            dead.add_column(col)
        for row in data["discarded"]:
            err = (row["last_error"] or {}).get("error", "")
            dead.add_row(str(row["id"]), escape(row["queue"]), escape(row["task"]),
                         str(row["attempt"]), str(row["finished_at"]), escape(err[:80]))
        console.print(dead)


@main.group()
def jobs() -> None:
    """Inspect jobs and re-enqueue discarded ones."""


@jobs.command("list")
@click.option("--state", default=None, type=click.Choice(STATES))
@click.option("--queue", default=None)
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 100_000))
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


def _selection(func: Any) -> Any:
    """The options that pick jobs by filter, for retry, cancel and discard."""
    options = [
        click.argument("job_ids", type=int, nargs=-1),
        click.option("--queue", default=None, help="Jobs of this queue."),
        click.option("--task", default=None, help="Jobs of this task."),
        click.option("--since", default=None,
                     help="Jobs enqueued since: a duration ago (1h, 2d) or an ISO time."),
        click.option("--until", default=None,
                     help="Jobs enqueued before: a duration ago or an ISO time."),
        click.option("--error-contains", "error", default=None,
                     help="Jobs with this text (any case) in an attempt's error."),
        # no environment variable (envvar=[]): acting on every job must be asked for on the
        # command line itself
        click.option("--all", "everything", is_flag=True, envvar=[],
                     help="Every job the action applies to (no other filter needed); not "
                          "read from the environment."),
        click.option("--dry-run", is_flag=True,
                     help="Change nothing: say what would be done, job by job."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _when(text: str | None, name: str) -> datetime | None:
    """An ISO time (UTC when it has no zone) or a duration ago."""
    if text is None:
        return None
    try:
        return datetime.now(UTC) - timedelta(seconds=durations.parse_duration(text))
    except ValueError:
        pass
    except OverflowError:
        raise click.BadParameter(f"{text!r} reaches before year 1", param_hint=name) from None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is neither a duration (1h, 2d) nor an ISO time",
                                 param_hint=name) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _act(ctx: click.Context, action: actions.Action, job_ids: tuple[int, ...],
         queue: str | None, task: str | None, since: str | None, until: str | None,
         error: str | None, everything: bool, dry_run: bool) -> None:
    """Apply ``action`` to the ids, or to every job the filter matches, one line per job and
    a summary; exit status 1 when any job was left alone."""
    filtered = any(v is not None for v in (queue, task, since, until, error))
    if job_ids and (filtered or everything):
        raise click.UsageError("give job ids, or a filter (--queue, --task, --since, --until, "
                               "--error-contains, --all), not both")
    if not job_ids and not filtered and not everything:
        raise click.UsageError("give job ids, a filter (--queue, --task, --since, --until, "
                               "--error-contains), or --all")
    app = _app(ctx)
    if job_ids:
        account = (actions.preview(app, action, job_ids) if dry_run
                   else actions.apply(app, action, job_ids))
    else:
        where = JobFilter(queue=queue, task=task, since=_when(since, "--since"),
                          until=_when(until, "--until"), error=error)
        account = actions.apply_matching(app, action, where, dry_run=dry_run)
    for job_id, outcome in account.outcomes.items():
        click.echo(f"{job_id}\t{outcome}")
    click.echo(account.describe(), err=True)
    if not account.outcomes and queue is not None:
        _say_if_no_such_queue(app, queue)
    if account.left_alone and job_ids:
        ctx.exit(1)


def _say_if_no_such_queue(app: App, queue: str) -> None:
    """After a filter of ``--queue`` matched nothing: say so when the queue holds no waiting,
    running or discarded job at all (a misspelt name), with the near misses among those that
    do."""
    depth = app.queue_summary()["depth"]
    if queue in depth:
        return
    close = difflib.get_close_matches(queue, list(depth), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    click.echo(f"(no job of the queue {queue!r} is waiting, running or discarded{hint})",
               err=True)


@jobs.command("retry")
@_selection
@click.pass_context
def jobs_retry(ctx: click.Context, /, job_ids: tuple[int, ...], **selection: Any) -> None:
    """Re-enqueue discarded jobs (by id or filter) with a fresh set of attempts. Prints one
    line per job (retried, or why it was left alone: no such job, not discarded, its
    idempotency key held by another job) and a count; exit status 1 when an id given was
    left alone."""
    _act(ctx, "retry", job_ids, **selection)


@jobs.command("cancel")
@_selection
@click.pass_context
def jobs_cancel(ctx: click.Context, /, job_ids: tuple[int, ...], **selection: Any) -> None:
    """Cancel jobs (by id or filter): waiting ones at once, running ones by request to their
    worker. One line per job, and a count."""
    _act(ctx, "cancel", job_ids, **selection)


@jobs.command("discard")
@_selection
@click.pass_context
def jobs_discard(ctx: click.Context, /, job_ids: tuple[int, ...], **selection: Any) -> None:
    """Send waiting jobs (by id or filter) to the dead letter; running ones are left alone.
    One line per job, and a count."""
    _act(ctx, "discard", job_ids, **selection)


@main.group()
def queues() -> None:
    """Pause, resume and limit queues across every worker."""


@queues.command("list")
@click.pass_context
def queues_list(ctx: click.Context) -> None:
    """Queues with a setting, one JSON object a line."""
    for row in _app(ctx).queues():
        click.echo(json.dumps(row))


@queues.command("pause")
@click.argument("queue")
@click.pass_context
def queues_pause(ctx: click.Context, queue: str) -> None:
    """Stop claiming from QUEUE (running jobs go on)."""
    _app(ctx).pause_queue(queue)
    click.echo(f"paused {queue}")


@queues.command("resume")
@click.argument("queue")
@click.pass_context
def queues_resume(ctx: click.Context, queue: str) -> None:
    """Claim from QUEUE again."""
    _app(ctx).resume_queue(queue)
    click.echo(f"resumed {queue}")


@queues.command("limit")
@click.argument("queue")
@click.option("--concurrency", type=click.IntRange(1), default=None,
              help="At most this many running at once, across all workers.")
@click.option("--rate", type=click.IntRange(1), default=None, help="At most this many claimed...")
@click.option("--per", "period", default=None, type=DURATION,
              help="...per this period (e.g. 1s, 1m).")
@click.pass_context
def queues_limit(ctx: click.Context, queue: str, concurrency: int | None, rate: int | None,
                 period: float | None) -> None:
    """Set QUEUE's limits (an option left out removes that limit)."""
    _app(ctx).set_queue_limits(queue, concurrency=concurrency, rate=rate, period=period)
    click.echo(f"{queue}: concurrency {concurrency or 'unlimited'}, rate "
               f"{f'{rate} per {period:g}s' if rate and period else 'unlimited'}")


@main.command("prune")
@click.option("--retention", default=f"{DEFAULT_RETENTION_DAYS}d", show_default=True,
              type=DURATION, help="Keep succeeded and cancelled jobs this long (e.g. 12h, 7d).")
@click.option("--discarded-retention", default=None, type=DURATION,
              help="Keep discarded jobs this long [10 x retention].")
@click.pass_context
def prune_command(ctx: click.Context, retention: float,
                  discarded_retention: float | None) -> None:
    """Delete finished jobs past their retention, in small batches."""
    deleted = _app(ctx).prune(retention, discarded_retention)
    click.echo(f"deleted {deleted} jobs")


@main.group("embedded")
def embedded_group() -> None:
    """The embedded PostgreSQL server (used when no DSN is set)."""


@embedded_group.command("status")
def embedded_status() -> None:
    """Whether the embedded server runs, where its data is, and which processes use it (as
    JSON; exit status 1 when it is not running)."""
    state = embedded.status()
    click.echo(json.dumps(state))
    if not state["running"]:
        sys.exit(1)


@embedded_group.command("stop")
def embedded_stop() -> None:
    """Stop the embedded server now, whoever uses it (their connections break; a later use
    starts it again)."""
    stopped = embedded.stop()
    click.echo(f"stopped the embedded server at {embedded.data_dir()}" if stopped
               else f"the embedded server at {embedded.data_dir()} is not running")


@main.group()
def cron() -> None:
    """Periodic jobs."""


@cron.command("list")
@click.argument("app_path", metavar="MODULE:APP", required=False)
@click.pass_context
def cron_list(ctx: click.Context, app_path: str | None) -> None:
    """The schedules of MODULE:APP: expression, zone, last slot enqueued, missed slots."""
    app = load_app(app_path, ctx.obj["dsn"], None) if app_path else _task_app(ctx, None)
    _say_where(ctx, app)
    with app.connect() as conn:
        seen = {r[0]: r[1:] for r in conn.execute(app.queries.CRON_LIST).fetchall()}
    for name, entry in sorted(app.crons.items()):
        last, missed = seen.get(name, (None, 0))
        click.echo(json.dumps({"name": name, "cron": entry.schedule.expr,
                               "tz": entry.schedule.tz, "task": entry.task.name,
                               "last_enqueued": str(last) if last else None,
                               "missed": missed}))


def name_env_vars(command: click.Command, prefix: str) -> None:
    """Give every option of ``command`` (and of its subcommands) without a variable of its
    own the environment variable ``<prefix>_<OPTION>``, from its long name: e.g.
    ``skipjack worker --poll-interval`` reads ``SKIPJACK_WORKER_POLL_INTERVAL``."""
    for param in command.params:
        if not isinstance(param, click.Option) or param.hidden or param.is_eager:
            continue  # --help and --version act at once: no variable for them
        if param.envvar is None:
            longest = max(param.opts, key=len).lstrip("-")
            param.envvar = f"{prefix}_{longest.replace('-', '_').upper()}"
        param.show_envvar = True  # --help names it
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            name_env_vars(sub, f"{prefix}_{name.upper()}")


name_env_vars(main, "SKIPJACK")


def run(args: list[str] | None = None, obj: dict[str, Any] | None = None,
        prog_name: str | None = None) -> None:
    """Entry point that turns skipjack errors into a message and exit status 2.

    Args:
        args: the command line after the program's name (default ``sys.argv[1:]``).
        obj: set into the click context, e.g. ``{"app": app}`` for the commands to use
            that app (the Django management command does).
        prog_name: the name usage lines show.
    """
    try:
        main(args=args, obj=obj, prog_name=prog_name, standalone_mode=True)
    except SkipjackError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except psycopg.errors.UndefinedTable as exc:
        click.echo(f"error: {str(exc).strip()}: is the schema migrated? run `skipjack migrate` "
                   "with the same --dsn and --schema (or `skipjack migrate MODULE:APP`)",
                   err=True)
        sys.exit(2)
    except psycopg.Error as exc:
        if connection_lost(exc):
            click.echo(f"error: cannot reach the database: {str(exc).strip()}", err=True)
        elif exc.sqlstate is None and isinstance(exc, psycopg.ProgrammingError):
            click.echo(f"error: the DSN is not a valid connection string: "
                       f"{str(exc).strip()}", err=True)
        else:  # e.g. a foreign key of the application's that refuses a prune
            click.echo(f"error: the database refused a statement ({exc.sqlstate}): "
                       f"{str(exc).strip()}", err=True)
        sys.exit(2)
