"""A backend for Django's Tasks framework (``django.tasks``, Django 6) that stores each task
as a skipjack job, run by ``manage.py skipjack worker``::

    TASKS = {
        "default": {
            "BACKEND": "skipjack.contrib.django.tasks.SkipjackBackend",
            "QUEUES": ["default", "emails"],       # optional: the queues tasks may use
            "OPTIONS": {                           # optional, every key
                "max_attempts": 1,                 # attempts per task (1: no retry)
                "backoff": {"base": 1, "cap": 3600},   # skipjack.Backoff between attempts
                "lease": 30, "timeout": None,      # seconds (see skipjack.App.task)
                "tasks": {                         # per task (by module path), the same keys
                    "shop.tasks.send_receipt": {   # and an idempotency key: a format string
                        "max_attempts": 5,         # over the call's arguments
                        "idempotency_key": "receipt-{order_id}",
                    },
                },
                "cron": [                          # tasks enqueued on a schedule
                    {"task": "shop.tasks.nightly_report", "schedule": "0 3 * * *",
                     "tz": "Europe/Berlin", "args": [], "kwargs": {}},
                ],
            },
        },
    }

``enqueue`` (and ``aenqueue``) write the job on Django's connection, so inside
``transaction.atomic()`` it commits or rolls back with the transaction (no ``on_commit``
needed), and ``get_result`` on that connection sees it before the commit. Priorities
(-100..100), ``queue_name``, ``run_after`` and ``takes_context`` work as Django defines
them; return values and errors are stored as Django describes them (JSON values; each
error's exception class path and traceback).

Statuses: a job waiting (or scheduled for a retry) is READY, a running one RUNNING, a
succeeded one SUCCESSFUL, and a discarded or cancelled one FAILED. Attempts are counted by
skipjack (``TaskResult.attempts``); ``task_started`` is sent at each attempt's start,
``task_finished`` at its end unless another attempt follows.

Under ``skipjack.testing.inline(app)`` a task runs inside ``enqueue``, as with Django's
immediate backend: the result returned is final (SUCCESSFUL with its return value, or FAILED
with the error, which is not raised), has a negative id, and ``get_result`` knows it (the
newest ``INLINE_RESULTS_KEPT`` of them, in memory: nothing was written).
"""

from __future__ import annotations

import os
import socket
import string
import sys
import threading
import traceback
from collections import OrderedDict
from contextlib import nullcontext
from contextvars import ContextVar
from datetime import datetime
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from django.apps import apps
from django.tasks import Task as _DjangoTask
from django.tasks import TaskContext, TaskResultStatus, task_backends
from django.tasks import TaskResult as _TaskResult
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TaskError
from django.tasks.exceptions import TaskResultDoesNotExist
from django.tasks.signals import task_finished, task_started
from django.utils import timezone
from django.utils.json import normalize_json
from django.utils.module_loading import import_string

from ...app import Task
from ...connections import reading_cursor
from ...context import current_job
from ...cron import CronSchedule
from ...durations import parse_duration
from ...errors import ValidationError
from ...jobs import check_lease, check_max_attempts, check_timeout
from ...retry import Backoff
from .application import DjangoApp, get_app

TASK_OPTIONS = {"max_attempts", "backoff", "lease", "timeout", "idempotency_key"}
OPTIONS = (TASK_OPTIONS - {"idempotency_key"}) | {"tasks", "cron"}
CRON_KEYS = {"task", "schedule", "tz", "args", "kwargs", "name", "grace"}
_P = ParamSpec("_P")
_R = TypeVar("_R")
if TYPE_CHECKING:  # generic in django-stubs only
    DjangoTask = _DjangoTask[..., Any]
    TaskResult = _TaskResult[..., Any]
else:
    DjangoTask, TaskResult = _DjangoTask, _TaskResult
_WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"

# Results of tasks run under skipjack.testing.inline (negative ids) that get_result knows.
INLINE_RESULTS_KEPT = 1000
_inline_results: OrderedDict[int, TaskResult] = OrderedDict()
_inline_lock = threading.Lock()
# The results of the inline runs of one backend enqueue (None: no enqueue of the backend's).
_inline_runs: ContextVar[list[TaskResult] | None] = ContextVar("skipjack_inline_runs",
                                                               default=None)

