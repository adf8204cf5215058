"""Migrations: concurrent first start, version checks, schema contents."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest

from skipjack import App, SchemaVersionError
from skipjack.migrate import LATEST_VERSION

from support import TESTS, Server, migration_locks, query


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
    with pytest.raises(SchemaVersionError, match="run `skipjack migrate`"):
        missing.check_schema()


def test_autovacuum_settings_are_set(app: App) -> None:
    ((options,),) = query(app.dsn, "SELECT reloptions FROM pg_class c JOIN pg_namespace n "
                          "ON n.oid = c.relnamespace WHERE n.nspname = %s AND relname = 'jobs'",
                          [app.schema])
    assert "autovacuum_vacuum_scale_factor=0.05" in options
