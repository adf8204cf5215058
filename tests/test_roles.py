"""Least-privilege roles (``skipjack roles``) on a real server: an owner that migrates, a
worker role that runs workers and the operating commands, an enqueue-only role; none of
them a superuser, none of them owning what it does not need."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from skipjack import App
from skipjack.runtime.maintenance import GrowthAnalysis
from skipjack.sql import Queries

from support import TESTS, Server, WorkerProcess, fresh_database, query, wait_until

SCHEMA = "skipjack"
FAST = ["--lease", "2", "--heartbeat", "0.3", "--poll-interval", "0.5", "--retention", "1s"]


@dataclass
class Roles:
    """The three roles' DSNs on a database of their own, their names, and the DSN of the
    test's superuser on that database."""

    owner: str
    worker: str
    enqueuer: str
    names: dict[str, str]
    admin: str


@pytest.fixture
def roles(server: Server) -> Iterator[Roles]:
    suffix = secrets.token_hex(4)
    names = {kind: f"sj_{kind}_{suffix}" for kind in ("owner", "worker", "enqueuer")}
    with fresh_database(server) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in names.values():
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
            conn.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                sql.Identifier(conn.info.dbname), sql.Identifier(names["owner"])))
        try:
            yield Roles(*(make_conninfo(dsn, user=names[k])
                          for k in ("owner", "worker", "enqueuer")), names=names, admin=dsn)
        finally:
            with server.connect() as conn:
                conn.autocommit = True
                dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(str(dbname))))
                for name in names.values():
                    conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(
                        sql.Identifier(name)))


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "skipjack", "--dsn", dsn, "--schema", SCHEMA,
                           *args], cwd=TESTS, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))


def refused(dsn: str, statement: str) -> bool:
    """Whether the database refuses ``statement`` for lack of a privilege (rolled back)."""
    with psycopg.connect(dsn) as conn:
        try:
            conn.execute(sql.SQL(statement).format(schema=sql.Identifier(SCHEMA)))
        except psycopg.errors.InsufficientPrivilege:
            return True
        finally:
            conn.rollback()
    return False


def migrated(roles: Roles) -> None:
    """The owner migrates and grants both roles (the steps of docs/deployment.md)."""
    out = cli(roles.owner, "migrate")
    assert out.returncode == 0, out.stderr
    out = cli(roles.owner, "roles", "--worker", roles.names["worker"],
              "--enqueuer", roles.names["enqueuer"])
    assert out.returncode == 0, out.stderr
    assert "granted worker" in out.stdout


def test_a_worker_and_an_enqueuer_run_without_owning_the_schema(
        roles: Roles, tmp_path: Path) -> None:
    migrated(roles)
    web = App(roles.enqueuer, schema=SCHEMA)
    add = web.task(name="add")(lambda a, b: None)
    try:
        # the enqueue-only role enqueues: one, many, a delayed one, and a held key twice
        handles = [add.enqueue(a=1, b=i) for i in range(3)]
        web.enqueue_many([add.job(a=2, b=i) for i in range(20)])
        delayed = add.configure(delay=0.5).enqueue(a=3, b=0)
        keyed = add.configure(idempotency_key=f"k-{secrets.token_hex(3)}")
        first = keyed.enqueue(a=4, b=0)
        assert keyed.enqueue(a=4, b=0) == first
        log = tmp_path / "worker.log"
        with WorkerProcess(roles.worker, SCHEMA, ["default"], *FAST, app="results_app:app",
                           log=log):
            # it waits for results (the awaited flag is the one column it may set)
            assert [h.result(timeout=60) for h in handles] == [{"sum": 1 + i}
                                                               for i in range(3)]
            assert delayed.result(timeout=60) == {"sum": 3}
            assert first.result(timeout=60) == {"sum": 4}
            # the worker role prunes them (retention 1 s) and keeps its registry row
            wait_until(lambda: not query(roles.owner, "SELECT id FROM {schema}.jobs",
                                         schema=SCHEMA), timeout=60,
                       what="the worker role's pruner deleted the finished jobs")
            assert query(roles.owner, "SELECT count(*) FROM {schema}.workers",
                         schema=SCHEMA) == [(1,)]
            # the operating commands run as the worker role too
            stats = cli(roles.worker, "stats", "--json")
            assert stats.returncode == 0, stats.stderr
            held = add.configure(queue="nobody").enqueue(a=5, b=0)
            out = cli(roles.worker, "jobs", "cancel", str(held))
            assert out.returncode == 0 and "cancelled" in out.stdout, out.stdout + out.stderr
        assert "permission denied" not in log.read_text()
    finally:
        web.close()


def test_an_owner_given_its_schema_by_a_dba_migrates_without_create_on_the_database(
        roles: Roles) -> None:
    # the other way docs/deployment.md gives: CREATE SCHEMA ... AUTHORIZATION owner, and no
    # CREATE on the database (CREATE SCHEMA IF NOT EXISTS would need it even so)
    with psycopg.connect(roles.admin,
                         autocommit=True) as conn:
        conn.execute(sql.SQL("REVOKE CREATE ON DATABASE {} FROM {}").format(
            sql.Identifier(conn.info.dbname), sql.Identifier(roles.names["owner"])))
        conn.execute(sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
            sql.Identifier(SCHEMA), sql.Identifier(roles.names["owner"])))
    printed = cli(roles.owner, "migrate", "--sql")
    assert printed.returncode == 0, printed.stderr
    migrated(roles)
    assert cli(roles.owner, "migrate", "--check").returncode == 0
    # and the DBA's way: the printed SQL, run as the owner, on a fresh schema it was given
    with psycopg.connect(roles.owner, autocommit=True) as conn:
        conn.execute(b"DROP SCHEMA skipjack CASCADE")
    with psycopg.connect(roles.admin,
                         autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
            sql.Identifier(SCHEMA), sql.Identifier(roles.names["owner"])))
    with psycopg.connect(roles.owner, autocommit=True) as conn:
        conn.execute(printed.stdout.encode())
    assert cli(roles.owner, "migrate", "--check").returncode == 0