STATUS = {"scheduled": TaskResultStatus.READY, "available": TaskResultStatus.READY,
          "running": TaskResultStatus.RUNNING, "succeeded": TaskResultStatus.SUCCESSFUL,
          "discarded": TaskResultStatus.FAILED, "cancelled": TaskResultStatus.FAILED}


class SkipjackBackend(BaseTaskBackend):
    """Django Tasks on skipjack (see the module's doc for the settings).

    Raises:
        ValidationError: (when built) an unknown option, or one out of its range.
    """

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        where = f"TASKS[{alias!r}]['OPTIONS']"
        if not isinstance(self.options, dict):
            raise ValidationError("OPTIONS", f"{where} must be a dict")
        unknown = set(self.options) - OPTIONS
        if unknown:
            raise ValidationError("OPTIONS", f"{where}: unknown option(s) {sorted(unknown)}; "
                                  f"known: {sorted(OPTIONS)}")
        self.options = dict(self.options)
        tasks = self.options.get("tasks") or {}
        if not isinstance(tasks, dict) or not all(isinstance(v, dict) for v in tasks.values()):
            raise ValidationError("OPTIONS", f"{where}['tasks'] must map task paths to dicts")
        base = _task_options(where, {k: v for k, v in self.options.items()
                                     if k in TASK_OPTIONS})
        self.options.update(base)
        self.options["tasks"] = {path: _task_options(f"{where}['tasks'][{path!r}]", opts)
                                 for path, opts in tasks.items()}
        cron = self.options.get("cron") or []
        if not isinstance(cron, list) or not all(isinstance(e, dict) for e in cron):
            raise ValidationError("OPTIONS", f"{where}['cron'] must be a list of dicts")
        for entry in cron:
            bad = set(entry) - CRON_KEYS
            if bad or "task" not in entry or "schedule" not in entry:
                raise ValidationError("cron", f"{where}['cron'] entry {entry!r}: needs task "
                                      f"and schedule, may have {sorted(CRON_KEYS)}")
            CronSchedule(entry["schedule"], entry.get("tz", "UTC"))  # raises when bad

    @property
    def app(self) -> DjangoApp:
        """The project's skipjack app (``skipjack.contrib.django.app``)."""
        return get_app()

    def task_options(self, path: str) -> dict[str, Any]:
        """The options of the task at ``path``: the backend's, then the task's own."""
        base = {k: v for k, v in self.options.items() if k in TASK_OPTIONS}
        return {**base, **(self.options.get("tasks") or {}).get(path, {})}

    def enqueue(self, task: _DjangoTask[_P, _R], args: list[Any], kwargs: dict[str, Any]
                ) -> _TaskResult[_P, _R]:
        """Write the task as a job on Django's connection; returns its result (READY).
        Under ``skipjack.testing.inline`` the task runs now instead, and the result returned
        is its outcome (SUCCESSFUL, or FAILED with the error; see the module's doc).

        Raises:
            InvalidTask: the task breaks a rule of Django's (see ``validate_task``).
            TypeError: an argument is not JSON (Django's ``normalize_json``).
            ValidationError: a value out of skipjack's ranges, or an idempotency key's
                format names an argument the call does not have; (field ``conn``) Django's
                connection is in an atomic block it may not be used in (see
                ``DjangoApp.default_connection``).
        """
        self.validate_task(task)
        args, kwargs = list(normalize_json(list(args))), dict(normalize_json(dict(kwargs)))  # type: ignore[arg-type]
        runner = runner_for(self.app, task)
        options = self.task_options(task.module_path)
        key = options.get("idempotency_key")
        if key is not None:
            try:
                key = str(key).format(*args, **kwargs)
            except (KeyError, IndexError, AttributeError, ValueError) as exc:
                raise ValidationError("idempotency_key", f"{options['idempotency_key']!r} "
                                      f"names {exc}, which this call does not give") from None
        run_after = task.run_after
        if run_after is not None and timezone.is_naive(run_after):
            run_after = timezone.make_aware(run_after)
        spec = runner.configure(
            queue=task.queue_name, priority=task.priority, run_at=run_after,
            idempotency_key=key,
        ).job(args=args, kwargs=kwargs,
              run_after=task.run_after.isoformat() if task.run_after else None)
        runs: list[TaskResult] = []
        token = _inline_runs.set(runs)
        try:
            job_id: int | None = self.app.enqueue(spec)
        except KeyboardInterrupt:
            raise
        except BaseException:
            if not (runs and runs[-1].status == TaskResultStatus.FAILED):
                raise
            job_id = None  # it ran inline and failed: the result says so, as Django's does
        finally:
            _inline_runs.reset(token)
        if job_id is not None and job_id > 0:
            result = self.get_result(str(job_id))
        elif runs:  # run by skipjack.testing.inline
            result = runs[-1]
            _keep_inline(result)
        else:
            raise RuntimeError(f"task {task.module_path!r}: job {job_id} was run by an "
                               f"inline enqueue that did not report its result")
        from django.tasks.signals import task_enqueued
        task_enqueued.send(type(self), task_result=result)
        return result  # type: ignore[return-value]  # the same task, read back

    def get_result(self, result_id: str) -> TaskResult:
        """The task's result, read on Django's connection: a job enqueued in this thread's
        open transaction is seen (on a thread running an event loop, where Django refuses
        its connection, on a connection of the app's).

        A negative id is a task run by ``skipjack.testing.inline``: its result is kept in
        memory (the newest ``INLINE_RESULTS_KEPT``).

        Raises:
            TaskResultDoesNotExist: no job has this id (or it was pruned by retention).
        """
        try:
            job_id = int(result_id)
        except (TypeError, ValueError):
            raise TaskResultDoesNotExist(result_id) from None
        if job_id < 0:
            with _inline_lock:
                kept = _inline_results.get(job_id)
            if kept is None:
                raise TaskResultDoesNotExist(result_id)
            return kept
        app = self.app
        django_conn = app.django_connection(in_atomic_block="other")
        with nullcontext(django_conn) if django_conn else app.reading() as conn, \
                reading_cursor(conn) as cur:
            row = cur.execute(app.queries.GET_JOB, {"id": job_id}).fetchone()
            names = [c.name for c in cur.description or ()]
        if row is None:
            raise TaskResultDoesNotExist(result_id)
        return self.result_of(dict(zip(names, row, strict=True)))

    def result_of(self, job: dict[str, Any]) -> TaskResult:
        """A ``TaskResult`` of a job's row (as ``skipjack.App.get_job`` reads it)."""
        payload = job["args"] or {}
        run_after = payload.get("run_after")
        task = _django_task(job["task"]).using(
            priority=job["priority"], queue_name=job["queue"], backend=self.alias,
            run_after=datetime.fromisoformat(run_after) if run_after else None)
        errors = [e for e in job["errors"] or [] if isinstance(e, dict)]
        attempt = job["attempt"]
        worker_ids = [str(e.get("worker") or "") for e in errors if e.get("attempt")]
        worker_ids += [str(job["worker"] or "")] * (attempt - len(worker_ids))
        started = errors[0].get("started_at") if errors else None
        result: TaskResult = _TaskResult(
            task=task, id=str(job["id"]), status=STATUS[job["state"]],
            enqueued_at=job["created_at"],
            started_at=_time(started) or job["attempted_at"],
            finished_at=job["finished_at"], last_attempted_at=job["attempted_at"],
            args=list(payload.get("args", [])), kwargs=dict(payload.get("kwargs", {})),
            backend=self.alias,
            errors=[TaskError(exception_class_path=str(e.get("type") or "builtins.Exception"),
                              traceback=str(e.get("traceback") or e.get("error") or ""))
                    for e in errors if e.get("attempt")],
            worker_ids=worker_ids[:attempt])
        object.__setattr__(result, "_return_value", job["result"])
        return result


