"""The dashboard (``skipjack dashboard``) served by a real uvicorn process against real
PostgreSQL, driven over HTTP here and in headless Chromium in test_dashboard_browser.py:
pages, filters and keyset pagination, every action and what it reports, and the security
rules (escaping, CSRF, read-only, credentials, the Host check)."""

from __future__ import annotations

import base64
import html
import http.cookiejar
import json
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from skipjack import App

from support import Server, free_port, http_get, query, wait_until

pytest.importorskip("starlette")

TESTS = Path(__file__).parent


class Dashboard:
    """``python -m skipjack dashboard dashboard_app:app`` in a child process."""

    def __init__(self, server: Server, schema: str, *options: str,
                 env: dict[str, str] | None = None, app: str | None = "dashboard_app:app",
                 host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        cmd = [sys.executable, "-m", "skipjack", "--dsn", server.dsn, "--schema", schema,
               "dashboard", *([app] if app else []), "--host", host, "--port",
               str(self.port), *options]
        self.proc = subprocess.Popen(
            cmd, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "SKIPJACK_SCHEMA": schema, **(env or {})})

    def wait_ready(self) -> None:
        def answers() -> bool:
            assert self.proc.poll() is None, self.output()
            return http_get(self.url + "/static/dashboard.css", timeout=2)[0] in (200, 401)
        wait_until(answers, timeout=30)

    def output(self, kill: bool = True) -> str:
        """What it printed: at once (killing it if it still runs), or once it exits."""
        if kill and self.proc.poll() is None:
            self.proc.kill()
        out, _ = self.proc.communicate(timeout=60)
        return out.decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


class Client:
    """A cookie-keeping HTTP client: GET pages, POST their forms with the CSRF token."""

    def __init__(self, base: str, headers: dict[str, str] | None = None) -> None:
        self.base = base
        self.headers = headers or {}
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))
        self.token = ""

    def request(self, path: str, data: dict[str, Any] | list[tuple[str, str]] | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, str]:
        body = urllib.parse.urlencode(data, doseq=True).encode() if data is not None else None
        req = urllib.request.Request(self.base + path, data=body,
                                     headers={**self.headers, **(headers or {})})
        try:
            with self.opener.open(req, timeout=30) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
        found = re.search(r'name="csrf_token" value="([0-9a-f]+)"', text)
        if found:
            self.token = found.group(1)
        return status, text

    def get(self, path: str) -> tuple[int, str]:
        return self.request(path)

    def post(self, path: str, fields: dict[str, Any] | list[tuple[str, str]],
             token: bool = True) -> tuple[int, str]:
        if not self.token:
            self.get("/jobs")  # a page with forms
        items = list(fields.items()) if isinstance(fields, dict) else list(fields)
        if token:
            items.append(("csrf_token", self.token))
        return self.request(path, items)


def message(page: str) -> str:
    found = re.search(r'id="message"[^>]*>(.*?)</p>', page, re.S)
    assert found, page[:2000]
    return html.unescape(found.group(1)).strip()


@pytest.fixture
def dash_app(app: App) -> Iterator[App]:
    """The app of dashboard_app.py on the test's schema (same tasks as the server's)."""
    sys.path.insert(0, str(TESTS))
    import dashboard_app

    dashboard_app.app.db, dashboard_app.app.schema = app.db, app.schema
    yield dashboard_app.app
    dashboard_app.app.close()


@pytest.fixture
def dashboard(server: Server, schema: str, dash_app: App) -> Iterator[Dashboard]:
    d = Dashboard(server, schema)
    d.wait_ready()
    yield d
    d.stop()


def discarded_jobs(app: App, queue: str, n: int, error: str = "ValueError: boom") -> list[int]:
    """n discarded jobs in ``queue``, as the worker leaves them (an error entry each)."""
    from dashboard_app import bounce

    ids = app.enqueue_many([bounce.configure(queue=queue).job(to=f"u{i}") for i in range(n)])
    entry = json.dumps([{"attempt": 2, "error": error, "traceback": "Traceback...\n" + error,
                         "at": "2026-12-01T10:00:00+00:00", "worker": "w1"}])
    with app.connect() as conn:
        conn.execute(psycopg.sql.SQL(
            "UPDATE {}.jobs SET state = 'discarded', attempt = 2, finished_at = now(), "
            "errors = %s::jsonb WHERE id = ANY(%s)").format(psycopg.sql.Identifier(app.schema)),
            (entry, ids))
    return ids


