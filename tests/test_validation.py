"""Bad input is refused before anything is written; odd values round-trip as documented."""

from __future__ import annotations

import math
import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from skipjack import App, Backoff, ConfigError, ValidationError, Worker
from skipjack.cli import main
from skipjack.jobs import DEFAULT_MAX_ARGS_BYTES, dump_result

from support import Server, query


def _count(app: App) -> int:
    return int(query(app.dsn, "SELECT count(*) FROM {schema}.jobs", schema=app.schema)[0][0])


def _task(app: App) -> Any:
    @app.task(name="t", queue="q")
    def t(**kwargs: Any) -> None:
        pass

    return t


class Custom:
    pass


@pytest.mark.parametrize("value", [
    datetime(2025, 1, 1), datetime(2025, 1, 1, tzinfo=UTC), date(2025, 1, 1), Decimal("1.10"),
    uuid.uuid4(), {1, 2}, b"\xff", Custom(),
])
def test_fc18_non_json_values_are_rejected(app: App, value: object) -> None:
    with pytest.raises(ValidationError, match="args: a value of type .* is not JSON"):
        _task(app).enqueue(x=value)
    assert _count(app) == 0


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_fc18_nan_and_infinity_are_rejected(app: App, value: float) -> None:
    with pytest.raises(ValidationError, match="NaN and Infinity"):
        _task(app).enqueue(x=[1, {"y": value}])
    assert _count(app) == 0


def test_fc18_documented_round_trips(app: App) -> None:
    t = _task(app)
    job_id = t.enqueue(big=2**70, tup=(1, 2), s="\\u0000", uni="€😀")
    (args,) = query(app.dsn, "SELECT args FROM {schema}.jobs WHERE id = %s", [job_id],
                    schema=app.schema)[0]
    assert args == {"big": 2**70, "tup": [1, 2], "s": "\\u0000", "uni": "€😀"}


@pytest.mark.parametrize(("value", "message"), [
    ({1: "a"}, "dict keys must be str, got 1"),
    ([{"ok": {None: 1}}], "dict keys must be str, got None"),
    ({(1, 2): 3}, r"dict keys must be str, got \(1, 2\)"),
    (10**5000, "Exceeds the limit"),
], ids=["int-key", "none-key", "tuple-key", "huge-int"])
def test_fc18_values_json_would_change_are_rejected(app: App, value: object,
                                                    message: str) -> None:
    t = _task(app)
    with pytest.raises(ValidationError, match=message):
        t.enqueue(x=value)
    cyclic: list[object] = []
    cyclic.append(cyclic)
    with pytest.raises(ValidationError, match="reference cycle"):
        t.enqueue(x=cyclic)
    assert _count(app) == 0


@pytest.mark.parametrize("args", [{"s": "a\x00b"}, {"k\x00": 1}, {"l": ["x", {"y": "\x00"}]}])
def test_fc17_nul_in_strings_and_keys_is_rejected(app: App, args: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="NUL"):
        _task(app).enqueue(**args)
    assert _count(app) == 0


def test_fc17_literal_backslash_u0000_text_round_trips(app: App) -> None:
    t = _task(app)
    for text in ["\\u0000", "\\\\u0000", "x\\\\\\u0000"]:
        job_id = t.enqueue(s=text)
        stored = query(app.dsn, "SELECT args->>'s' FROM {schema}.jobs WHERE id = %s",
                       [job_id], schema=app.schema)[0][0]
        assert stored == text


def test_fc17_results_and_errors_with_nul_are_scrubbed() -> None:
    assert dump_result("a\x00b") == '"a\ufffdb"'
    assert dump_result({"k\x00": ["\x00"]}) == '{"k\ufffd":["\ufffd"]}'
    assert dump_result({"lit": "\\u0000"}) == '{"lit":"\\\\u0000"}'
    assert dump_result(Custom()).startswith('"<')
    assert dump_result(math.nan) == '"nan"'


def test_lone_surrogate_is_rejected(app: App) -> None:
    with pytest.raises(ValidationError, match="surrogate"):
        _task(app).enqueue(s="\ud800")


def test_fc08_oversized_args_are_rejected_before_the_database(app: App) -> None:
    t = _task(app)
    with pytest.raises(ValidationError, match=f"the limit is {DEFAULT_MAX_ARGS_BYTES} bytes"):
        t.enqueue(s="a" * DEFAULT_MAX_ARGS_BYTES)
    small = App(app.dsn, schema=app.schema, max_args_bytes=100)
    st = small.task(name="t2", queue="q")(lambda **kw: None)
    with pytest.raises(ValidationError, match="args: 3[0-9]+ bytes serialised, the limit is 100"):
        st.enqueue(s="€" * 100)  # 300 UTF-8 bytes, 100 characters
    assert _count(app) == 0