def _task_options(where: str, options: dict[str, Any]) -> dict[str, Any]:
    """Checked options of a task (or the backend's defaults): durations parsed to seconds.

    Raises:
        ValidationError: an unknown option or a value out of its range, naming it.
    """
    bad = set(options) - TASK_OPTIONS
    if bad:
        raise ValidationError("OPTIONS", f"{where}: unknown option(s) {sorted(bad)}; known: "
                              f"{sorted(TASK_OPTIONS)}")
    out = dict(options)
    if "max_attempts" in out:
        out["max_attempts"] = check_max_attempts(out["max_attempts"])
    for name, check in (("lease", check_lease), ("timeout", check_timeout)):
        if out.get(name) is not None:
            try:
                seconds = parse_duration(out[name])
            except ValueError as exc:
                raise ValidationError(name, f"{where}: {exc}") from None
            out[name] = check(seconds)
    backoff = out.get("backoff")
    if backoff is not None:
        if not isinstance(backoff, dict):
            raise ValidationError("backoff", f"{where}: must be a dict of skipjack.Backoff's "
                                  "arguments (base, cap, jitter)")
        try:
            out["backoff"] = Backoff(**backoff)
        except TypeError:
            raise ValidationError("backoff", f"{where}: takes base, cap and jitter, got "
                                  f"{sorted(backoff)}") from None
    key = out.get("idempotency_key")
    if key is not None:
        try:
            if not isinstance(key, str):
                raise ValueError("not a string")
            list(string.Formatter().parse(key))
        except ValueError as exc:
            raise ValidationError("idempotency_key", f"{where}: {key!r} is not a format "
                                  f"string ({exc})") from None
    return out