def job_state(app: App, job_id: int) -> str:
    job = app.get_job(job_id)
    assert job is not None
    return str(job["state"])


# --- pages ---------------------------------------------------------------------------------


def test_every_page_renders_with_strict_headers(dashboard: Dashboard, dash_app: App) -> None:
    from dashboard_app import send_mail

    job_id = send_mail.enqueue(to="a@example.com")
    client = Client(dashboard.url)
    for path in ("/", "/live/overview", "/jobs", f"/jobs/{job_id}", "/queues", "/cron",
                 "/workers", "/live/workers", "/enqueue"):
        req = urllib.request.Request(dashboard.url + path)
        with client.opener.open(req, timeout=30) as response:
            assert response.status == 200, path
            csp = response.headers["Content-Security-Policy"]
            assert "script-src 'self'" in csp and "unsafe-inline" not in csp
            assert response.headers["X-Frame-Options"] == "DENY"
            body = response.read().decode()
        assert "<script>" not in body  # no inline script anywhere
    _, page = client.get(f"/jobs/{job_id}")
    assert "a@example.com" in page and "send_mail" in page
    _status, page = client.get("/cron")
    assert "nightly-report" in page and "0 3 * * *" in page


def test_user_supplied_text_is_escaped(dashboard: Dashboard, dash_app: App) -> None:
    from dashboard_app import send_mail

    evil = "<script>alert(1)</script>"
    job_id = send_mail.configure(queue="q<b>x</b>").enqueue(to=evil, note='"><img src=x>')
    discarded_jobs(dash_app, "mail", 1, error=f"ValueError: {evil}")
    client = Client(dashboard.url)
    query(dash_app.dsn, "UPDATE {schema}.jobs SET progress = %s WHERE id = %s",
          (json.dumps({"step": evil, "done": 3}), job_id), dash_app.schema)
    for path in (f"/jobs/{job_id}", "/jobs", "/", "/queues", "/jobs?state=discarded"):
        status, page = client.get(path)
        assert status == 200
        assert evil not in page and "<img src=x>" not in page and "<b>x</b>" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page or "&lt;b&gt;" in page, path
    assert 'id="job-progress"' in client.get(f"/jobs/{job_id}")[1]  # the progress, escaped


def test_bad_filter_names_the_field(dashboard: Dashboard) -> None:
    client = Client(dashboard.url)
    for query_string, field in (("id=abc", "id"), ("state=lost", "state"),
                                ("since=yesterday", "since"), ("queue=" + "q" * 64, "queue"),
                                ("before=-1", "before")):
        status, page = client.get("/jobs?" + query_string)
        assert status == 400, query_string
        assert f"{field}:" in html.unescape(page), query_string
    assert client.get("/jobs/123456789")[0] == 404
    assert client.get("/jobs/99999999999999999999999")[0] == 404


def test_keyset_pages_cover_every_job_once(dashboard: Dashboard, dash_app: App) -> None:
    from dashboard_app import send_mail

    ids = dash_app.enqueue_many([send_mail.job(to=f"u{i}") for i in range(120)])
    client = Client(dashboard.url)
    seen: list[int] = []
    path = "/jobs?queue=mail"
    while True:
        status, page = client.get(path)
        assert status == 200
        seen += [int(i) for i in re.findall(r'<tr data-id="(\d+)"', page)]
        older = re.search(r'id="older" href="[^"?]*\?([^"]+)"', page)
        if not older:
            break
        path = "/jobs?" + html.unescape(older.group(1))
    assert seen == sorted(ids, reverse=True)
    # and back: the newer link of the last page shows the page before it
    newer = re.search(r'id="newer" href="[^"?]*\?([^"]+)"', page)
    assert newer
    status, page = client.get("/jobs?" + html.unescape(newer.group(1)))
    assert [int(i) for i in re.findall(r'<tr data-id="(\d+)"', page)] == seen[50:100]


