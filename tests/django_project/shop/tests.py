"""The shop's tests, run by Django's test runner (``manage.py test shop``) on its test
database: transactions, the Tasks backend, the admin, with skipjack's test helpers."""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.tasks import TaskResultStatus
from django.tasks.exceptions import TaskResultDoesNotExist
from django.test import TransactionTestCase
from psycopg import sql

from shop.models import Effect, Order
from shop.tasks import (
    add,
    async_double,
    flaky_report,
    mark_paid,
    note,
    orm_effect,
    receipt,
    which_attempt,
)
from skipjack import ValidationError
from skipjack.contrib.django import app
from skipjack.testing import assert_enqueued, drain, enqueued, inline


class JobsTestCase(TransactionTestCase):
    """Empties skipjack's jobs table (not Django's to flush) before each test, and closes
    the app's connections after it (Django drops the test database only when no session is
    left on it)."""

    def setUp(self) -> None:
        with connection.cursor() as cur:
            cur.execute(sql.SQL("DELETE FROM {}.jobs").format(
                sql.Identifier(app.schema)).as_string())

    def tearDown(self) -> None:
        app.close()


def others_see() -> int:
    """Jobs another session sees (committed ones)."""
    return len(enqueued(app))


@contextmanager
def async_unsafe(allowed: bool) -> Iterator[None]:
    """``DJANGO_ALLOW_ASYNC_UNSAFE`` set (or not) for the block, as it was afterwards."""
    before = os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    if allowed:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        yield
    finally:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        if before is not None:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = before


class Transactions(JobsTestCase):
    def test_a_rolled_back_atomic_block_leaves_no_job(self) -> None:
        with self.assertRaises(RuntimeError), transaction.atomic():
            order = Order.objects.create(note="x")
            mark_paid.enqueue(order_id=order.id)
            assert_enqueued(app, "shop.mark_paid", order_id=order.id, conn=connection)
            self.assertEqual(others_see(), 0)  # not committed: only this connection sees it
            raise RuntimeError("the view failed")
        self.assertEqual(enqueued(app), [])
        self.assertFalse(Order.objects.exists())

    def test_a_rolled_back_savepoint_takes_only_its_jobs(self) -> None:
        with transaction.atomic():
            kept = Order.objects.create()
            mark_paid.enqueue(order_id=kept.id)
            try:
                with transaction.atomic():  # a savepoint
                    mark_paid.enqueue(order_id=-1)
                    raise ValueError("no")
            except ValueError:
                pass
        assert_enqueued(app, "shop.mark_paid", count=1, order_id=kept.id)
        assert_enqueued(app, "shop.mark_paid", count=0, order_id=-1)

    def test_outside_a_transaction_an_enqueue_commits_at_once(self) -> None:
        handle = mark_paid.enqueue(order_id=1)
        self.assertEqual(others_see(), 1)
        self.assertEqual(handle.state(), "available")

    def test_handlers_and_complete_handlers_run_with_the_orm(self) -> None:
        order = Order.objects.create()
        paid = mark_paid.enqueue(order_id=order.id)
        effect = orm_effect.enqueue()
        self.assertEqual(drain(app), {"succeeded": 2})
        order.refresh_from_db()
        self.assertTrue(order.paid)
        self.assertEqual(paid.result(timeout=0), f"order {order.id} paid")
        self.assertEqual(list(Effect.objects.values_list("job_id", flat=True)), [effect.id])

    def test_inline_runs_the_handler_at_once(self) -> None:
        from skipjack.testing import inline

        order = Order.objects.create()
        with inline(app) as ran:
            mark_paid.enqueue(order_id=order.id)
        self.assertEqual([value for _, value in ran], [f"order {order.id} paid"])
        order.refresh_from_db()
        self.assertTrue(order.paid)
        self.assertEqual(enqueued(app), [])  # nothing was written

    def test_an_enqueue_in_an_atomic_block_on_an_event_loop_joins_it_where_django_allows(
            self) -> None:
        async def cell(fail: bool) -> int:
            with transaction.atomic():
                order = Order.objects.create(note="cell")
                mark_paid.enqueue(order_id=order.id)
                await mark_paid.enqueue_async(order_id=-order.id)
                assert_enqueued(app, "shop.mark_paid", count=2, conn=connection)
                if fail:
                    raise ValueError("the cell failed")
            return order.id

        with async_unsafe(True):
            with self.assertRaises(ValueError):
                asyncio.run(cell(fail=True))
            self.assertFalse(Order.objects.exists())
            self.assertEqual(enqueued(app), [])  # rolled back with the order
            order_id = asyncio.run(cell(fail=False))
        assert_enqueued(app, "shop.mark_paid", count=1, order_id=order_id)
        assert_enqueued(app, "shop.mark_paid", count=1, order_id=-order_id)

    def test_an_enqueue_on_an_event_loop_that_cannot_join_the_open_block_is_refused(
            self) -> None:
        def assert_refused(enqueue: Coroutine[Any, Any, None]) -> None:
            with self.assertRaises(ValidationError) as refused:
                asyncio.run(enqueue)
            message = str(refused.exception)
            self.assertIn("conn: Django's connection 'default' is inside transaction.atomic() "
                          "on this thread, but this enqueue runs on an event loop", message)
            for advice in ("outside the event loop", "sync_to_async", "enqueue_async",
                           "conn="):
                self.assertIn(advice, message)

        async def sync_enqueue() -> None:
            mark_paid.enqueue(order_id=1)

        async def async_enqueue() -> None:
            await mark_paid.enqueue_async(order_id=2)

        async def django_task() -> None:
            add.enqueue(1, 2)

        # the loop started inside the sync code's block: the loop's connections are others
        for allowed in (False, True):
            with async_unsafe(allowed), transaction.atomic():
                Order.objects.create(note=f"allowed={allowed}")
                for enqueue in (sync_enqueue, async_enqueue, django_task):
                    assert_refused(enqueue())

        # a block opened on the loop, where Django no longer allows its connection
        async def no_longer_allowed() -> None:
            with transaction.atomic():
                os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE")
                try:
                    mark_paid.enqueue(order_id=3)
                finally:
                    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"

        with async_unsafe(True):
            assert_refused(no_longer_allowed())
        self.assertEqual(enqueued(app), [])
        self.assertEqual(Order.objects.count(), 2)  # the blocks themselves went on

    def test_outside_an_atomic_block_an_enqueue_on_an_event_loop_commits_at_once(
            self) -> None:
        async def enqueue() -> int:
            return int(mark_paid.enqueue(order_id=3))

        with async_unsafe(False):
            job_id = asyncio.run(enqueue())
        self.assertEqual([j["id"] for j in enqueued(app)], [job_id])