def _keep_inline(result: TaskResult) -> None:
    """Remember the result of an inline run for ``get_result`` (the newest
    ``INLINE_RESULTS_KEPT``)."""
    with _inline_lock:
        _inline_results[int(result.id)] = result
        while len(_inline_results) > INLINE_RESULTS_KEPT:
            _inline_results.popitem(last=False)


def _time(value: object) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def _django_task(path: str) -> DjangoTask:
    try:
        task = import_string(path)
    except ImportError:
        raise TaskResultDoesNotExist(f"{path!r} is not a Django task") from None
    if not isinstance(task, _DjangoTask):
        raise TaskResultDoesNotExist(f"{path!r} is not a Django task")
    return task


_runners: dict[str, Task] = {}
_runners_lock = threading.RLock()


def runner_for(app: DjangoApp, django_task: DjangoTask) -> Task:
    """The skipjack task that runs ``django_task`` (named by its module path), made on first
    use with the options of its backend."""
    path = django_task.module_path
    with _runners_lock:
        existing = _runners.get(path)
        if existing is not None and existing.app is app:
            return existing
        backend = task_backends[django_task.backend]
        options = backend.task_options(path) if isinstance(backend, SkipjackBackend) else {}

        def run(args: list[Any], kwargs: dict[str, Any], run_after: str | None = None) -> Any:
            return _run(django_task, backend, args, kwargs)

        runner = app.task(
            name=path, queue=django_task.queue_name,
            max_attempts=options.get("max_attempts", 1), backoff=options.get("backoff"),
            lease=options.get("lease"), timeout=options.get("timeout"))(run)
        _runners[path] = runner
        return runner


def register_discovered(app: DjangoApp, module: str) -> None:
    """Make the runner (``runner_for``) of every Django task sent to a skipjack backend that
    the ``module`` module of an installed app holds (imported by ``autodiscover``), at
    startup: the dashboard's task list and ``app.tasks`` then know it before its first
    enqueue, as they know skipjack's own tasks. A task whose backend is not configured is
    left for its enqueue to refuse."""
    for config in apps.get_app_configs():
        found = sys.modules.get(f"{config.name}.{module}")
        if found is None:
            continue
        for value in list(vars(found).values()):
            if not isinstance(value, _DjangoTask):
                continue
            try:
                backend = task_backends[value.backend]
            except Exception:  # an alias TASKS does not configure
                continue
            if isinstance(backend, SkipjackBackend):
                runner_for(app, value)


