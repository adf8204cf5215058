"""The Django test project (tests/django_project) against a real server: manage.py migrate,
the worker of manage.py skipjack, ORM writes of a "complete" handler through SIGKILLs, and
the project's own tests (transactions, the Tasks backend, the admin) under Django's runner.

Django 6 needs Python 3.12+; scripts/test.sh makes the venv with one where the machine has
it, and these tests are skipped (saying so) on an older one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from skipjack import App, JobFailed
from skipjack.migrate import migrations

from support import (
    TESTS,
    Server,
    WorkerProcess,
    fresh_database,
    kill_repeatedly,
    query,
    states,
    wait_until,
)

pytest.importorskip("django", minversion="6.0",
                    reason="Django 6 needs Python 3.12+ (this is " + sys.version.split()[0] + ")")

PROJECT = TESTS / "django_project"
MANAGE = PROJECT / "manage.py"
FAST = ["--lease", "2", "--heartbeat", "0.3", "--rescue-interval", "0.5", "--poll-interval",
        "0.5", "--concurrency", "4"]


@dataclass
class Project:
    dsn: str
    schema: str

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SKIPJACK_DATABASE_URL": self.dsn, "SKIPJACK_SCHEMA": self.schema,
                "PYTHONUNBUFFERED": "1"}

    def manage(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(MANAGE), *args], cwd=PROJECT,
                              env=self.env, capture_output=True, text=True, timeout=timeout)

    def worker(self, log: Path, env: dict[str, str] | None = None) -> WorkerProcess:
        return WorkerProcess(self.dsn, self.schema, ["default"], *FAST, manage=MANAGE, log=log,
                             env={"SKIPJACK_DATABASE_URL": self.dsn,
                                  "SKIPJACK_SCHEMA": self.schema, **(env or {})})


@pytest.fixture
def project(server: Server) -> Iterator[Project]:
    """A new database on the server for the project (and its test database, test_<name>)."""
    with fresh_database(server) as dsn:
        yield Project(dsn, "shop_jobs")


def test_migrate_then_the_management_command_worker_runs_jobs(project: Project,
                                                              tmp_path: Path) -> None:
    first = project.manage("migrate", "--noinput")
    assert first.returncode == 0, first.stderr
    versions = [m.version for m in migrations()]
    assert f"Applied skipjack migrations {versions} to schema 'shop_jobs'" in first.stdout
    again = project.manage("migrate", "--noinput")
    assert again.returncode == 0 and "skipjack migrations" not in again.stdout
    check = project.manage("makemigrations", "--check", "--dry-run")
    assert check.returncode == 0, check.stdout + check.stderr  # nothing for a user to make
    stats = project.manage("skipjack", "stats")
    assert stats.returncode == 0, stats.stderr
    dbname = conninfo_to_dict(project.dsn)["dbname"]
    assert f"database: user=postgres dbname={dbname} " in stats.stderr  # Django's database
    elsewhere = project.manage("skipjack", "--schema", "other", "stats")
    assert elsewhere.returncode == 2 and "--schema is not used here" in elsewhere.stderr
    query(project.dsn, "INSERT INTO shop_order (id, note, paid) VALUES (5, '', false)")
    app = App(project.dsn, schema=project.schema)
    app.task(name="shop.mark_paid")(lambda **kw: None)
    handle = app.tasks["shop.mark_paid"].enqueue(order_id=5)
    with project.worker(tmp_path / "worker.log") as worker:
        assert handle.result(timeout=60) == "order 5 paid"
        assert query(project.dsn, "SELECT paid FROM shop_order WHERE id = 5") == [(True,)]
        worker.signal(15)
        assert worker.wait(60) == 0
    app.close()


def test_orm_writes_of_a_complete_handler_happen_once_through_kills(project: Project,
                                                                   tmp_path: Path) -> None:
    assert project.manage("migrate", "--noinput").returncode == 0
    app = App(project.dsn, schema=project.schema)
    task = app.task(name="shop.orm_effect", transaction="complete")(lambda **kw: None)
    ids = app.enqueue_many([task.job(seconds=0.2) for _ in range(24)])
    kill_repeatedly(project.dsn, project.schema, ids,
                    lambda n: project.worker(tmp_path / f"w{n}.log"), kills=3)
    assert states(project.dsn, project.schema) == {"succeeded": len(ids)}
    effects = dict(query(project.dsn, "SELECT job_id, count(*) FROM shop_effect GROUP BY job_id"))
    assert effects == dict.fromkeys(ids, 1)
    attempts = query(project.dsn, "SELECT sum(attempt) FROM {schema}.jobs", schema=project.schema)
    assert attempts[0][0] > len(ids)  # some attempts were cut by the kills
    app.close()


def _backends(dsn: str, pid: int) -> int:
    return int(query(dsn, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])[0][0])


@pytest.mark.parametrize("settings", [
    {},  # CONN_MAX_AGE = 0: closed after each attempt
    {"SHOP_CONN_MAX_AGE": "none", "SHOP_CONN_HEALTH_CHECKS": "1"},  # checked before each
    {"SHOP_CONN_MAX_AGE": "none"},  # kept: the attempt it breaks fails, the next recovers
], ids=["closed-after-each", "persistent-health-checked", "persistent"])
def test_an_async_handler_s_orm_connection_is_managed_as_around_a_request(
        project: Project, tmp_path: Path, settings: dict[str, str]) -> None:
    """The Django connection an async handler's ORM calls use (on sync_to_async's thread) is
    closed before and after each attempt when it broke or outlived CONN_MAX_AGE: after
    pg_terminate_backend of it, the next jobs succeed (a persistent connection without
    health checks fails the one attempt that finds it dead, as a request would)."""
    assert project.manage("migrate", "--noinput").returncode == 0
    query(project.dsn, "INSERT INTO shop_order (id, note, paid) VALUES (7, '', false)")
    app = App(project.dsn, schema=project.schema)
    task = app.task(name="shop.async_orm", max_attempts=1)(lambda **kw: None)
    with project.worker(tmp_path / "worker.log", env=settings) as worker:
        pid = task.enqueue(order_id=7).result(timeout=60)
        if "SHOP_CONN_MAX_AGE" not in settings:  # closed once the attempt ended
            wait_until(lambda: _backends(project.dsn, pid) == 0, timeout=30,
                       what="the async handler's connection closed after its attempt")
        else:
            assert _backends(project.dsn, pid) == 1  # kept for the next attempt
            assert query(project.dsn, "SELECT pg_terminate_backend(%s)", [pid]) == [(True,)]
            wait_until(lambda: _backends(project.dsn, pid) == 0, timeout=30,
                       what="the terminated backend gone")
        second = task.enqueue(order_id=7)
        if settings == {"SHOP_CONN_MAX_AGE": "none"}:
            with pytest.raises(JobFailed, match="AdminShutdown|terminat"):
                second.result(timeout=60)
        else:
            assert second.result(timeout=60) != pid
        third = task.enqueue(order_id=7).result(timeout=60)
        assert third != pid
        fourth = task.enqueue(order_id=7).result(timeout=60)
        # a persistent connection serves the next attempts; else each gets a new one
        assert (fourth == third) == ("SHOP_CONN_MAX_AGE" in settings)
        worker.signal(15)
        assert worker.wait(60) == 0, worker.log()[-4000:]
    app.close()


def test_the_backend_s_cron_entries_run(project: Project, tmp_path: Path) -> None:
    """A cron entry of TASKS' SkipjackBackend ("* * * * *": a schedule seen for the first
    time runs its latest slot at once) is enqueued by the worker and run as a Django task."""
    cron = {"SHOP_CRON": "1"}
    migrated = subprocess.run([sys.executable, str(MANAGE), "migrate", "--noinput"],
                              cwd=PROJECT, env={**project.env, **cron}, capture_output=True,
                              text=True, timeout=300)
    assert migrated.returncode == 0, migrated.stderr
    listed = subprocess.run([sys.executable, str(MANAGE), "skipjack", "cron", "list"],
                            cwd=PROJECT, env={**project.env, **cron}, capture_output=True,
                            text=True, timeout=300)
    assert listed.returncode == 0 and "shop-add-every-minute" in listed.stdout, listed.stderr

    def ran() -> list[tuple[object, ...]]:
        return query(project.dsn, "SELECT state, result, idempotency_key, args FROM "
                     "{schema}.jobs WHERE task = 'shop.tasks.add'", schema=project.schema)

    with project.worker(tmp_path / "worker.log", env=cron) as worker:
        rows = wait_until(lambda: [r for r in ran() if r[0] == "succeeded"], timeout=60,
                          what="the cron entry's job succeeded")
        worker.signal(15)
        assert worker.wait(60) == 0, worker.log()[-4000:]
    state, result, key, args = rows[0]
    assert (state, result, args["args"]) == ("succeeded", 5, [2, 3])
    assert str(key).startswith("cron:shop-add-every-minute:")


def test_the_project_s_own_tests_pass_under_django_s_runner(project: Project) -> None:
    ran = project.manage("test", "shop", "--noinput", "-v", "2")
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-8000:]
    assert re.search(r"^Ran \d+ tests", ran.stderr, re.MULTILINE) and "\nOK" in ran.stderr


def test_a_database_that_is_not_postgresql_is_refused(tmp_path: Path) -> None:
    settings = tmp_path / "sqlite_settings.py"
    settings.write_text("from project.settings import *  # noqa\n"
                        "DATABASES = {'default': {'ENGINE': 'django.db.backends.sqlite3', "
                        f"'NAME': {str(tmp_path / 'db.sqlite3')!r}}}}}\n")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "sqlite_settings",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(PROJECT)])}
    ran = subprocess.run([sys.executable, str(MANAGE), "skipjack", "stats"], cwd=PROJECT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode != 0
    assert "skipjack needs PostgreSQL: DATABASES['default'] is sqlite" in ran.stderr