def test_only_the_owner_analyses_the_jobs_table_after_it_has_grown(roles: Roles) -> None:
    """The analysis after growth as the worker role, which may not ANALYZE a table it does
    not own: nothing happens and nothing fails (autovacuum's analyses remain); as the
    owner, the table is analysed."""
    migrated(roles)
    query(roles.owner, "ALTER TABLE {schema}.jobs SET (autovacuum_enabled = false)",
          schema=SCHEMA)
    query(roles.owner, "INSERT INTO {schema}.jobs (queue, task, state, finished_at) "
                       "SELECT 'q', 't', 'succeeded', now() FROM generate_series(1, 20000)",
          schema=SCHEMA)
    pages = "SELECT relpages FROM pg_class WHERE oid = %s::regclass"
    assert query(roles.owner, pages, [f"{SCHEMA}.jobs"]) == [(0,)]
    for dsn, analysed in ((roles.worker, False), (roles.owner, True)):
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert GrowthAnalysis(Queries(SCHEMA), SCHEMA)(conn) is analysed
        assert (query(roles.owner, pages, [f"{SCHEMA}.jobs"]) != [(0,)]) is analysed


def test_the_enqueuer_cannot_claim_change_or_delete_and_the_worker_cannot_alter(
        roles: Roles) -> None:
    migrated(roles)
    web = App(roles.enqueuer, schema=SCHEMA)
    job = web.task(name="t")(lambda: None).enqueue()
    try:
        for statement in (
                "UPDATE {schema}.jobs SET state = 'running', attempt = attempt + 1",
                "UPDATE {schema}.jobs SET lease_version = lease_version + 1",
                "DELETE FROM {schema}.jobs",
                "TRUNCATE {schema}.jobs",
                "INSERT INTO {schema}.queues (name) VALUES ('q')",
                "DELETE FROM {schema}.workers"):
            assert refused(roles.enqueuer, statement), statement
        # a worker started as it is refused at once, naming what it lacks
        refused_worker = cli(roles.enqueuer, "worker", "results_app:app")
        assert refused_worker.returncode == 2 and "cannot run a worker" in \
            refused_worker.stderr and "UPDATE on jobs" in refused_worker.stderr
        # nor can it cancel one by hand
        out = cli(roles.enqueuer, "jobs", "cancel", str(job))
        assert out.returncode == 2 and "permission denied" in out.stderr, out.stderr
        assert query(roles.owner, "SELECT state, attempt FROM {schema}.jobs WHERE id = %s",
                     (job.id,), SCHEMA) == [("available", 0)]
        for statement in (
                "ALTER TABLE {schema}.jobs ADD COLUMN extra int",
                "DROP TABLE {schema}.jobs",
                "CREATE TABLE {schema}.extra (id int)",
                "CREATE INDEX ON {schema}.jobs (task)",
                "TRUNCATE {schema}.jobs",
                "INSERT INTO {schema}.migrations (version, name) VALUES (99, 'x')",
                "DROP SCHEMA {schema} CASCADE"):
            assert refused(roles.worker, statement), statement
        # a worker role may not migrate, nor grant
        other = cli(roles.worker, "--schema", "elsewhere", "migrate")
        assert other.returncode == 2 and "permission denied" in other.stderr, other.stderr
        grant = cli(roles.worker, "roles", "--enqueuer", roles.names["enqueuer"])
        assert grant.returncode == 2 and "may not grant" in grant.stderr, grant.stderr
    finally:
        web.close()


def test_roles_refuses_what_would_not_be_least_privilege(roles: Roles) -> None:
    out = cli(roles.owner, "roles", "--worker", roles.names["worker"])
    assert out.returncode == 2 and "migrations pending" in out.stderr, out.stderr
    assert cli(roles.owner, "migrate").returncode == 0
    for args, says in ((["--worker", roles.names["owner"]], "is the schema's owner"),
                       (["--worker", "sj_nobody_" + secrets.token_hex(3)], "does not exist"),
                       (["--worker", roles.names["worker"], "--enqueuer",
                         roles.names["worker"]], "each its own role"),
                       ([], "give --worker ROLE")):
        out = cli(roles.owner, "roles", *args)
        assert out.returncode == 2 and says in out.stderr, (args, out.stderr)
    creator = "sj_creator_" + secrets.token_hex(3)  # could grant itself the owner
    with psycopg.connect(roles.admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} CREATEROLE").format(sql.Identifier(creator)))
    try:
        out = cli(roles.owner, "roles", "--enqueuer", creator)
        assert out.returncode == 2 and "CREATEROLE" in out.stderr, out.stderr
    finally:
        with psycopg.connect(roles.admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(creator)))
    printed = cli(roles.owner, "roles", "--worker", roles.names["worker"], "--sql")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith("BEGIN;") and printed.stdout.endswith("COMMIT;\n")
    assert f'TO "{roles.names["worker"]}"' in printed.stdout
    # printing granted nothing; running the printed SQL as the owner grants
    assert refused(roles.worker, "SELECT 1 FROM {schema}.jobs")
    with psycopg.connect(roles.owner, autocommit=True) as conn:
        conn.execute(printed.stdout.encode())
    assert not refused(roles.worker, "SELECT 1 FROM {schema}.jobs")