def test_filters(dashboard: Dashboard, dash_app: App) -> None:
    from dashboard_app import send_mail

    keyed = send_mail.configure(idempotency_key="welcome-7").enqueue(to="x")
    a = discarded_jobs(dash_app, "mail", 2, error="ValueError: mailbox full")
    b = discarded_jobs(dash_app, "sms", 2, error="TimeoutError: gateway")
    client = Client(dashboard.url)

    def listed(query_string: str) -> set[int]:
        status, page = client.get("/jobs?" + query_string)
        assert status == 200, page[:500]
        return {int(i) for i in re.findall(r'<tr data-id="(\d+)"', page)}

    assert listed("state=discarded") == {*a, *b}
    assert listed("state=discarded&queue=sms") == set(b)
    assert listed("error=MAILBOX") == set(a)
    assert listed("key=welcome-7") == {keyed}
    assert listed(f"id={a[0]}") == {a[0]}
    assert listed("task=dashboard_app.bounce&queue=mail") == set(a)
    assert listed("state=discarded&time=finished&since=2000-01-01T00:00") == {*a, *b}
    assert listed("state=discarded&time=finished&until=2000-01-01T00:00") == set()
    # a row whose errors are not as skipjack writes them breaks neither its page nor a search
    query(dash_app.dsn, "UPDATE {schema}.jobs SET errors = '5' WHERE id = %s", (keyed,),
          schema=dash_app.schema)
    assert listed("error=MAILBOX") == set(a)
    assert client.get(f"/jobs/{keyed}")[0] == 200


# --- actions -------------------------------------------------------------------------------


def test_retry_a_selection_says_what_it_did(dashboard: Dashboard, dash_app: App) -> None:
    from dashboard_app import send_mail

    dead = discarded_jobs(dash_app, "mail", 3)
    alive = send_mail.enqueue(to="x")
    client = Client(dashboard.url)
    client.get("/jobs?state=discarded")
    status, page = client.post("/jobs/action", [("action", "retry"), ("job", str(dead[0])),
                                                ("job", str(dead[1])), ("job", str(alive)),
                                                ("job", "999999")])
    assert status == 200
    assert message(page) == ("2 jobs retried; 2 left alone: 1 not discarded (available), "
                             "1 no such job.") or message(page) == (
        "2 jobs retried; 2 left alone: 1 no such job, 1 not discarded (available).")
    assert [job_state(dash_app, i) for i in dead] == ["available", "available", "discarded"]


def test_the_id_filter_is_no_selection(dashboard: Dashboard, dash_app: App) -> None:
    from dashboard_app import send_mail

    waiting = send_mail.enqueue(to="x")
    client = Client(dashboard.url)
    client.get(f"/jobs?id={waiting}&state=succeeded")  # lists nothing
    status, page = client.post("/jobs/action", {"action": "cancel", "id": str(waiting),
                                                "state": "succeeded"})
    assert status == 400 and "no job selected" in message(page)
    assert job_state(dash_app, waiting) == "available"


def test_retry_everything_matching_a_filter(dashboard: Dashboard, dash_app: App) -> None:
    mail = discarded_jobs(dash_app, "mail", 3)
    sms = discarded_jobs(dash_app, "sms", 2)
    client = Client(dashboard.url)
    client.get("/jobs?state=discarded&queue=mail")
    fields = {"scope": "matching", "action": "retry", "state": "discarded", "queue": "mail"}
    status, page = client.post("/jobs/action", fields)
    assert status == 200 and 'id="confirm"' in page  # asks first; nothing done yet
    assert {job_state(dash_app, i) for i in mail} == {"discarded"}
    status, page = client.post("/jobs/action", {**fields, "confirm": "yes"})
    assert message(page) == "3 jobs retried."
    status, page = client.post("/jobs/action", {**fields, "state": "available",
                                                "confirm": "yes"})
    assert message(page).startswith("nothing to do: retry applies to discarded jobs")
    assert {job_state(dash_app, i) for i in mail} == {"available"}
    assert {job_state(dash_app, i) for i in sms} == {"discarded"}


