"""The shop's tests, run by Django's test runner (``manage.py test shop``) on its test
database: transactions, the Tasks backend, the admin, with skipjack's test helpers."""

from __future__ import annotations

from django.contrib.auth.models import User
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
    orm_effect,
    receipt,
    which_attempt,
)
from skipjack.contrib.django import app
from skipjack.testing import assert_enqueued, drain, enqueued


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


class UnknownTasks(JobsTestCase):
    def test_a_task_name_that_fails_to_import_or_is_outside_the_apps_is_unknown(self) -> None:
        import sys

        with connection.cursor() as cur:
            for name in ("shop.broken.task", "this.zen"):
                cur.execute(sql.SQL("INSERT INTO {}.jobs (queue, task) VALUES ('default', %s)")
                            .format(sql.Identifier(app.schema)).as_string(), [name])
        # released for a worker that knows them (their attempt not counted): the worker lives
        self.assertEqual(drain(app, scheduled_within=0), {"scheduled": 2})
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
