"""The embedded server's lifecycle with real processes: it stops when its last user ends,
even a user that was SIGKILLed (the watcher), and `skipjack embedded status|stop`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import wait_until

USER = ("from skipjack import embedded; embedded.dsn(); print('up', flush=True); "
        "import time; time.sleep(600)")


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "pg"


def env(data_dir: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("SKIPJACK_DATABASE_URL", "DATABASE_URL")}
    return {**clean, "SKIPJACK_EMBEDDED_DIR": str(data_dir)}


def status(data_dir: Path) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "skipjack", "embedded", "status"],
                          env=env(data_dir), capture_output=True, text=True, timeout=120)
    state: dict[str, object] = json.loads(done.stdout)
    assert done.returncode == (0 if state["running"] else 1)
    return state


def user(data_dir: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", USER], env=env(data_dir),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def test_a_killed_last_user_still_stops_the_server(data_dir: Path) -> None:
    assert status(data_dir)["running"] is False
    first, second = user(data_dir), user(data_dir)
    try:
        state = status(data_dir)
        assert state["running"] is True and set(state["users"]) == {first.pid, second.pid}
        first.send_signal(signal.SIGKILL)  # no clean-up of its own
        first.wait(30)
        wait_until(lambda: status(data_dir)["users"] == [second.pid], timeout=60,
                   what="the dead user forgotten")
        assert status(data_dir)["running"] is True  # the other one still uses it
        second.send_signal(signal.SIGKILL)  # not reaped yet: a zombie is no user either
        wait_until(lambda: status(data_dir)["running"] is False, timeout=60,
                   what="the watcher stopped the server")
        second.wait(30)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def test_embedded_stop_stops_it_at_once(data_dir: Path) -> None:
    proc = user(data_dir)
    try:
        assert status(data_dir)["running"] is True
        done = subprocess.run([sys.executable, "-m", "skipjack", "embedded", "stop"],
                              env=env(data_dir), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "stopped the embedded server" in done.stdout
        assert status(data_dir)["running"] is False
        again = subprocess.run([sys.executable, "-m", "skipjack", "embedded", "stop"],
                               env=env(data_dir), capture_output=True, text=True, timeout=120)
        assert "is not running" in again.stdout
    finally:
        proc.kill()
        proc.wait(30)