def test_cancel_and_discard(dashboard: Dashboard, dash_app: App) -> None:
    from dashboard_app import send_mail

    waiting = dash_app.enqueue_many([send_mail.job(to=f"u{i}") for i in range(3)])
    dead = discarded_jobs(dash_app, "mail", 1)
    client = Client(dashboard.url)
    _, page = client.post("/jobs/action", [("action", "discard"),
                                                ("job", str(waiting[0])), ("job", str(dead[0]))])
    assert message(page) == "1 job discarded; 1 left alone: 1 not waiting (discarded)."
    _status, page = client.post("/jobs/action", [("action", "cancel"),
                                                ("job", str(waiting[1])), ("job", str(dead[0]))])
    assert message(page) == "1 job cancelled; 1 left alone: 1 already finished (discarded)."
    assert [job_state(dash_app, i) for i in waiting] == ["discarded", "cancelled", "available"]


def test_post_without_csrf_token_is_refused(dashboard: Dashboard, dash_app: App) -> None:
    dead = discarded_jobs(dash_app, "mail", 1)
    client = Client(dashboard.url)
    client.get("/")
    fields = {"action": "retry", "job": str(dead[0])}
    assert client.post("/jobs/action", fields, token=False)[0] == 403
    assert client.request("/jobs/action", {**fields, "csrf_token": "0" * 64})[0] == 403
    # the right token from another site's page is refused by the browser's headers
    assert client.request("/jobs/action", {**fields, "csrf_token": client.token},
                          headers={"Sec-Fetch-Site": "cross-site"})[0] == 403
    assert client.request("/jobs/action", {**fields, "csrf_token": client.token},
                          headers={"Origin": "http://evil.example"})[0] == 403
    # another browser's token (another cookie) is refused
    other = Client(dashboard.url)
    other.get("/")
    assert client.request("/jobs/action", {**fields, "csrf_token": other.token})[0] == 403
    for path, form in (("/queues/action", {"queue": "mail", "action": "pause"}),
                       ("/enqueue", {"task": "dashboard_app.send_mail", "args": "{}"}),
                       ("/cron/run", {"name": "nightly-report"})):
        assert client.post(path, form, token=False)[0] == 403, path
    assert job_state(dash_app, dead[0]) == "discarded"
    assert dash_app.queues() == []
    assert query(dash_app.dsn, "SELECT count(*) FROM {schema}.jobs", schema=dash_app.schema) \
        == [(1,)]
    # with the token it works
    _status, page = client.post("/jobs/action", fields)
    assert message(page) == "1 job retried."


def test_read_only_refuses_every_action(server: Server, schema: str, dash_app: App) -> None:
    dead = discarded_jobs(dash_app, "mail", 1)
    d = Dashboard(server, schema, "--read-only")
    try:
        d.wait_ready()
        client = Client(d.url)
        status, page = client.get("/jobs?state=discarded")
        assert status == 200 and 'id="read-only"' in page
        assert "Retry" not in page and 'name="action"' not in page
        assert "Pause" not in client.get("/queues")[1]
        assert "Run now" not in client.get("/cron")[1]
        for path, form in (("/jobs/action", {"action": "retry", "job": str(dead[0])}),
                           ("/queues/action", {"queue": "mail", "action": "pause"}),
                           ("/enqueue", {"task": "dashboard_app.send_mail",
                                         "args": '{"to": "x"}'}),
                           ("/cron/run", {"name": "nightly-report"})):
            status, page = client.post(path, form)
            assert status == 403 and "read-only" in page, path
    finally:
        d.stop()
    assert job_state(dash_app, dead[0]) == "discarded"
    assert dash_app.queues() == []
    assert query(dash_app.dsn, "SELECT count(*) FROM {schema}.jobs", schema=dash_app.schema) \
        == [(1,)]