@pytest.mark.parametrize(("field", "options", "message"), [
    ("queue", {"queue": ""}, "must not be empty"),
    ("queue", {"queue": "q" * 64}, "64 bytes, the limit is 63"),
    ("queue", {"queue": "é" * 32}, "64 bytes, the limit is 63"),
    ("queue", {"queue": "a b"}, "white space"),
    ("queue", {"queue": "a\x00"}, "unprintable"),
    ("queue", {"queue": "x'; DROP TABLE jobs; --"}, "white space"),
    ("priority", {"priority": 101}, "out of range -100..100"),
    ("priority", {"priority": -101}, "out of range"),
    ("priority", {"priority": 1.5}, "must be an int"),
    ("max_attempts", {"max_attempts": 0}, "out of range 1..10000"),
    ("max_attempts", {"max_attempts": 10_001}, "out of range"),
    ("run_at", {"run_at": datetime(2030, 1, 1)}, "naive datetime"),
    ("run_at", {"run_at": "2030-01-01"}, "must be a datetime"),
    ("run_at", {"run_at": datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1)))},
     "outside years 1-9999 in UTC"),
    ("run_at", {"run_at": datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))},
     "outside years 1-9999 in UTC"),
    ("delay", {"delay": -1}, "out of range"),
    ("delay", {"delay": math.inf}, "out of range"),
    ("delay", {"delay": timedelta(days=-1)}, "out of range"),
    ("idempotency_key", {"idempotency_key": ""}, "must be 1..255"),
    ("idempotency_key", {"idempotency_key": "k" * 256}, "must be 1..255"),
    ("idempotency_key", {"idempotency_key": "a\x00"}, "NUL"),
    ("unique_while", {"unique_while": ("available", "running")}, "must include 'scheduled'"),
    ("unique_while", {"unique_while": ("bogus",)}, "give a non-empty collection"),
])
def test_bad_options_name_field_and_limit(app: App, field: str, options: dict[str, Any],
                                          message: str) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        _task(app).configure(**options).enqueue()
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert _count(app) == 0


def test_bad_cron_declarations(app: App) -> None:
    task = app.task(name="r" * 230)(lambda: None)
    with pytest.raises(ValidationError, match="cron name: 230 bytes, the limit is 224"):
        app.cron("* * * * *")(task)
    with pytest.raises(ValidationError, match="grace"):
        app.cron("* * * * *", name="x", grace=1)(task)


def test_bad_task_declarations(app: App) -> None:
    with pytest.raises(ValidationError, match="task: 256 bytes, the limit is 255"):
        app.task(name="t" * 256)(lambda: None)
    with pytest.raises(ValidationError, match="max_attempts"):
        app.task(name="x", max_attempts=0)(lambda: None)
    with pytest.raises(ValidationError, match="schema"):
        App(app.dsn, schema='bad"name')
    app.task(name="dup")(lambda: None)
    with pytest.raises(ValidationError, match="already registered"):
        app.task(name="dup")(lambda: None)


def test_bad_input_in_a_batch_writes_nothing(app: App) -> None:
    t = _task(app)
    t.enqueue(keep=1)
    with pytest.raises(ValidationError):
        app.enqueue_many([t.job(n=1), t.job(n=math.nan)])
    with pytest.raises(ValidationError, match=r"jobs\[1\]"):
        app.enqueue_many([t.job(n=1), {"n": 2}])  # type: ignore[list-item]
    assert _count(app) == 1


def test_aware_run_at_in_any_zone_is_the_same_instant(app: App) -> None:
    from zoneinfo import ZoneInfo

    at = datetime(2031, 6, 1, 9, 30, tzinfo=ZoneInfo("Asia/Tehran"))
    job_id = _task(app).configure(run_at=at).enqueue()
    stored = query(app.dsn, "SELECT run_at FROM {schema}.jobs WHERE id = %s", [job_id],
                   schema=app.schema)[0][0]
    assert stored == at and stored.astimezone(UTC) == at.astimezone(UTC)


def test_backoff_bounds_for_attempts_1_to_10000() -> None:
    policy = Backoff(base=1.0, cap=3600.0)
    rng = random.Random(7)
    for attempt in range(1, 10_001):
        ceiling = min(3600.0, 2.0 ** min(attempt, 20))
        delay = policy.delay(attempt, rng)
        assert ceiling / 2 <= delay <= ceiling
        assert math.isfinite(delay)
    assert policy.delay(10**9, rng) <= 3600
    assert Backoff(jitter=False).delay(3) == 8.0


def test_backoff_rejects_bad_settings() -> None:
    with pytest.raises(ValidationError, match="backoff.base"):
        Backoff(base=0)
    with pytest.raises(ValidationError, match="backoff.cap"):
        Backoff(base=10, cap=5)