class Declarations(JobsTestCase):
    def test_an_async_complete_handler_is_refused_at_declaration(self) -> None:
        with self.assertRaises(ValidationError) as refused:
            @app.task(name="shop.async_complete", transaction="complete")
            async def async_complete() -> None:
                pass
        message = str(refused.exception)
        self.assertTrue(message.startswith("transaction: task 'shop.async_complete': an async "
                                           "def handler cannot have transaction='complete'"),
                        message)
        self.assertIn("make it a sync def", message)
        self.assertNotIn("shop.async_complete", app.tasks)

    def test_the_django_tasks_of_the_installed_apps_are_known_from_the_start(self) -> None:
        # weekly_digest is never enqueued: its runner was made when Django started, so the
        # dashboard's task list offers it
        self.assertTrue(dict.__contains__(app.tasks, "shop.tasks.weekly_digest"))
        self.assertEqual(app.tasks["shop.tasks.weekly_digest"].queue, "reports")
        self.assertEqual(app.tasks["shop.tasks.weekly_digest"].max_attempts, 1)

    def test_a_task_declared_outside_the_installed_apps_after_setup_warns(self) -> None:
        import sys

        sys.modules.pop("project.stray_tasks", None)
        app.tasks.pop("project.stray", None)
        with self.assertWarns(RuntimeWarning) as warned:
            from project import stray_tasks
        self.assertIn("skipjack task 'project.stray' is declared in 'project.stray_tasks', "
                      "outside every installed app", str(warned.warning))
        self.assertIn("declare it in the 'tasks' module of an installed app",
                      str(warned.warning))
        self.assertTrue(warned.filename.endswith("stray_tasks.py"), warned.filename)
        stray_tasks.stray.enqueue()  # a worker of this process knows it
        self.assertEqual(drain(app), {"succeeded": 1})