def test_queue_controls(dashboard: Dashboard, dash_app: App) -> None:
    from dashboard_app import send_mail

    send_mail.enqueue(to="x")
    client = Client(dashboard.url)
    client.get("/queues")
    status, page = client.post("/queues/action", {"queue": "mail", "action": "pause"})
    assert "paused" in message(page)
    assert [(q["name"], q["paused"]) for q in dash_app.queues()] == [("mail", True)]
    assert "Resume" in client.get("/queues")[1]
    status, page = client.post("/queues/action", {"queue": "mail", "action": "limits",
                                                  "concurrency": "3", "rate": "10",
                                                  "period": "60"})
    assert status == 200
    (row,) = dash_app.queues()
    assert (row["concurrency_limit"], row["rate_limit"], row["rate_period"]) == (3, 10, 60.0)
    status, page = client.post("/queues/action", {"queue": "mail", "action": "limits",
                                                  "concurrency": "0"})
    assert status == 400 and "concurrency" in message(page)
    status, page = client.post("/queues/action", {"queue": "mail", "action": "limits",
                                                  "rate": "5"})
    assert status == 400 and "rate" in message(page)
    (row,) = dash_app.queues()  # unchanged by the refused forms
    assert (row["concurrency_limit"], row["rate_limit"]) == (3, 10)
    status, page = client.post("/queues/action", {"queue": "mail", "action": "resume"})
    assert [(q["name"], q["paused"]) for q in dash_app.queues()] == [("mail", False)]


def test_enqueue_by_hand_is_validated(dashboard: Dashboard, dash_app: App) -> None:
    client = Client(dashboard.url)
    client.get("/enqueue")
    for args, field in (("{not json", "args"), ("[1, 2]", "args"), ('{"nobody": 1}', "args"),
                        ("{}", "args")):
        status, page = client.post("/enqueue", {"task": "dashboard_app.send_mail",
                                                "args": args})
        assert status == 400, args
        assert f"{field}:" in message(page), (args, message(page))
    mail = "dashboard_app.send_mail"
    for task, args, field in (("a b", "{}", "task"), ("t" * 300, "{}", "task"),
                              ("send_mail", '{"to": "x"}', "task"),
                              (mail, "[" * 100_000, "args"), (mail, '{"to": "\\u0000"}', "args")):
        status, page = client.post("/enqueue", {"task": task, "args": args})
        assert status == 400 and f"{field}:" in message(page), (task[:10], args[:10])
    status, page = client.post("/enqueue", {"task": "dashboard_app.send_mail",
                                            "args": '{"to": "x"}', "priority": "500"})
    assert status == 400 and "priority" in message(page)
    assert query(dash_app.dsn, "SELECT count(*) FROM {schema}.jobs",
                 schema=dash_app.schema) == [(0,)]
    status, page = client.post("/enqueue", {"task": "dashboard_app.send_mail",
                                            "args": '{"to": "hand@example.com"}',
                                            "queue": "urgent", "priority": "5"})
    found = re.search(r"enqueued job (\d+)", message(page))
    assert found
    job = dash_app.get_job(int(found.group(1)))
    assert job is not None
    assert (job["task"], job["queue"], job["priority"], job["args"]) == (
        "dashboard_app.send_mail", "urgent", 5, {"to": "hand@example.com"})


def test_cron_run_now(dashboard: Dashboard, dash_app: App) -> None:
    client = Client(dashboard.url)
    client.get("/cron")
    status, page = client.post("/cron/run", {"name": "nightly-report"})
    found = re.search(r"enqueued job (\d+)", message(page))
    assert found
    job = dash_app.get_job(int(found.group(1)))
    assert job is not None and job["task"] == "dashboard_app.nightly_report"
    status, page = client.post("/cron/run", {"name": "no-such"})
    assert status == 404


# --- throughput rollup ---------------------------------------------------------------------


def test_rollup_counts_each_finished_job_once(dash_app: App) -> None:
    from dashboard_app import send_mail

    ids = dash_app.enqueue_many([send_mail.job(to=f"u{i}") for i in range(6)])
    with dash_app.connect() as conn:
        conn.execute(psycopg.sql.SQL(
            "UPDATE {}.jobs SET state = CASE WHEN id = ANY(%s) THEN 'discarded' "
            "ELSE 'succeeded' END, attempted_at = run_at + interval '2 seconds', "
            "finished_at = now() - interval '2 minutes'").format(
                psycopg.sql.Identifier(dash_app.schema)), (ids[:2],))
    locker = dash_app.connect(autocommit=False)
    try:  # another rollup holds the watermark: this one counts nothing and returns at once
        locker.execute(psycopg.sql.SQL("SELECT * FROM {}.throughput_watermark FOR UPDATE")
                       .format(psycopg.sql.Identifier(dash_app.schema)))
        assert dash_app.rollup() == 0
    finally:
        locker.rollback()
        locker.close()
    assert dash_app.rollup() == 2
    assert dash_app.rollup() == 0  # nothing counted twice
    rows = dash_app.throughput(timedelta(hours=1), timedelta(hours=1))
    assert {r["state"]: (r["jobs"], r["started"]) for r in rows} == {
        "succeeded": (4, 4), "discarded": (2, 2)}
    assert all(abs(r["latency_max"] - 2.0) < 1e-6 for r in rows)


