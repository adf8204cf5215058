"""The dashboard's pure parts: form parsing, job filters, search statements, chart geometry."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

pytest.importorskip("starlette")

from skipjack.dashboard import charts, forms, is_loopback
from skipjack.dashboard.security import Credentials, host_allowed
from skipjack.errors import ConfigError, ValidationError
from skipjack.search import JobFilter
from skipjack.sql.admin import job_search


@pytest.mark.parametrize(("values", "field"), [
    ({"state": "lost"}, "state"), ({"id": "1e3"}, "id"), ({"id": "-5"}, "id"),
    ({"since": "soon"}, "since"), ({"time": "started", "since": "2026-01-01"}, "time"),
    ({"queue": "x" * 64}, "queue"), ({"error": "e" * 201}, "error"),
    ({"error": "a\x00b"}, "error"), ({"key": "k" * 256}, "idempotency_key"),
])
def test_bad_filter_fields_are_named(values: dict[str, str], field: str) -> None:
    with pytest.raises(ValidationError) as raised:
        forms.job_filter(values)
    assert raised.value.field == field


def test_filter_round_trip_and_defaults() -> None:
    where = forms.job_filter({"state": "discarded", "queue": " mail ", "since": "2026-12-01T09:00",
                              "id": ""})
    assert where == JobFilter(state="discarded", queue="mail", time="finished",
                              since=datetime(2026, 12, 1, 9, 0, tzinfo=UTC))
    assert forms.job_filter(forms.filter_fields(where)) == where
    assert forms.job_filter({}).time == "created"


def test_search_statements_use_only_constant_conditions() -> None:
    text = job_search(("queue", "state", "before"), "finished")
    assert "state = %(state)s AND queue = %(queue)s AND id < %(before)s" in text
    assert text.endswith("ORDER BY id DESC LIMIT %(limit)s")
    with pytest.raises(KeyError):
        job_search(("queue; DROP TABLE jobs",), "created")
    with pytest.raises(KeyError):
        job_search(("since",), "run_at")


def test_json_object_args() -> None:
    assert forms.json_object(None, "args") == {}
    assert forms.json_object('{"a": [1]}', "args") == {"a": [1]}
    for bad in ("[1]", "{", '"text"'):
        with pytest.raises(ValidationError):
            forms.json_object(bad, "args")


def test_buckets_align_with_the_database() -> None:
    now = datetime(2026, 12, 1, 12, 34, 56, tzinfo=UTC)
    starts = charts.buckets(now, timedelta(hours=1), timedelta(minutes=15))
    assert starts[0] == datetime(2026, 12, 1, 11, 30, tzinfo=UTC)
    assert starts[-1] == datetime(2026, 12, 1, 12, 30, tzinfo=UTC)
    rows = [{"at": starts[-1], "state": "succeeded", "jobs": 30, "started": 30,
             "latency_sum": 3.0, "latency_max": 0.5}]
    chart = charts.throughput_chart("t", rows, now=now, span=timedelta(hours=1),
                                    bucket=timedelta(minutes=15))
    assert not chart.empty and len(chart.rects) == 1
    assert chart.rects[0].title.endswith("succeeded: 2/min")
    latency = charts.latency_chart("l", rows, now=now, span=timedelta(hours=1),
                                   bucket=timedelta(minutes=15))
    assert [line.name for line in latency.lines] == ["max", "mean"]
    assert charts.throughput_chart("t", [], now=now, span=timedelta(hours=1),
                                   bucket=timedelta(minutes=1)).empty


def test_credentials() -> None:
    assert Credentials.from_env({}) is None
    with pytest.raises(ConfigError):
        Credentials.from_env({"SKIPJACK_DASHBOARD_USER": "ops"})
    for short in ("t0k", " " * 20, " padded-token-value "):
        with pytest.raises(ConfigError):
            Credentials.from_env({"SKIPJACK_DASHBOARD_TOKEN": short})
    creds = Credentials.from_env({"SKIPJACK_DASHBOARD_TOKEN": "t0k-t0k-t0k-t0k"})
    assert creds is not None
    assert creds.allow("Bearer t0k-t0k-t0k-t0k") and not creds.allow("Bearer t0k-t0k-t0k")
    assert not creds.allow("") and not creds.allow("Basic !!!")
    assert not creds.allow("Digest t0k-t0k-t0k-t0k")
    assert host_allowed("127.0.0.1:8700", ("127.0.0.1",))
    assert host_allowed("[::1]:8700", ("::1",))
    assert not host_allowed("evil.example:8700", ("127.0.0.1",))
    assert not host_allowed("[bad", ("127.0.0.1",))
    assert is_loopback("127.0.0.2") and is_loopback("::1") and not is_loopback("0.0.0.0")