class ManagementCommand(JobsTestCase):
    def test_call_command_returns_on_success_and_raises_command_error_on_failure(
            self) -> None:
        mark_paid.enqueue(order_id=1)
        out, err = io.StringIO(), io.StringIO()
        self.assertIsNone(call_command("skipjack", "stats", "--json", stdout=out, stderr=err))
        self.assertIn('"available": 1', out.getvalue())
        self.assertIn("database: ", err.getvalue())
        with self.assertRaises(CommandError) as failed:
            call_command("skipjack", "jobs", "show", "987654321", stdout=out, stderr=err)
        self.assertEqual(failed.exception.returncode, 1)
        self.assertIn("skipjack jobs show 987654321 failed (exit status 1)",
                      str(failed.exception))
        self.assertIn("no job 987654321", str(failed.exception))
        with self.assertRaises(CommandError) as usage:
            call_command("skipjack", "jobs", "list", "--limit", "0", stdout=out, stderr=err)
        self.assertEqual(usage.exception.returncode, 2)
        self.assertIn("Invalid value for '--limit'", str(usage.exception))


class TasksBackend(JobsTestCase):
    def test_get_result_sees_a_task_enqueued_in_the_open_transaction(self) -> None:
        with self.assertRaises(RuntimeError), transaction.atomic():
            result = add.enqueue(2, 3)
            self.assertEqual(add.get_result(result.id), result)
            self.assertEqual(result.status, TaskResultStatus.READY)
            self.assertEqual(others_see(), 0)
            raise RuntimeError("rolled back")
        with self.assertRaises(TaskResultDoesNotExist):
            add.get_result(result.id)

    def test_results_errors_context_priority_queues_and_keys(self) -> None:
        ok = add.enqueue(20, 22)
        ctx = which_attempt.enqueue(label="first")
        failing = flaky_report.enqueue()
        doubled = async_double.enqueue(21)
        first, again = receipt.enqueue(order_id=9), receipt.enqueue(order_id=9)
        self.assertEqual(first.id, again.id)  # one job per idempotency key
        self.assertEqual((failing.task.queue_name, failing.task.priority), ("reports", 10))
        self.assertEqual(drain(app), {"succeeded": 4, "discarded": 1})
        ok.refresh()
        self.assertEqual((ok.status, ok.return_value, ok.attempts), (
            TaskResultStatus.SUCCESSFUL, 42, 1))
        self.assertTrue(ok.enqueued_at <= ok.started_at <= ok.finished_at)
        ctx.refresh()
        self.assertEqual(ctx.return_value, {"label": "first", "attempt": 1, "id": ctx.id})
        doubled.refresh()
        self.assertEqual(doubled.return_value, 42)
        failing.refresh()
        self.assertEqual((failing.status, failing.attempts), (TaskResultStatus.FAILED, 2))
        self.assertEqual([e.exception_class_path for e in failing.errors],
                         ["builtins.ValueError"] * 2)
        self.assertIn("ValueError: the report is not ready", failing.errors[-1].traceback)
        with self.assertRaises(ValueError):
            failing.return_value  # noqa: B018

    def test_run_after_defers_the_task(self) -> None:
        from datetime import timedelta

        from django.utils import timezone

        later = add.using(run_after=timezone.now() + timedelta(hours=1)).enqueue(1, 1)
        self.assertEqual(drain(app), {"scheduled": 1})
        later.refresh()
        self.assertEqual(later.status, TaskResultStatus.READY)
        self.assertEqual(later.task.run_after, add.using(run_after=later.task.run_after)
                         .run_after)

    async def test_aenqueue_and_aget_result(self) -> None:
        result = await add.aenqueue(1, 2)
        fetched = await add.aget_result(result.id)
        self.assertEqual(fetched.status, TaskResultStatus.READY)

    def test_priorities_order_execution(self) -> None:
        for label, priority in (("low", -10), ("first 0", 0), ("top", 100), ("high", 50),
                                ("second 0", 0), ("lowest", -100)):
            note.using(priority=priority).enqueue(label)
        self.assertEqual(drain(app, concurrency=1), {"succeeded": 6})
        self.assertEqual(list(Order.objects.order_by("id").values_list("note", flat=True)),
                         ["top", "high", "first 0", "second 0", "low", "lowest"])

    def test_inline_runs_the_task_and_returns_its_outcome(self) -> None:
        with inline(app) as ran:
            ok = add.enqueue(2, 3)
            failed = flaky_report.enqueue()
            ctx = which_attempt.enqueue(label="inline")
            doubled = async_double.enqueue(4)
        self.assertEqual([value for _, value in ran], [5, {"label": "inline", "attempt": 1,
                                                          "id": ctx.id}, 8])  # not the failed
        self.assertEqual(enqueued(app), [])  # nothing was written
        self.assertEqual((ok.status, ok.return_value, ok.attempts),
                         (TaskResultStatus.SUCCESSFUL, 5, 1))
        self.assertLess(int(ok.id), 0)
        self.assertEqual(add.get_result(ok.id).return_value, 5)
        ok.refresh()
        self.assertEqual(ok.status, TaskResultStatus.SUCCESSFUL)
        self.assertEqual(failed.status, TaskResultStatus.FAILED)
        self.assertEqual([e.exception_class_path for e in failed.errors],
                         ["builtins.ValueError"])
        self.assertIn("ValueError: the report is not ready", failed.errors[0].traceback)
        with self.assertRaises(ValueError):
            failed.return_value  # noqa: B018
        self.assertEqual(ctx.return_value, {"label": "inline", "attempt": 1, "id": ctx.id})
        self.assertEqual(doubled.return_value, 8)
        with self.assertRaises(TaskResultDoesNotExist):
            add.get_result("-999999999")

    async def test_inline_aenqueue_returns_the_outcome(self) -> None:
        with inline(app):
            result = await add.aenqueue(20, 22)
        self.assertEqual((result.status, result.return_value),
                         (TaskResultStatus.SUCCESSFUL, 42))


