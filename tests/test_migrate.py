"""Migrations: concurrent first start, version checks, schema contents, lock waits that give
up instead of stopping the queue."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

import skipjack.migrate
from skipjack import App, MigrationError, MigrationLockError, SchemaVersionError, ValidationError
from skipjack.migrate import LATEST_VERSION, Migration, migrations
from skipjack.runtime.maintenance import rescue
from test_claim_fencing import claim

from support import TESTS, Server, migration_locks, query, wait_until


def _catalog(server: Server, schema: str) -> tuple[list[Any], list[Any], list[Any]]:
    indexes = query(server.dsn, "SELECT indexname FROM pg_indexes WHERE schemaname = %s "
                    "ORDER BY 1", [schema])
    functions = query(server.dsn, "SELECT p.proname FROM pg_proc p JOIN pg_namespace n "
                      "ON n.oid = p.pronamespace WHERE n.nspname = %s ORDER BY 1", [schema])
    versions = query(server.dsn, "SELECT version FROM {schema}.migrations ORDER BY 1",
                     schema=schema)
    return indexes, functions, versions


def test_fc27_eight_processes_migrate_at_once(server: Server, schema: str) -> None:
    for round_ in range(3):
        name = f"{schema}_{round_}"
        procs = [subprocess.Popen([sys.executable, "-m", "skipjack", "--dsn", server.dsn,
                                   "--schema", name, "migrate"], cwd=TESTS,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for _ in range(8)]
        outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
        assert [p.returncode for p in procs] == [0] * 8, outputs
        assert sum("applied migrations" in o for o in outputs) == 1
        indexes, functions, versions = _catalog(server, name)
        assert len(indexes) == len(set(indexes)) and len(functions) == len(set(functions))
        assert versions == [(v,) for v in range(1, LATEST_VERSION + 1)]
        query(server.dsn, "DROP SCHEMA {schema} CASCADE", schema=name)


def test_fc27_fifty_rounds_of_eight_concurrent_migrations(server: Server, schema: str) -> None:
    for _ in range(50):
        errors, applied = _migrate_concurrently(server, schema, 8)
        assert errors == []
        assert sorted(applied) == [[]] * 7 + [list(range(1, LATEST_VERSION + 1))]
        assert migration_locks(server.dsn, schema) == 0
        query(server.dsn, "DROP SCHEMA {schema} CASCADE", schema=schema)


def _migrate_concurrently(server: Server, schema: str,
                          n: int) -> tuple[list[BaseException], list[list[int]]]:
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []
    applied: list[list[int]] = []

    def run() -> None:
        try:
            app = App(server.dsn, schema=schema)
            barrier.wait()
            applied.append(app.migrate())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors, applied


def test_version_checks(app: App) -> None:
    app.check_schema()
    query(app.dsn, "INSERT INTO {schema}.migrations (version, name) VALUES (%s, 'future')",
          [LATEST_VERSION + 1], schema=app.schema)
    with pytest.raises(SchemaVersionError, match="newer than this skipjack"):
        app.check_schema()
    with pytest.raises(SchemaVersionError, match="newer than this skipjack"):
        app.migrate()
    missing = App(app.dsn, schema=app.schema + "_none")
    with pytest.raises(SchemaVersionError, match="migrate it first"):
        missing.check_schema()


def test_autovacuum_settings_are_set(app: App) -> None:
    ((options,),) = query(app.dsn, "SELECT reloptions FROM pg_class c JOIN pg_namespace n "
                          "ON n.oid = c.relnamespace WHERE n.nspname = %s AND relname = 'jobs'",
                          [app.schema])
    assert "autovacuum_vacuum_scale_factor=0.05" in options


def test_version_9_keeps_the_running_jobs_of_a_version_8_schema_rescuable(
        server: Server, schema: str) -> None:
    """Version 9 replaces the two indexes of the running jobs with one: jobs running when it
    is applied are found by it, an expired lease is rescued and a live one left alone."""
    _migrate_to(server, schema, 8)
    query(server.dsn, """
        INSERT INTO {schema}.jobs (queue, task, args, state, attempt, attempted_at, worker,
                                   lease_expires_at, lease_version)
        SELECT 'q', 't', '{{}}', 'running', 1, now(), 'w', now() + make_interval(secs => s), 7
          FROM unnest(ARRAY[-60, 600]) AS s""", schema=schema)
    app = App(server.dsn, schema=schema)
    try:
        assert app.migrate() == [9]
        indexes = query(server.dsn, "SELECT indexname, indexdef FROM pg_indexes "
                        "WHERE schemaname = %s AND indexdef LIKE '%%''running''%%'", [schema])
        assert [name for name, _ in indexes] == ["jobs_running_idx"]
        assert "(queue, lease_expires_at)" in indexes[0][1]
        with app.connect() as conn:
            rescued = rescue(conn, app.queries)
        assert [state for _, state in rescued] == ["available"]
        assert sorted(r[0] for r in query(server.dsn, "SELECT state FROM {schema}.jobs",
                                          schema=schema)) == ["available", "running"]
    finally:
        app.close()


# --- lock waits ------------------------------------------------------------------------------

BACKUP = "skipjack-test-backup"  # application_name of the session that holds the lock


def _add_pending_migration(monkeypatch: pytest.MonkeyPatch, text: str, name: str = "test_only",
                           ) -> int:
    """Make this process's migrate() know one migration past the shipped ones (the shipped
    files stay as they are); returns its version."""
    shipped = migrations()
    version = shipped[-1].version + 1
    monkeypatch.setattr(skipjack.migrate, "migrations",
                        lambda: [*shipped, Migration(version, name, text)])
    return version


def _migrate_to(server: Server, schema: str, version: int) -> None:
    """Create ``schema`` with the shipped migrations up to ``version`` only."""
    shipped = migrations()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(skipjack.migrate, "migrations",
                      lambda: [m for m in shipped if m.version <= version])
        assert App(server.dsn, schema=schema).migrate() == list(range(1, version + 1))


@contextmanager
def _backup_lock(dsn: str, schema: str, tables: tuple[str, ...] = ("jobs",),
                 advisory: int | None = None) -> Iterator[int]:
    """A session that holds ACCESS SHARE locks on ``tables`` (as pg_dump takes) in an open
    transaction, and optionally an advisory lock; yields its backend pid."""
    with psycopg.connect(dsn, application_name=BACKUP) as conn:
        for table in tables:
            conn.execute(psycopg.sql.SQL("LOCK TABLE {}.{} IN ACCESS SHARE MODE").format(
                psycopg.sql.Identifier(schema), psycopg.sql.Identifier(table)))
        if advisory is not None:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [advisory])
        yield conn.info.backend_pid


def _waiting_for_jobs(dsn: str, schema: str) -> int:
    """Lock requests on ``schema``.jobs that wait (not granted)."""
    rows = query(dsn, "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                      "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE NOT l.granted "
                      "AND n.nspname = %s AND c.relname = 'jobs'", [schema])
    return int(rows[0][0])


def _versions(dsn: str, schema: str) -> list[int]:
    return [v for (v,) in query(dsn, "SELECT version FROM {schema}.migrations ORDER BY 1",
                                schema=schema)]


def test_a_migration_behind_a_backup_lock_gives_up_and_the_queue_keeps_running(
        app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session holds ACCESS SHARE on jobs and a migration that alters jobs is pending. The
    migration's ACCESS EXCLUSIVE request gives up after its lock timeout on every attempt,
    so an enqueue, a claim and a read queued behind it complete; then it fails naming the
    session, having applied nothing."""
    _add_pending_migration(monkeypatch, "ALTER TABLE {schema}.jobs ADD COLUMN test_only int")
    task = app.task(name="t", queue="q")(lambda: None)
    with ThreadPoolExecutor(4) as pool:
        with _backup_lock(app.dsn, app.schema) as holder:
            migrating = pool.submit(app.migrate, lock_timeout=0.5, attempts=3)
            wait_until(lambda: _waiting_for_jobs(app.dsn, app.schema), timeout=60,
                       what="the migration waiting for its lock on jobs")
            job_id = pool.submit(task.enqueue).result(timeout=60)
            assert [row[0] for row in pool.submit(claim, app, "q", 1).result(timeout=60)] == [
                job_id]
            assert pool.submit(app.stats).result(timeout=60)["queues"] == {"q": {"running": 1}}
            with pytest.raises(MigrationLockError) as failed:
                migrating.result(timeout=120)
    assert failed.value.pids == [holder]
    message = str(failed.value)
    for part in ("a session holds a lock on table jobs", f"pid {holder}", repr(BACKUP),
                 "'idle in transaction'", "AccessShareLock on jobs",
                 f"migration {LATEST_VERSION + 1} (test_only) could not take its locks in 3 "
                 "attempts",
                 f"pg_terminate_backend({holder})"):
        assert part in message, message
    assert _versions(app.dsn, app.schema) == list(range(1, LATEST_VERSION + 1))
    assert migration_locks(app.dsn, app.schema) == 0


