"""An app (``flaky_app:app``) whose import fails while the file named by
$FLAKY_APP_MARKER exists: a worker process of tests/test_supervisor.py that is started
again then fails to start. The schema and DSN come from SKIPJACK_SCHEMA and
SKIPJACK_DATABASE_URL."""

from __future__ import annotations

import os

from skipjack import App

if os.path.exists(os.environ["FLAKY_APP_MARKER"]):
    raise RuntimeError("flaky_app: the marker file exists")

app = App(schema=os.environ.get("SKIPJACK_SCHEMA", "skipjack"))


@app.task(name="noop")
def noop() -> None:
    """Does nothing."""
