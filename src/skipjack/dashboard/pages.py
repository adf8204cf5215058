"""The dashboard's pages and actions as Starlette routes (see ``create_app``).

Every read goes through ``skipjack.App``'s methods on its connection pool, in a worker
thread (psycopg's sync API); every page is rendered by Jinja2 with autoescaping, so whatever
users supplied (args, results, errors, task, queue and worker names) is text on the page.
Each state change is a POST carrying the CSRF token (``.security``), refused when the
dashboard is read-only, and answered with a page saying what it did.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import jinja2
import psycopg
from psycopg_pool import PoolTimeout
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from .. import actions
from ..app import App, Task
from ..cron import CronSchedule
from ..errors import SkipjackError, ValidationError
from ..jobs import STATES, TASK_MAX_BYTES, check_name
from ..search import JobFilter
from . import charts, forms
from .security import CSRF_FIELD, basic_credentials, csrf_refusal, csrf_token

log = logging.getLogger("skipjack.dashboard")

PAGE_SIZE = 50
# Seconds a job search may run before it is cancelled (a filter the indexes cannot serve,
# e.g. a rare task name over millions of finished jobs).
SEARCH_TIMEOUT = 5.0
# Seconds between refreshes of the overview's and workers page's live parts.
REFRESH_SECONDS = 5
HOUR, DAY = timedelta(hours=1), timedelta(days=1)
QUEUE_STATES = ("scheduled", "available", "running", "discarded")


def _when(value: datetime | None) -> str:
    """A timestamp as UTC text to the second."""
    if value is None:
        return ""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _duration(seconds: float | None) -> str:
    """Seconds as a short human duration (``850 ms``, ``12.5 s``, ``3m 4s``, ``2h 5m``)."""
    if seconds is None or not math.isfinite(seconds):
        return ""
    if seconds < 0:
        return "-" + _duration(-seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes}m"
    return f"{hours // 24}d {hours % 24}h"


def _pretty(value: object) -> str:
    """JSON, indented (the template escapes it)."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(loader=jinja2.PackageLoader("skipjack.dashboard", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters.update(when=_when, duration=_duration, pretty=_pretty)
    return Jinja2Templates(env=env)