# --- serving -------------------------------------------------------------------------------


def test_beyond_loopback_needs_credentials(server: Server, schema: str, dash_app: App) -> None:
    d = Dashboard(server, schema, host="0.0.0.0")
    out = d.output(kill=False)
    assert d.proc.returncode == 2 and "credentials" in out and "SKIPJACK_DASHBOARD_TOKEN" in out
    d = Dashboard(server, schema, host="0.0.0.0", env={"SKIPJACK_DASHBOARD_USER": "ops"})
    out = d.output(kill=False)
    assert d.proc.returncode != 0 and "SKIPJACK_DASHBOARD_PASSWORD" in out
    d = Dashboard(server, schema, host="0.0.0.0",
                  env={"SKIPJACK_DASHBOARD_USER": "ops",
                       "SKIPJACK_DASHBOARD_PASSWORD": "s3cret-passw0rd",
                       "SKIPJACK_DASHBOARD_TOKEN": "tok-123456789"})
    d.url = f"http://127.0.0.1:{d.port}"
    try:
        d.wait_ready()
        assert http_get(d.url + "/")[0] == 401
        basic = base64.b64encode(b"ops:s3cret-passw0rd").decode()
        assert Client(d.url, {"Authorization": f"Basic {basic}"}).get("/")[0] == 200
        wrong = base64.b64encode(b"ops:guess").decode()
        assert Client(d.url, {"Authorization": f"Basic {wrong}"}).get("/")[0] == 401
        assert Client(d.url, {"Authorization": "Bearer tok-123456789"}).get("/")[0] == 200
        assert Client(d.url, {"Authorization": "Bearer tok-12345678"}).get("/")[0] == 401
        token_as_password = base64.b64encode(b"anyone:tok-123456789").decode()
        assert Client(d.url, {"Authorization": f"Basic {token_as_password}"}).get("/")[0] == 200
    finally:
        d.stop()


def test_loopback_dashboard_answers_only_its_own_host_name(dashboard: Dashboard) -> None:
    assert Client(dashboard.url).get("/")[0] == 200
    assert Client(dashboard.url, {"Host": f"localhost:{dashboard.port}"}).get("/")[0] == 200
    # a page of another site reaching 127.0.0.1 through a DNS name it controls
    assert Client(dashboard.url, {"Host": f"evil.example:{dashboard.port}"}).get("/")[0] == 421


def test_port_in_use(server: Server, schema: str, dashboard: Dashboard) -> None:
    cmd = [sys.executable, "-m", "skipjack", "--dsn", server.dsn, "--schema", schema,
           "dashboard", "--port", str(dashboard.port)]
    done = subprocess.run(cmd, cwd=TESTS, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "error: cannot listen" in done.stderr


def test_mounted_under_a_path(dash_app: App) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from skipjack.dashboard import create_app

    host_app = Starlette(routes=[Mount("/ops/queue", create_app(dash_app))])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(host_app, port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_get(base + "/ops/queue/jobs", timeout=2)[0] == 200)
        client = Client(base)
        _, page = client.get("/ops/queue/jobs")
        assert f'href="{base}/ops/queue/queues"' in page
        assert f'action="{base}/ops/queue/jobs/action"' in page
        assert http_get(base + "/ops/queue/static/htmx.min.js")[0] == 200
        dead = discarded_jobs(dash_app, "mail", 1)
        _status, page = client.post("/ops/queue/jobs/action",
                                   {"action": "retry", "job": str(dead[0])})
        assert message(page) == "1 job retried."
    finally:
        server.should_exit = True
        thread.join(30)
