"""skipjack worker --reload with real processes: an edit of the tasks module restarts the
worker, whose next job runs the new code; SIGTERM stops both processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from skipjack import App
from skipjack.reload import without_reload

from support import query, wait_until

pytest.importorskip("watchfiles")

TASKS = '''
from skipjack import App

app = App()


@app.task(name="version")
def version() -> str:
    return {answer!r}
'''


def test_without_reload_drops_its_options() -> None:
    assert without_reload(["worker", "a:b", "--reload", "--reload-dir", "src", "-c", "2",
                           "--reload-dir=lib"]) == ["worker", "a:b", "-c", "2"]


def test_an_edit_restarts_the_worker_with_the_new_code(app: App, tmp_path: Path) -> None:
    module = tmp_path / "devtasks.py"
    module.write_text(TASKS.format(answer="first"))
    version = app.task(name="version")(lambda: None)
    log = open(tmp_path / "reload.log", "wb")
    watcher = subprocess.Popen(
        [sys.executable, "-m", "skipjack", "--dsn", app.dsn, "--schema", app.schema, "worker",
         "devtasks:app", "--reload", "--grace", "2s", "--poll-interval", "500ms"],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "SKIPJACK_SCHEMA": app.schema})

    def worker_pid() -> int | None:
        rows = query(app.dsn, "SELECT pid FROM {schema}.workers", schema=app.schema)
        return rows[0][0] if len(rows) == 1 else None

    try:
        assert version.enqueue().result(timeout=60) == "first"
        first = wait_until(worker_pid, timeout=30, what="the worker's registry row")
        assert first != watcher.pid  # the worker runs in a child of the watcher
        module.write_text(TASKS.format(answer="second"))
        second = wait_until(lambda: (pid := worker_pid()) not in (None, first) and pid,
                            timeout=60, what="a new worker process after the edit")
        assert not psutil.pid_exists(first) or psutil.Process(first).status() == "zombie"
        assert version.enqueue().result(timeout=60) == "second"
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(60) == 0
        assert not psutil.pid_exists(second) or psutil.Process(second).status() == "zombie"
        # the worker stopped cleanly: it removed its own registry row
        assert worker_pid() is None
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait(30)
        log.close()
    text = (tmp_path / "reload.log").read_text()
    assert "changed: devtasks.py; restarting the worker" in text, text
