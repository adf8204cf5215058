"""The dashboard in headless Chromium (Debian's ``chromium``, driven by Playwright): load the
overview, filter the dead letter, open a job, retry a selection, pause a queue, look at the
workers and cron pages, and see each effect in the database and on the page. A screenshot of
each page goes to tests/screenshots/ (ignored by git; docs/dashboard.md shows them)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from skipjack import App
from test_dashboard import Dashboard, dash_app, discarded_jobs, job_state

from support import Server, WorkerProcess, wait_until

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = Path(__file__).parent / "screenshots"

__all__ = ["dash_app"]  # the fixture, imported from test_dashboard


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM,
                                              args=["--no-sandbox"])
        yield chromium
        chromium.close()


def test_operator_walkthrough(server: Server, schema: str, dash_app: App, browser: Any,
                              tmp_path: Path) -> None:
    from dashboard_app import linger, send_mail

    mail = discarded_jobs(dash_app, "mail", 3, error="ValueError: mailbox full")
    sms = discarded_jobs(dash_app, "sms", 2, error="TimeoutError: gateway")
    done = dash_app.enqueue_many([send_mail.job(to=f"u{i}") for i in range(40)])
    evil = "<script>alert(1)</script>"
    xss = send_mail.enqueue(to=evil, note='"><img src=x onerror=alert(2)>')
    with dash_app.connect() as conn:
        conn.execute(psycopg.sql.SQL(
            "UPDATE {}.jobs SET state = 'succeeded', attempted_at = run_at + interval '40 ms', "
            "finished_at = now() - make_interval(mins => (id %% 50)::int + 1) "
            "WHERE id = ANY(%s)").format(psycopg.sql.Identifier(dash_app.schema)), (done,))
    dash_app.rollup()
    linger.enqueue(seconds=120)  # something for the workers page to show running
    SHOTS.mkdir(exist_ok=True)
    shots = f"{server.kind}-"

    with WorkerProcess(server.dsn, schema, ["slow"], app="dashboard_app:app",
                       log=tmp_path / "worker.log") as worker:
        d = Dashboard(server, schema)
        try:
            d.wait_ready()
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            dialogs: list[str] = []
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            console: list[str] = []
            page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)

            # overview: queues, charts, and the live part refreshing itself (htmx under CSP)
            page.goto(d.url + "/")
            assert page.locator('#queues-table tr[data-queue="mail"]').count() == 1
            assert page.locator('#queues-table tr[data-queue="sms"]').count() == 1
            assert page.locator("svg rect.bar-succeeded").count() > 0
            with page.expect_request(lambda r: r.url.endswith("/live/overview"),
                                     timeout=20_000):
                pass
            page.screenshot(path=SHOTS / f"{shots}overview.png", full_page=True)

            # filter the dead letter of one queue
            page.click("nav >> text=Jobs")
            page.select_option('select[name="state"]', "discarded")
            page.fill('input[name="queue"]', "mail")
            with page.expect_navigation():  # wait for the filtered page, not just the click
                page.click('#filters button[type="submit"]')
            rows = page.locator("#jobs-table tbody tr[data-id]")
            assert sorted(int(r.get_attribute("data-id")) for r in rows.all()) == mail
            assert page.locator("#jobs-table .state-discarded").count() == 3
            page.screenshot(path=SHOTS / f"{shots}jobs.png", full_page=True)

            # open a job: arguments, the attempt's error and traceback, the timeline
            page.click(f'#jobs-table a:text-is("{mail[0]}")')
            assert page.locator("#job-task").inner_text() == "dashboard_app.bounce"
            assert "mailbox full" in page.locator("details.attempt-error pre").inner_text()
            assert page.locator("#timeline tbody tr").count() >= 2
            page.screenshot(path=SHOTS / f"{shots}job.png", full_page=True)
            page.go_back()

            # retry a selection of two
            page.check(f'input.pick[value="{mail[0]}"]')
            page.check(f'input.pick[value="{mail[1]}"]')
            page.click('#jobs-form button[value="retry"]')
            assert page.locator("#message").inner_text() == "2 jobs retried."
            assert [job_state(dash_app, i) for i in mail] == ["available", "available",
                                                               "discarded"]
            assert {job_state(dash_app, i) for i in sms} == {"discarded"}
            with page.expect_navigation():  # wait for the page, not just the click
                page.click("#back")
            assert page.locator("#jobs-table tbody tr[data-id]").count() == 1

            # select all on the page (the dashboard's own script) and retry everything left
            page.goto(d.url + "/jobs?state=discarded")
            page.check("#select-all")
            assert page.locator("input.pick:checked").count() == 3
            page.click('#jobs-form button[value="retry"]')
            assert page.locator("#message").inner_text() == "3 jobs retried."

            # pause a queue
            page.click("nav >> text=Queues")
            page.click('tr[data-queue="mail"] button[value="pause"]')
            assert "paused" in page.locator("#message").inner_text()
            assert [(q["name"], q["paused"]) for q in dash_app.queues()] == [("mail", True)]
            with page.expect_navigation():  # wait for the page, not just the click
                page.click("#back")
            assert page.locator('tr[data-queue="mail"] .badge.paused').count() == 1
            page.screenshot(path=SHOTS / f"{shots}queues.png", full_page=True)

            # the live worker and what it runs
            wait_until(lambda: dash_app.workers() and dash_app.running_jobs(),
                       what="the worker running linger")
            with page.expect_navigation():
                page.click("nav >> text=Workers")
            assert page.locator("section.worker").count() == 1
            assert "dashboard_app.linger" in page.locator("section.worker").inner_text()
            page.screenshot(path=SHOTS / f"{shots}workers.png", full_page=True)

            # cron: the schedule, and running it now
            page.click("nav >> text=Cron")
            assert "nightly-report" in page.locator("#cron-table").inner_text()
            page.screenshot(path=SHOTS / f"{shots}cron.png", full_page=True)
            page.click('tr[data-cron="nightly-report"] button')
            assert "enqueued job" in page.locator("#message").inner_text()

            page.click("nav >> text=Enqueue")
            page.fill('input[name="task"]', "dashboard_app.send_mail")
            page.fill('textarea[name="args"]', json.dumps({"to": "ops@example.com"}))
            page.click('#enqueue-form button[type="submit"]')
            assert "enqueued job" in page.locator("#message").inner_text()
            with page.expect_navigation():  # wait for the page, not just the click
                page.click("#back")
            assert json.loads(page.locator("#job-args").inner_text()) == {
                "to": "ops@example.com"}

            # what users supplied is text, never markup or script
            page.goto(f"{d.url}/jobs/{xss}")
            assert evil in page.locator("#job-args").inner_text()
            assert page.locator("#job-args img").count() == 0
            page.goto(d.url + "/jobs?queue=mail")
            assert dialogs == []
            assert not [m for m in console if "Content Security Policy" in m], console
        finally:
            d.stop()
        worker.kill()