class UnknownTasks(JobsTestCase):
    def test_a_task_name_that_fails_to_import_or_is_outside_the_apps_is_unknown(self) -> None:
        import sys

        with connection.cursor() as cur:
            for name in ("shop.broken.task", "this.zen"):
                cur.execute(sql.SQL("INSERT INTO {}.jobs (queue, task) VALUES ('default', %s)")
                            .format(sql.Identifier(app.schema)).as_string(), [name])
        # released for a worker that knows them (their attempt not counted): the worker lives
        with self.assertLogs("skipjack.worker", "WARNING") as logs:
            self.assertEqual(drain(app, scheduled_within=0), {"scheduled": 2})
        self.assertIn("task 'this.zen' is not known to this process: a worker of manage.py "
                      "skipjack knows the tasks declared in the 'tasks' module of each "
                      "installed app", "\n".join(logs.output))
        self.assertNotIn("this", sys.modules)  # a job's task name imports nothing outside
        self.assertEqual({j["task"] for j in enqueued(app)}, {"shop.broken.task", "this.zen"})
        self.assertEqual(add.enqueue(1, 1).status, TaskResultStatus.READY)

    def test_bad_backend_options_are_refused_when_the_backend_is_built(self) -> None:
        from django.tasks import task_backends
        from django.test import override_settings

        from skipjack import ValidationError

        for options, field in (({"max_attempts": 0}, "max_attempts"),
                               ({"backoff": {"bass": 1}}, "backoff"),
                               ({"lease": "soon"}, "lease"),
                               ({"tasks": "x"}, "OPTIONS"),
                               ({"tasks": {"a.b": {"idempotency_key": "{"}}}, "idempotency_key"),
                               ({"cron": [{"task": "a.b", "schedule": "61 * * * *"}]}, "cron"),
                               ({"retries": 3}, "OPTIONS")):
            backend = {"BACKEND": "skipjack.contrib.django.tasks.SkipjackBackend",
                       "OPTIONS": options}
            with override_settings(TASKS={"default": backend}), \
                    self.assertRaises(ValidationError) as refused:
                task_backends["default"]
            self.assertIn(field, str(refused.exception), options)

    def test_get_result_of_a_job_that_is_not_a_django_task(self) -> None:
        handle = mark_paid.enqueue(order_id=1)
        with self.assertRaises(TaskResultDoesNotExist):
            add.get_backend().get_result(str(handle.id))


class Admin(JobsTestCase):
    def test_the_jobs_admin_is_read_only(self) -> None:
        handle = mark_paid.enqueue(order_id=77)
        user = User.objects.create_superuser("admin", "a@example.com", "pw-for-tests-only")
        self.client.force_login(user)
        listing = self.client.get("/admin/skipjack/job/")
        self.assertEqual(listing.status_code, 200)
        self.assertContains(listing, "shop.mark_paid")
        self.assertNotContains(listing, "Add job")
        found = self.client.get(f"/admin/skipjack/job/?q={handle.id}")
        self.assertContains(found, f"/admin/skipjack/job/{handle.id}/change/")
        page = self.client.get(f"/admin/skipjack/job/{handle.id}/change/")
        self.assertEqual(page.status_code, 200)
        self.assertContains(page, "order_id")
        self.assertNotContains(page, 'name="_save"')
        self.assertEqual(self.client.post(f"/admin/skipjack/job/{handle.id}/delete/",
                                          {"post": "yes"}).status_code, 403)
        self.assertEqual(handle.state(), "available")
