"""A full NOTIFY queue must not stop the queue.

A session of another application LISTENs on skipjack's channel and stays in a transaction,
so PostgreSQL's notification queue (here shrunk to 64 pages, 512 kB) fills up. Wake-ups are
then skipped, never refused at commit: enqueues, the stager, the rescuer and the dead
letter's re-enqueue keep working, workers poll, and wake-ups resume by themselves once the
session ends.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from skipjack import App
from skipjack.channels import channel_name
from skipjack.runtime.maintenance import NotifyQueueWatch, rescue
from skipjack.runtime.worker import Worker

from support import Server, query, wait_until

PAGES = 64  # about 10,000 notifications of skipjack's size


@pytest.fixture
def small_notify_queue(server: Server) -> Iterator[None]:
    """The server restarted with a 64-page notification queue, and with the default again
    afterwards."""
    with server.connect() as conn:
        version = conn.info.server_version
    if version < 170000:
        pytest.skip(f"max_notify_queue_pages needs PostgreSQL 17 or newer (server {version})")
    _set_queue_pages(server, PAGES)
    try:
        yield
    finally:
        _set_queue_pages(server, None)


def _set_queue_pages(server: Server, pages: int | None) -> None:
    with server.connect() as conn:
        if pages is None:
            conn.execute("ALTER SYSTEM RESET max_notify_queue_pages")
        else:
            conn.execute(f"ALTER SYSTEM SET max_notify_queue_pages = {int(pages)}")
    server.restart()
    with server.connect() as conn:
        row = conn.execute("SHOW max_notify_queue_pages").fetchone()
    assert row is not None and (pages is None or int(row[0]) == pages)


def _usage(dsn: str) -> float:
    return float(query(dsn, "SELECT pg_notification_queue_usage()")[0][0])


def test_a_full_notify_queue_skips_wakeups_and_nothing_else(
        small_notify_queue: None, app: App, caplog: pytest.LogCaptureFixture) -> None:
    ran: list[int] = []

    @app.task(name="rec")
    def rec(n: int) -> None:
        ran.append(n)

    filler = app.task(name="filler")(lambda: None)
    (limit,) = query(app.dsn, "SELECT {schema}.notify_queue_limit()", schema=app.schema)[0]

    # another application's session: it LISTENs on the channel, then idles in a transaction,
    # so it reads no notification and PostgreSQL can free none
    blocker = psycopg.connect(app.dsn, application_name="notify-blocker")
    blocker.execute(f'LISTEN "{channel_name(app.schema)}"')
    blocker.commit()
    blocker.execute("SELECT 1")
    blocker_pid = blocker.info.backend_pid
    try:
        # 15 enqueues of 1,000 jobs, each job in a queue of its own: one notification each,
        # 15,000 in all where about 10,000 fill the queue
        peak = 0.0
        for batch in range(15):
            ids = app.enqueue_many(filler.configure(queue=f"fill-{batch}-{k}").job()
                                   for k in range(1000))
            assert len(ids) == 1000
            peak = max(peak, _usage(app.dsn))
        assert peak >= limit  # wake-ups were being skipped
        # one-job enqueues, a delayed job, a rescue and a re-enqueue of the dead letter, all
        # while the queue is past the limit
        now_ids = [rec.enqueue(n=n) for n in range(5)]
        assert len(set(now_ids)) == 5
        rec.configure(delay=0.5).enqueue(n=100)
        rescued = rec.enqueue(n=101)
        query(app.dsn, "UPDATE {schema}.jobs SET state = 'running', attempt = 1, "
                       "lease_expires_at = now() - interval '1 s' WHERE id = %s",
              [rescued], schema=app.schema)
        with app.connect() as conn:
            assert rescue(conn, app.queries) == [(rescued, "available")]
        dead = rec.enqueue(n=102)
        assert app.discard([dead]) == [dead]
        assert app.retry_discarded([dead]) == [dead]
        assert _usage(app.dsn) >= limit

        # a worker started now (its start-up probe cannot send either) runs them by polling
        worker = Worker(app, ["default"], poll_interval=0.5, stage_interval=0.2, lease=10)
        heard: list[str] = []
        mark_due = worker._producer.mark_due

        def hear(queue: str) -> None:  # what the worker's listener is woken with
            heard.append(queue)
            mark_due(queue)

        worker._producer.mark_due = hear
        thread = threading.Thread(target=lambda: asyncio.run(worker.run_async()))
        with caplog.at_level(logging.INFO, logger="skipjack"):
            thread.start()
            try:
                wait_until(lambda: sorted(ran) == [0, 1, 2, 3, 4, 100, 101, 102], timeout=60,
                           what="every job run while the queue is full")
                warning = wait_until(lambda: _watch_warning(caplog.records), timeout=30,
                                     what="the worker's warning about the notification queue")
                assert "wake-ups are skipped" in warning and "polling, every 0.5s" in warning
                assert f"pid {blocker_pid}" in warning and "'notify-blocker'" in warning
                assert "idle in transaction" in warning

                blocker.rollback()
                blocker.close()
                wait_until(lambda: "wake-ups resumed" in caplog.text, timeout=30,
                           what="the worker saw the queue drain")
                assert _usage(app.dsn) < 0.1
                heard.clear()
                rec.enqueue(n=200)
                wait_until(lambda: 200 in ran, timeout=30, what="the job enqueued afterwards")
                wait_until(lambda: "default" in heard, timeout=30,
                           what="a wake-up for the job enqueued afterwards")
            finally:
                worker.stop()
                thread.join(30)
        assert not thread.is_alive()
    finally:
        blocker.close()
    assert "too many notifications" not in caplog.text  # no statement was refused
    assert "cannot check that notifications reach this worker" in caplog.text
    assert (app.get_job(rescued) or {})["state"] == "succeeded"


def _watch_warning(records: list[logging.LogRecord]) -> str | None:
    for r in records:
        if r.name == "skipjack.maintenance" and r.levelno == logging.WARNING \
                and "notification queue is" in r.getMessage():
            return r.getMessage()
    return None


def test_the_watch_warns_once_a_minute_at_most_and_says_when_it_is_over(
        app: App, caplog: pytest.LogCaptureFixture) -> None:
    watch = NotifyQueueWatch(app.queries, poll_interval=5.0, warn_every=60.0)
    nobody: tuple[Any, ...] = (None,) * 5
    with caplog.at_level(logging.INFO, logger="skipjack.maintenance"):
        for now, usage in ((0.0, 0.1), (5.0, 0.6), (30.0, 0.7), (64.0, 0.7), (70.0, 0.8),
                           (75.0, 0.2), (80.0, 0.1)):
            watch.observe(usage, usage >= 0.5, 0.5, nobody, now)
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in messages] == ["WARNING", "WARNING", "INFO"]
    assert "60% full" in messages[0][1] and "80% full" in messages[1][1]  # 64 s: too soon
    assert "no session idle in a transaction is visible" in messages[0][1]
    assert "20% full: wake-ups resumed" in messages[2][1]
    with app.connect() as conn:  # and the statement it runs answers on this server
        watch(conn)