def test_durations_have_bounds_checked_when_declared(app: App) -> None:
    """One absurd value must not reach the outcome path: a retry delay, a worker interval or
    a rate period past its bound is refused, naming it, before anything runs."""
    with pytest.raises(ValidationError, match="backoff.cap: 1e.18 seconds is over the limit"):
        Backoff(1e18, 1e18)
    with pytest.raises(ValidationError, match="backoff.base: must be seconds"):
        Backoff("1", 5)  # type: ignore[arg-type]
    for name in ("poll_interval", "rescue_interval", "stage_interval", "shutdown_grace",
                 "retention", "unknown_task_grace"):
        with pytest.raises(ConfigError, match=f"^{name}: 1e.18 is out of range"):
            Worker(app, ["q"], **{name: 1e18})
    with pytest.raises(ConfigError, match="shutdown_grace"):
        Worker(app, ["q"], shutdown_grace=-1)
    with pytest.raises(ValidationError, match="period: 1e.18 must be seconds"):
        app.set_queue_limits("q", rate=1, period=1e18)
    with pytest.raises(ValidationError, match="concurrency: 0 must be an int"):
        app.set_queue_limits("q", concurrency=0)
    assert app.queues() == []  # nothing was written


def test_args_must_fit_the_handlers_signature(app: App) -> None:
    @app.task(name="send")
    def send(to: str, subject: str = "", *, cc: str = "") -> None: ...

    with pytest.raises(ValidationError, match=r"args: task 'send': unexpected argument 'too'; "
                       r"missing argument 'to' \(the handler takes to, subject, cc\)"):
        send.job(too="a@example.com")
    with pytest.raises(ValidationError, match="missing argument 'to'"):
        app.enqueue_many([send.job(to="x"), send.job(subject="no recipient")])
    with pytest.raises(ValidationError, match="unexpected argument 'x'"):
        app.cron("* * * * *", name="bad", args={"x": 1})(send)
    assert send.job(to="a", cc="b").task == "send"
    assert app.stats()["queues"] == {}  # nothing was written


def test_fc04c_heartbeat_too_slow_for_lease_is_rejected(app: App) -> None:
    with pytest.raises(ConfigError, match="heartbeat: 1.0s cannot keep a 1.0s lease alive"):
        Worker(app, ["q"], lease=1.0, heartbeat=1.0)
    with pytest.raises(ConfigError, match="< lease / 2"):
        Worker(app, ["q"], lease=2.0, heartbeat=1.0)
    Worker(app, ["q"], lease=2.0, heartbeat=0.9)
    with pytest.raises(ConfigError, match="concurrency"):
        Worker(app, ["q"], concurrency=0)


def test_worker_app_path_that_cannot_be_imported(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["worker", "nosuch_pkg.tasks:app"])
    assert result.exit_code == 2
    assert "no module 'nosuch_pkg'" in result.output and "PYTHONPATH" in result.output
    # the module was found and raised: not blamed on the path; the module's own frames
    # (not the import machinery's) and one error line, status 2
    (tmp_path / "broken_tasks.py").write_text("import os\nimport nosuch_dependency\n")
    (tmp_path / "unclosed_tasks.py").write_text("app = dict(\n")
    (tmp_path / "exiting_tasks.py").write_text("raise SystemExit(0)\n")
    for name, error in (("broken_tasks", "ModuleNotFoundError: No module named "
                                         "'nosuch_dependency'"),
                        ("unclosed_tasks", "SyntaxError: '(' was never closed"),
                        ("exiting_tasks", "SystemExit: 0")):
        result = CliRunner().invoke(main, ["worker", f"{name}:app"])
        assert result.exit_code == 2, result.output
        assert f'{name}.py", line ' in result.output and "importlib" not in result.output
        assert f"error: importing '{name}' (of '{name}:app') raised {error}" in result.output


def test_enqueue_before_migrate_says_what_to_do(server: Server, schema: str) -> None:
    app = App(server.dsn, schema=schema)  # never migrated
    t = app.task(name="t")(lambda: None)
    for call in (lambda: t.enqueue(), lambda: app.enqueue_many(t.job() for _ in range(1_500))):
        with pytest.raises(psycopg.errors.UndefinedTable) as info:
            call()
        assert any("skipjack migrate" in note for note in info.value.__notes__)
    app.close()


def test_pool_size(server: Server, schema: str) -> None:
    for bad in (0, 1001, 2.5, True):
        with pytest.raises(ValidationError, match="pool_size"):
            App(server.dsn, schema=schema, pool_size=bad)  # type: ignore[arg-type]
    app = App(server.dsn, schema=schema, pool_size=6)
    app.migrate()
    t = app.task(name="t")(lambda n: None)
    with ThreadPoolExecutor(12) as threads:  # more threads than connections: they wait
        ids = list(threads.map(lambda n: t.enqueue(n=n), range(200)))
    assert len(set(ids)) == 200 and app._sync_pool().max_size == 6
    app.close()


def test_a_missing_table_of_the_callers_is_not_blamed_on_migrations(app: App) -> None:
    t = app.task(name="t")(lambda n: None)

    def specs() -> Any:
        for n in range(1_500):
            if n == 1_200:  # after the first statement was sent
                with app.connect() as conn:
                    conn.execute("SELECT * FROM my_cache_that_is_not_there")
            yield t.job(n=n)

    with pytest.raises(psycopg.errors.UndefinedTable) as info:
        app.enqueue_many(specs())
    assert not getattr(info.value, "__notes__", [])