def runner_for_path(app: DjangoApp, path: str) -> Task | None:
    """``runner_for`` the Django task at ``path`` if it is one sent to a skipjack
    backend, else None (a worker's lookup of a job's task name). Only modules already
    imported or inside an installed app are imported (a job's task name is data).

    Raises:
        Exception: whatever importing the module raises.
    """
    module = path.rpartition(".")[0]
    if module not in sys.modules and apps.get_containing_app_config(module) is None:
        return None
    try:
        task = import_string(path)
    except ImportError:
        return None
    if not isinstance(task, _DjangoTask):
        return None
    if not isinstance(task_backends[task.backend], SkipjackBackend):
        return None
    return runner_for(app, task)


def _run(django_task: DjangoTask, backend: BaseTaskBackend, args: list[Any],
         kwargs: dict[str, Any]) -> Any:
    """Run one attempt of a Django task in a skipjack worker, as Django's immediate backend
    runs one: signals, the context, the JSON return value. Under ``skipjack.testing.inline``
    (a negative job id) the one attempt is the last, and its result goes to the enqueue
    that ran it."""
    ctx = current_job()
    job = ctx.job
    inline = job.id < 0
    result: TaskResult = _TaskResult(
        task=django_task.using(priority=job.priority, queue_name=job.queue),
        id=str(job.id), status=TaskResultStatus.RUNNING, enqueued_at=job.created_at,
        started_at=job.attempted_at, finished_at=None, last_attempted_at=job.attempted_at,
        args=args, kwargs=kwargs, backend=backend.alias, errors=[],
        worker_ids=[_WORKER_ID] * job.attempt)
    task_started.send(type(backend), task_result=result)
    last = job.attempt >= job.max_attempts or inline
    runs = _inline_runs.get() if inline else None
    try:
        if django_task.takes_context:
            value = django_task.call(TaskContext(task_result=result), *args, **kwargs)
        else:
            value = django_task.call(*args, **kwargs)
        value = normalize_json(value)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        if last:
            object.__setattr__(result, "status", TaskResultStatus.FAILED)
            object.__setattr__(result, "finished_at", timezone.now())
            result.errors.append(TaskError(
                exception_class_path=f"{type(exc).__module__}.{type(exc).__qualname__}",
                traceback="".join(traceback.format_exception(exc))))
            task_finished.send(type(backend), task_result=result)
            if runs is not None:
                runs.append(result)
        raise  # recorded by the worker: a retry, or the dead letter after the last attempt
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", timezone.now())
    object.__setattr__(result, "_return_value", value)
    task_finished.send(type(backend), task_result=result)
    if runs is not None:
        runs.append(result)
    return value


def register_crons(app: DjangoApp) -> None:
    """Schedule the ``cron`` entries of every skipjack backend of ``settings.TASKS`` on
    ``app`` (at startup; an entry already scheduled is left as it is).

    Raises:
        ValidationError: an entry with an unknown key, a bad expression or zone, or a task
            path that is not a Django task.
    """
    from django.conf import settings

    for alias, params in getattr(settings, "TASKS", {}).items():
        if not str(params.get("BACKEND", "")).endswith(".SkipjackBackend"):
            continue
        backend = task_backends[alias]
        if not isinstance(backend, SkipjackBackend):
            continue
        for entry in backend.options.get("cron") or []:  # checked by the backend
            name = entry.get("name") or entry["task"]
            if name in app.crons:
                continue
            try:
                django_task = _django_task(entry["task"])
            except TaskResultDoesNotExist as exc:
                raise ValidationError("cron", f"TASKS[{alias!r}] cron task "
                                      f"{entry['task']!r}: {exc}") from None
            runner = runner_for(app, django_task)
            app.cron(entry["schedule"], tz=entry.get("tz", "UTC"), name=name,
                     grace=entry.get("grace", 600.0),
                     args={"args": list(entry.get("args", [])),
                           "kwargs": dict(entry.get("kwargs", {}))})(runner)