def test_a_migration_behind_a_lock_released_during_its_attempts_is_applied(
        app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    version = _add_pending_migration(monkeypatch,
                                     "ALTER TABLE {schema}.jobs ADD COLUMN test_only int")
    task = app.task(name="t", queue="q")(lambda: None)
    with ThreadPoolExecutor(2) as pool:
        with _backup_lock(app.dsn, app.schema):
            migrating = pool.submit(app.migrate, lock_timeout=0.5, attempts=30)
            wait_until(lambda: _waiting_for_jobs(app.dsn, app.schema), timeout=60,
                       what="the migration waiting for its lock on jobs")
            pool.submit(task.enqueue).result(timeout=60)
        assert migrating.result(timeout=120) == [version]
    assert _versions(app.dsn, app.schema) == [*range(1, LATEST_VERSION + 1), version]
    assert query(app.dsn, "SELECT count(test_only) FROM {schema}.jobs", schema=app.schema) == [
        (0,)]


def test_migrate_and_check_schema_of_a_current_schema_take_no_lock_to_wait_for(
        app: App) -> None:
    """With nothing to apply, migrate() (what `worker --migrate` runs) and check_schema()
    (what every worker runs at start) only read: they neither queue for a table lock nor wait
    for the migration advisory lock, held here by a session that also locks every table."""
    tables = ("jobs", "migrations", "queues", "cron_slots")
    with ThreadPoolExecutor(2) as pool, _backup_lock(
            app.dsn, app.schema, tables, advisory=skipjack.migrate._lock_key(app.schema)):
        assert pool.submit(app.migrate).result(timeout=60) == []
        pool.submit(app.check_schema).result(timeout=60)
        assert _waiting_for_jobs(app.dsn, app.schema) == 0


def test_cli_migrate_behind_a_backup_lock_prints_an_error_line_and_exits_2(
        server: Server, schema: str) -> None:
    _migrate_to(server, schema, 1)  # migration 2 alters the jobs table
    with _backup_lock(server.dsn, schema) as holder:
        done = subprocess.run(
            [sys.executable, "-m", "skipjack", "--dsn", server.dsn, "--schema", schema,
             "migrate", "--lock-timeout", "200ms", "--attempts", "2"],
            cwd=TESTS, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert f"schema {schema!r} is not migrated: migration 2" in error
    assert "a session holds a lock on table jobs" in error and f"pid {holder}" in error
    assert _versions(server.dsn, schema) == [1]


def test_a_migration_the_database_refuses_is_an_error_line_not_a_traceback(
        server: Server, schema: str) -> None:
    """The next migration (2) creates a table that is already there."""
    _migrate_to(server, schema, 1)
    query(server.dsn, "CREATE TABLE {schema}.queues (name text)", schema=schema)
    done = subprocess.run([sys.executable, "-m", "skipjack", "--dsn", server.dsn, "--schema",
                           schema, "migrate"], cwd=TESTS, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "skipjack.cli: database: " in done.stderr.splitlines()[0], done.stderr
    assert done.stderr.splitlines()[1].startswith(f"error: schema {schema!r}: migration 2 "), \
        done.stderr
    assert "failed, nothing of this call was applied: 42P07" in done.stderr
    with pytest.raises(MigrationError, match=r"42P07: relation \"queues\" already exists"):
        App(server.dsn, schema=schema).migrate()
    assert _versions(server.dsn, schema) == [1]


@pytest.mark.parametrize(("option", "value", "message"), [
    ("lock_timeout", 0, "lock_timeout: 0 seconds is out of range 0.001..600"),
    ("lock_timeout", 601, "lock_timeout: 601 seconds is out of range 0.001..600"),
    ("attempts", 0, "attempts: 0 is out of range 1..100"),
])
def test_lock_options_out_of_range_name_the_field(app: App, option: str, value: float,
                                                  message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        app.migrate(**{option: value})