class Pages:
    """The handlers of one dashboard, bound to its app and settings (see
    ``create_app``)."""

    def __init__(self, app: App, *, read_only: bool, title: str) -> None:
        self.app = app
        self.read_only = read_only
        self.title = title
        self.templates = _templates()

    # --- rendering -----------------------------------------------------------------------

    def render(self, request: Request, template: str, status: int = 200,
               **context: Any) -> Response:
        context.update(read_only=self.read_only, title=self.title, csrf_field=CSRF_FIELD,
                       csrf_token=csrf_token(request), refresh=REFRESH_SECONDS,
                       now=datetime.now(UTC), page=template.split(".")[0])
        return self.templates.TemplateResponse(request, template, context, status_code=status)

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await run_in_threadpool(fn, *args, **kwargs)

    async def _read(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A read, tried once more when its connection turns out broken (a pooled connection
        whose server restarted, or whose backend was terminated, fails once)."""
        try:
            return await run_in_threadpool(fn, *args, **kwargs)
        except (psycopg.errors.QueryCanceled, PoolTimeout):
            raise
        except psycopg.OperationalError:
            return await run_in_threadpool(fn, *args, **kwargs)

    async def form(self, request: Request) -> FormData:
        """The POST's form, once the dashboard may act and the CSRF token is right.

        Raises:
            HTTPException: 403 when read-only or the token is missing or wrong.
        """
        if self.read_only:
            raise HTTPException(403, "this dashboard is read-only: actions are disabled")
        form = await request.form(max_files=0, max_fields=2000)
        refusal = csrf_refusal(request, form.get(CSRF_FIELD))
        if refusal is not None:
            raise HTTPException(403, refusal)
        return form

    def done(self, request: Request, message: str, back: str, status: int = 200) -> Response:
        return self.render(request, "done.html", status, message=message, back=back)

    # --- pages ---------------------------------------------------------------------------

    async def _overview_data(self) -> dict[str, Any]:
        # independent reads, each on a connection of its own, at once
        summary, hour, day, last_hour, workers = await asyncio.gather(
            self._read(self.app.queue_summary),
            self._read(self.app.throughput, HOUR, timedelta(minutes=1)),
            self._read(self.app.throughput, DAY, timedelta(minutes=15)),
            self._read(self.app.finished_by_queue, HOUR),
            self._read(self.app.workers))
        now = datetime.now(UTC)
        settings = {row["name"]: row for row in summary["queues"]}
        names = sorted({*summary["depth"], *settings, *last_hour})
        queues = [{"name": name, "depth": summary["depth"].get(name, {}),
                   "oldest": summary["oldest_runnable_seconds"].get(name),
                   "settings": settings.get(name), "last_hour": last_hour.get(name, {})}
                  for name in names]
        return {
            "queues": queues, "queue_states": QUEUE_STATES, "workers": workers,
            "estimated_rows": summary["estimated_rows"],
            "charts": [
                charts.throughput_chart("Finished per minute, last hour", hour, now=now,
                                        span=HOUR, bucket=timedelta(minutes=1)),
                charts.latency_chart("Start latency, last hour", hour, now=now, span=HOUR,
                                     bucket=timedelta(minutes=1)),
                charts.throughput_chart("Finished per minute, last day (15-minute means)",
                                        day, now=now, span=DAY,
                                        bucket=timedelta(minutes=15)),
                charts.latency_chart("Start latency, last day (per 15 minutes)", day,
                                     now=now, span=DAY, bucket=timedelta(minutes=15)),
            ],
        }

    async def overview(self, request: Request) -> Response:
        return self.render(request, "overview.html", **await self._overview_data())

    async def overview_live(self, request: Request) -> Response:
        return self.render(request, "overview_live.html", **await self._overview_data())

    async def jobs(self, request: Request) -> Response:
        try:
            where = forms.job_filter(request.query_params)
            before = forms.job_id(forms.text(request.query_params, "before"), "before")
            after = forms.job_id(forms.text(request.query_params, "after"), "after")
        except ValidationError as exc:
            return self.render(request, "jobs.html", 400, error=str(exc), rows=[],
                               where=JobFilter(), states=STATES, older=None, newer=None,
                               query="", fields={})
        error = None
        try:
            rows = await self._read(self.app.search_jobs, where, before=before, after=after,
                                    limit=PAGE_SIZE + 1, statement_timeout=SEARCH_TIMEOUT)
        except psycopg.errors.QueryCanceled:
            rows, error = [], (f"the search took longer than {SEARCH_TIMEOUT:g} s and was "
                               "stopped: narrow it (a state, a queue, a time range)")
        more = len(rows) > PAGE_SIZE
        if after is not None and before is None:
            rows = rows[-PAGE_SIZE:]
            older = rows[-1]["id"] if rows else None
            newer = rows[0]["id"] if rows and more else None
        else:
            rows = rows[:PAGE_SIZE]
            older = rows[-1]["id"] if rows and more else None
            newer = rows[0]["id"] if rows and (before is not None) else None
        return self.render(request, "jobs.html", 200 if error is None else 503, rows=rows,
                           where=where, states=STATES, older=older, newer=newer,
                           query=forms.filter_query(where), fields=forms.filter_fields(where),
                           error=error)

    async def job(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        job = await self._read(self.app.get_job, job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id} (never enqueued, or pruned)")
        if not isinstance(job["errors"], list):  # not as skipjack writes it: shown as is
            job["errors"] = [{"error": f"(errors column is not a list: {job['errors']!r})"}]
        return self.render(request, "job.html", job=job, timeline=timeline(job))

    async def job_action(self, request: Request) -> Response:
        form = await self.form(request)
        action = form.get("action")
        scope = form.get("scope", "selected")
        if action not in actions.ACTIONS or scope not in ("selected", "matching"):
            raise HTTPException(400, "action: give retry, cancel or discard")
        try:
            where = forms.job_filter(form)
        except ValidationError as exc:
            return self.done(request, str(exc), self._jobs_url(request, JobFilter()), 400)
        back = str(form.get("back") or "")
        if not back.startswith(str(request.url_for("jobs"))):
            back = self._jobs_url(request, where)
        if scope == "matching":
            if where.state is not None and where.state not in actions.ACTS_ON[action]:
                return self.done(request, f"nothing to do: {action} applies to "
                                          f"{' or '.join(actions.ACTS_ON[action])} jobs, and "
                                          f"the filter asks for {where.state} ones", back)
            if form.get("confirm") != "yes":
                return self.render(request, "confirm.html", action=action,
                                   fields=forms.filter_fields(where), back=back,
                                   acts_on=actions.ACTS_ON[action])
            account = await self._call(actions.apply_matching, self.app, action, where)
        else:
            try:
                ids = [i for i in (forms.job_id(str(v), "job") for v in form.getlist("job"))
                       if i is not None]
            except ValidationError as exc:
                return self.done(request, str(exc), back, 400)
            if not ids:
                return self.done(request, "no job selected: tick some jobs first", back, 400)
            account = await self._call(actions.apply, self.app, action, ids)
        log.info("%s %s from %s: %s", action, scope, _client(request), account.describe())
        return self.done(request, account.describe(), back)

    def _jobs_url(self, request: Request, where: JobFilter) -> str:
        query = forms.filter_query(where)
        return str(request.url_for("jobs")) + (f"?{query}" if query else "")

    def _queues_data(self) -> dict[str, Any]:
        summary = self.app.queue_summary()
        settings = {row["name"]: row for row in summary["queues"]}
        served = {q for w in self.app.workers() for q in w["queues"] or ()}
        known = {t.queue for t in self.app.tasks.values()}
        names = sorted({*summary["depth"], *settings, *served, *known})
        return {"queues": [{"name": n, "depth": summary["depth"].get(n, {}),
                            "oldest": summary["oldest_runnable_seconds"].get(n),
                            "settings": settings.get(n)} for n in names],
                "queue_states": QUEUE_STATES}

    async def queues(self, request: Request) -> Response:
        return self.render(request, "queues.html", **await self._read(self._queues_data))

    async def queue_action(self, request: Request) -> Response:
        form = await self.form(request)
        back = str(request.url_for("queues"))
        queue = forms.text(form, "queue") or ""
        action = form.get("action")
        try:
            if action == "pause":
                await self._call(self.app.pause_queue, queue)
                message = f"queue {queue!r} paused: no worker claims from it until resumed"
            elif action == "resume":
                await self._call(self.app.resume_queue, queue)
                message = f"queue {queue!r} resumed"
            elif action == "limits":
                concurrency = forms.optional_int(forms.text(form, "concurrency"),
                                                 "concurrency")
                rate = forms.optional_int(forms.text(form, "rate"), "rate")
                period = forms.optional_seconds(forms.text(form, "period"), "period")
                await self._call(self.app.set_queue_limits, queue, concurrency=concurrency,
                                 rate=rate, period=period)
                message = (f"queue {queue!r}: concurrency limit "
                           f"{concurrency if concurrency is not None else 'none'}, rate limit "
                           + (f"{rate} per {period:g} s" if rate is not None and period
                              else "none"))
            else:
                raise HTTPException(400, "action: give pause, resume or limits")
        except ValidationError as exc:
            return self.done(request, f"nothing changed: {exc}", back, 400)
        log.info("queue action from %s: %s", _client(request), message)
        return self.done(request, message, back)

    def _cron_data(self) -> dict[str, Any]:
        history = {row["name"]: row for row in self.app.cron_history()}
        now = datetime.now(UTC)
        entries = []
        for name in sorted({*self.app.crons, *history}):
            entry = self.app.crons.get(name)
            row = history.get(name, {})
            entries.append({
                "name": name, "entry": entry,
                "expr": (f"{entry.schedule.expr} ({entry.schedule.tz})" if entry else None),
                "task": entry.task.name if entry else None,
                "args": entry.args if entry else None,
                "last": row.get("last_enqueued"), "missed": row.get("missed", 0),
                "next": next_slot(entry.schedule, now) if entry else None,
            })
        return {"entries": entries}

    async def cron(self, request: Request) -> Response:
        return self.render(request, "cron.html", **await self._read(self._cron_data))

    async def cron_run(self, request: Request) -> Response:
        form = await self.form(request)
        back = str(request.url_for("cron"))
        name = forms.text(form, "name") or ""
        entry = self.app.crons.get(name)
        if entry is None:
            return self.done(request, f"no cron schedule {name!r} in this dashboard's app "
                                      "(start it with the app: skipjack dashboard MODULE:APP)",
                             back, 404)
        job_id = await self._call(self.app.enqueue, entry.task.job(**entry.args))
        log.info("cron %r run now from %s: job %s", name, _client(request), job_id)
        return self.done(request, f"cron {name!r}: enqueued job {job_id} now (outside its "
                                  "schedule; its slots are unchanged)", back)

    def _workers_data(self) -> dict[str, Any]:
        running: dict[str, list[dict[str, Any]]] = {}
        for job in self.app.running_jobs():
            running.setdefault(job["worker"] or "", []).append(job)
        return {"workers": self.app.workers(), "running": running}

    async def workers(self, request: Request) -> Response:
        return self.render(request, "workers.html", **await self._read(self._workers_data))

    async def workers_live(self, request: Request) -> Response:
        return self.render(request, "workers_live.html",
                           **await self._read(self._workers_data))

    async def enqueue_form(self, request: Request) -> Response:
        if self.read_only:
            raise HTTPException(403, "this dashboard is read-only: actions are disabled")
        return self.render(request, "enqueue.html", tasks=sorted(self.app.tasks), values={},
                           error=None)

    async def enqueue(self, request: Request) -> Response:
        form = await self.form(request)
        values = {k: str(v) for k, v in form.items() if k != CSRF_FIELD}
        try:
            spec = self._hand_job(form)
            job_id = await self._call(self.app.enqueue, spec)
        except (ValidationError, SkipjackError) as exc:
            return self.render(request, "enqueue.html", 400, tasks=sorted(self.app.tasks),
                               values=values, error=f"nothing enqueued: {exc}")
        log.info("enqueued job %s (%s) by hand from %s", job_id, spec.task, _client(request))
        link = str(request.url_for("job", job_id=job_id))
        return self.done(request, f"enqueued job {job_id}", link)

    def _hand_job(self, form: FormData) -> Any:
        name = forms.text(form, "task")
        if name is None:
            raise ValidationError("task", "give a task name")
        task = self.app.tasks.get(name)
        if task is None and self.app.tasks:
            close = [t for t in sorted(self.app.tasks) if t.endswith("." + name) or name in t]
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValidationError("task", f"{name!r} is not a task of this app{hint}")
        if task is None:  # no app given: args are checked as JSON only
            task = Task(self.app, _unregistered, check_name("task", name, TASK_MAX_BYTES))
        args = forms.json_object(forms.text(form, "args"), "args")
        task = task.configure(
            queue=forms.text(form, "queue"),
            priority=forms.optional_int(forms.text(form, "priority"), "priority"),
            delay=forms.optional_seconds(forms.text(form, "delay"), "delay"))
        return task.job(**args)


def _client(request: Request) -> str:
    """Who sent a request, for the log (the address, and the basic-auth user if any)."""
    address = request.client.host if request.client else "?"
    pair = basic_credentials(request.headers.get("authorization"))
    return f"{pair[0]}@{address}" if pair else address


def _unregistered(**_kwargs: Any) -> None:
    """Stands in for a task this process does not register (never called)."""


def next_slot(schedule: CronSchedule, now: datetime) -> datetime | None:
    """The first slot of ``schedule`` after ``now``, looked for up to eight years ahead
    (a February 29th schedule's longest gap), or None."""
    for ahead in (timedelta(hours=2), timedelta(days=2), timedelta(days=400),
                  timedelta(days=366 * 8 + 2)):
        slots = schedule.slots(now, now + ahead)
        if slots:
            return slots[0]
    return None


def timeline(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a job's life in time order: enqueued, each attempt's start and outcome
    (its error, a lease loss), the last attempt's start and the job's end, each with
    ``at``, ``what``, ``worker`` and ``detail``."""
    delayed = job["attempt"] == 0 and job["run_at"] != job["created_at"]
    events: list[dict[str, Any]] = [{"at": job["created_at"], "what": "enqueued",
                                     "worker": None, "detail": f"runnable at "
                                     f"{_when(job['run_at'])}" if delayed else ""}]
    starts = set()
    for entry in job["errors"] if isinstance(job["errors"], list) else []:
        if not isinstance(entry, dict):
            continue
        at, started = _parse(entry.get("at")), _parse(entry.get("started_at"))
        attempt = entry.get("attempt")
        worker = entry.get("worker")
        if started is not None:
            starts.add(started)
            events.append({"at": started, "what": f"attempt {attempt} started",
                           "worker": worker, "detail": ""})
        error = str(entry.get("error", ""))
        what = "lease lost" if error.startswith("lease expired") else f"attempt {attempt} failed"
        events.append({"at": at, "what": what, "worker": worker, "detail": error})
    attempted = job["attempted_at"]
    if attempted is not None and attempted not in starts and job["attempt"]:
        events.append({"at": attempted, "what": f"attempt {job['attempt']} started",
                       "worker": job["worker"] if job["state"] != "available" else None,
                       "detail": ""})
    if job["finished_at"] is not None:
        events.append({"at": job["finished_at"], "what": job["state"],
                       "worker": job["worker"], "detail": ""})
    elif job["state"] == "running":
        events.append({"at": job["lease_expires_at"], "what": "lease expires",
                       "worker": job["worker"],
                       "detail": "cancellation requested" if job["cancel_requested"] else ""})
    epoch = datetime.min.replace(tzinfo=UTC)
    return sorted(events, key=lambda e: e["at"] or epoch)


def _parse(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def routes(pages: Pages) -> list[Route | Mount]:
    """The dashboard's routes (names used by the templates' ``url_for``)."""
    def get(path: str, endpoint: Callable[[Request], Awaitable[Response]], name: str) -> Route:
        return Route(path, endpoint, methods=["GET"], name=name)

    def post(path: str, endpoint: Callable[[Request], Awaitable[Response]],
             name: str) -> Route:
        return Route(path, endpoint, methods=["POST"], name=name)

    return [
        get("/", pages.overview, "overview"),
        get("/live/overview", pages.overview_live, "overview_live"),
        get("/jobs", pages.jobs, "jobs"),
        post("/jobs/action", pages.job_action, "job_action"),
        get("/jobs/{job_id:int}", pages.job, "job"),
        get("/queues", pages.queues, "queues"),
        post("/queues/action", pages.queue_action, "queue_action"),
        get("/cron", pages.cron, "cron"),
        post("/cron/run", pages.cron_run, "cron_run"),
        get("/workers", pages.workers, "workers"),
        get("/live/workers", pages.workers_live, "workers_live"),
        get("/enqueue", pages.enqueue_form, "enqueue_form"),
        post("/enqueue", pages.enqueue, "enqueue"),
        Mount("/static", StaticFiles(packages=[("skipjack.dashboard", "static")]),
              name="static"),
    ]


def starlette_app(pages: Pages) -> Starlette:
    """The Starlette application of ``pages``, with its error pages."""

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return pages.render(request, "error.html", exc.status_code, message=exc.detail)

    async def database_error(request: Request, exc: Exception) -> Response:
        if request.method == "POST":
            what = ("the database could not be reached, so the action may or may not have "
                    "been applied (look at the jobs before trying again)")
        else:
            what = "the database could not be read"
        return pages.render(request, "error.html", 503, message=f"{what}: {str(exc).strip()}")

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return pages.render(request, "error.html", 500,
                            message=f"the dashboard failed: {type(exc).__name__} (logged)")

    return Starlette(routes=routes(pages), exception_handlers={
        HTTPException: http_error, psycopg.OperationalError: database_error,
        Exception: server_error})
