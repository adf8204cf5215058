"""Tasks of the dashboard tests (``dashboard_app:app``): one that succeeds, one that always
fails, one that runs until its time is up, and a cron schedule."""

from __future__ import annotations

import os
import time

from skipjack import App, Backoff

app = App(schema=os.environ.get("SKIPJACK_SCHEMA", "skipjack"))


@app.task(queue="mail")
def send_mail(to: str, note: str = "") -> dict[str, str]:
    return {"sent_to": to}


@app.task(queue="mail", max_attempts=2, backoff=Backoff(base=0.01, cap=0.01, jitter=False))
def bounce(to: str) -> None:
    raise ValueError(f"mailbox {to} does not exist")


@app.task(queue="slow")
def linger(seconds: float) -> None:
    time.sleep(seconds)


@app.cron("0 3 * * *", name="nightly-report")
@app.task(queue="reports")
def nightly_report(kind: str = "daily") -> str:
    return kind
