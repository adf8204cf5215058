"""The command line against a real server: which database each command uses, --version,
durations with units, options from the environment, migrate --check/--sql, and retry, cancel
and discard by id or by filter with a dry run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from skipjack import App, Worker
from skipjack.jobs import DEFAULT_RETENTION
from skipjack.migrate import LATEST_VERSION

from support import TESTS, Server, query


def cli(app: App | None, *args: str, env: dict[str, str] | None = None,
        schema: str | None = None) -> subprocess.CompletedProcess[str]:
    where = [] if app is None else ["--dsn", app.dsn, "--schema", schema or app.schema]
    return subprocess.run([sys.executable, "-m", "skipjack", *where, *args], cwd=TESTS,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def tasks(app: App) -> App:
    app.task(name="t")(lambda **kw: None)
    app.task(name="u")(lambda **kw: None)
    return app


def dead_letter(app: App, task: str, queue: str, error: str, n: int) -> list[int]:
    ids = app.enqueue_many([app.tasks[task].configure(queue=queue).job() for _ in range(n)])
    query(app.dsn, "UPDATE {schema}.jobs SET state = 'discarded', finished_at = now(), "
                   "errors = jsonb_build_array(jsonb_build_object('attempt', 1, "
                   "'error', %s::text)) WHERE id = ANY(%s::bigint[])", (error, ids), app.schema)
    return ids


def test_version_and_the_database_named_by_every_command(tasks: App) -> None:
    version = cli(None, "--version")
    assert version.returncode == 0 and version.stdout.startswith("skipjack ")
    for args in (["stats"], ["jobs", "list"], ["queues", "list"], ["workers"],
                 ["migrate"]):
        done = cli(tasks, *args)
        assert done.returncode == 0, done.stderr
        first = done.stderr.splitlines()[0]
        assert "skipjack.cli: database: " in first and f"schema {tasks.schema}" in first, args
        assert "password" not in first
    quiet = cli(tasks, "-q", "stats")
    assert "database:" not in quiet.stderr
    # piped, the tables are 200 columns wide, not 80: a long task name shows whole
    long_name = "myapp.notifications.tasks.send_weekly_digest"
    tasks.task(name=long_name)(lambda **kw: None)
    (dead,) = dead_letter(tasks, long_name, "digests", "ValueError: no", 1)
    shown = cli(tasks, "stats")
    assert long_name in shown.stdout and f"{dead}" in shown.stdout, shown.stdout
    as_json = cli(tasks, "--log-format", "json", "stats")
    assert '"message": "database: ' in as_json.stderr.splitlines()[0]
    unreachable = cli(None, "--dsn", "postgresql://nobody@127.0.0.1:1/none", "stats")
    assert unreachable.returncode == 2
    assert "database: user=nobody dbname=none host=127.0.0.1 port=1, schema skipjack" \
        in unreachable.stderr
    assert "cannot reach the database" in unreachable.stderr


def test_migrate_check_and_sql(server: Server) -> None:
    server_dsn = server.dsn
    schema = "cli_" + os.urandom(4).hex()
    app = App(server_dsn, schema=schema)
    try:
        check = cli(app, "migrate", "--check")
        assert check.returncode == 1
        assert f"pending migrations: {list(range(1, LATEST_VERSION + 1))}" in check.stdout
        script = cli(app, "migrate", "--sql")
        assert script.returncode == 0 and script.stdout.startswith("-- skipjack migrations")
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(script.stdout)  # what a DBA would run
        after = cli(app, "migrate", "--check")
        assert after.returncode == 0 and "schema is up to date" in after.stdout
        assert cli(app, "migrate", "--sql").stdout == ""
        app.check_schema()  # exactly what the code expects
    finally:
        query(server_dsn, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        app.close()


def test_durations_take_units_and_options_come_from_the_environment(tasks: App) -> None:
    for _ in range(3):
        tasks.tasks["t"].enqueue()
    listed = cli(tasks, "jobs", "list", env={"SKIPJACK_JOBS_LIST_LIMIT": "2"})
    assert len(listed.stdout.splitlines()) == 2
    limited = cli(tasks, "queues", "limit", "q", "--rate", "5", "--per", "1m")
    assert limited.returncode == 0 and "5 per 60s" in limited.stdout
    # each variable is named after its option's long name, and --help shows it
    from_env = cli(tasks, "queues", "limit", "q", "--rate", "3",
                   env={"SKIPJACK_QUEUES_LIMIT_PER": "2s"})
    assert from_env.returncode == 0 and "3 per 2s" in from_env.stdout
    helped = cli(None, "worker", "--help")
    assert "SKIPJACK_WORKER_QUEUE;" in helped.stdout.replace("\n", "").replace(" ", "")
    assert "SKIPJACK_QUEUE_METRICS_PORT" in cli(None, "metrics", "--help").stdout
    assert "SKIPJACK_VERSION" not in cli(None, "--help").stdout
    bad = cli(tasks, "worker", "jobs_app:app", "--lease", "thirty")
    assert bad.returncode == 2 and "'thirty' is not a duration like 2s, 500ms or 7d" in bad.stderr
    bad_env = cli(tasks, "worker", "jobs_app:app", env={"SKIPJACK_WORKER_LEASE": "-5s"})
    assert bad_env.returncode == 2 and "is not a duration" in bad_env.stderr
    assert Worker(tasks, ["default"]).retention == DEFAULT_RETENTION == 7 * 86400


def test_retry_cancel_discard_by_filter_with_a_dry_run(tasks: App) -> None:
    timeouts = dead_letter(tasks, "t", "mail", "TimeoutError: smtp timed out", 3)
    refused = dead_letter(tasks, "t", "mail", "ValueError: refused", 2)
    other = dead_letter(tasks, "u", "sms", "TimeoutError: gateway", 1)
    dry = cli(tasks, "jobs", "retry", "--queue", "mail", "--error-contains", "TIMED OUT",
              "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert sorted(int(line.split("\t")[0]) for line in dry.stdout.splitlines()) == timeouts
    assert "3 jobs would be retried" in dry.stderr
    assert query(tasks.dsn, "SELECT count(*) FROM {schema}.jobs WHERE state = 'discarded'",
                 schema=tasks.schema) == [(6,)]  # nothing changed
    done = cli(tasks, "jobs", "retry", "--queue", "mail", "--error-contains", "timed out")
    assert done.returncode == 0 and "3 jobs retried." in done.stderr
    states = dict(query(tasks.dsn, "SELECT id, state FROM {schema}.jobs", schema=tasks.schema))
    assert {states[i] for i in timeouts} == {"available"}
    assert {states[i] for i in refused + other} == {"discarded"}
    # a queue with no job at all is named as such (a misspelt name), with the near miss
    typo = cli(tasks, "jobs", "retry", "--queue", "mial")
    assert typo.returncode == 0 and "0 jobs retried." in typo.stderr
    assert "(no job of the queue 'mial' is waiting, running or discarded; did you mean " \
           "'mail'?)" in typo.stderr
    matched_none = cli(tasks, "jobs", "retry", "--queue", "mail", "--error-contains", "nope")
    assert "0 jobs retried." in matched_none.stderr and "no job of" not in matched_none.stderr
    by_task = cli(tasks, "jobs", "retry", "--task", "u", "--since", "1h")
    assert "1 job retried." in by_task.stderr
    everything = cli(tasks, "jobs", "discard", "--all")
    assert "4 jobs discarded." in everything.stderr  # the waiting ones
    cancel = cli(tasks, "jobs", "cancel", str(refused[0]), "999999999")
    assert cancel.returncode == 1
    assert f"{refused[0]}\tleft alone: already finished (discarded)" in cancel.stdout
    assert "999999999\tleft alone: no such job" in cancel.stdout
    both = cli(tasks, "jobs", "retry", "1", "--queue", "mail")
    assert both.returncode == 2 and "not both" in both.stderr
    none = cli(tasks, "jobs", "discard")
    assert none.returncode == 2 and "--all" in none.stderr
    future = cli(tasks, "jobs", "retry", "--since", "tomorrow-ish")
    assert future.returncode == 2 and "neither a duration" in future.stderr


def test_resume_wakes_workers_and_stats_shows_the_settings(tasks: App, tmp_path: Path) -> None:
    from support import WorkerProcess, create_log_tables, wait_until

    create_log_tables(tasks.dsn, tasks.schema)
    tasks.task(name="sleep")(lambda **kw: None)
    assert cli(tasks, "queues", "pause", "default").returncode == 0
    # polls an hour apart: only a notification can start the job within the test's deadline
    with WorkerProcess(tasks.dsn, tasks.schema, ["default"], "--poll-interval", "1h",
                       "--lease", "2s", "--heartbeat", "300ms",
                       log=tmp_path / "worker.log"):
        handle = tasks.tasks["sleep"].enqueue()
        wait_until(lambda: tasks.workers() != [], what="the worker started")
        assert handle.state() == "available"
        shown = cli(tasks, "stats")
        assert "paused" in shown.stdout and "default" in shown.stdout
        assert cli(tasks, "queues", "limit", "default", "--concurrency", "2").returncode == 0
        assert tasks.stats()["settings"]["default"]["concurrency_limit"] == 2
        assert cli(tasks, "queues", "resume", "default").returncode == 0
        assert handle.result(timeout=60) is None


def test_an_empty_dsn_is_no_dsn() -> None:
    from skipjack.db import Database

    db = Database("", "s")
    assert db.where().startswith("the embedded server at ")
