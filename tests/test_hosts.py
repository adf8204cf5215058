"""Workers on simulated hosts (``skipjack_tools.hosts``): network namespaces joined to this one
by a wire that can be cut, and a private PostgreSQL server listening on this side of every
wire. The workers are real processes, each inside its host's namespace; the checks read the
database. Skipped where namespaces cannot be made (not root, ``ip netns add`` refused, no
TUN devices, no PostgreSQL server binaries).
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from psycopg.conninfo import make_conninfo

from skipjack import App
from skipjack.channels import channel_name
from skipjack_tools import hosts
from skipjack_tools.hosts import Host, HostsUnavailable, Network, PrivateServer

from support import WorkerProcess, create_log_tables, effect_counts, query, states, wait_until

# Short leases (the default is 30 s), so that a partition outlasts one within seconds.
FAST = ["--lease", "2", "--heartbeat", "0.3", "--rescue-interval", "0.5", "--poll-interval",
        "0.5"]
TASKS = ("sleep", "effect", "async_effect", "effect_until_cancelled")


@pytest.fixture(scope="module")
def network() -> Iterator[tuple[Network, PrivateServer]]:
    why = hosts.unavailable()
    if why:
        pytest.skip(why)
    stack = contextlib.ExitStack()
    try:
        made = stack.enter_context(hosts.hosts_with_server(2))
    except HostsUnavailable as exc:
        stack.close()
        pytest.skip(f"simulated hosts cannot be made here: {exc}")
    with stack:
        yield made


@pytest.fixture
def app(network: tuple[Network, PrivateServer]) -> Iterator[App]:
    """An app in a fresh schema of the private server, with the log tables."""
    _, server = network
    app = App(server.dsn, schema="t_" + secrets.token_hex(6))
    app.migrate()
    create_log_tables(app.dsn, app.schema)
    for name in TASKS:
        app.task(name=name)(lambda **kw: None)
    yield app
    app.close()
    query(server.dsn, f'DROP SCHEMA IF EXISTS "{app.schema}" CASCADE')


def on_host(app: App, server: PrivateServer, host: Host, name: str, log: Path,
            *args: str, queues: tuple[str, ...] = ("default",),
            dsn: str | None = None) -> WorkerProcess:
    """A worker process named ``name`` inside ``host``'s namespace, reaching the server over
    the host's wire (at ``dsn``, by default the server's address for the host)."""
    return WorkerProcess(dsn or server.dsn_for(host), app.schema, list(queues), "--name", name,
                         *args, log=log, prefix=host.command([]))


def listening(app: App, *workers: WorkerProcess) -> bool:
    """Whether every one of ``workers`` listens for notifications (is ready to claim).

    Raises:
        AssertionError: one of them exited (its log says why)."""
    for w in workers:
        assert w.proc.poll() is None, f"worker exited: {w.log()[-2000:]}"
    rows = query(app.dsn, "SELECT count(*) FROM pg_stat_activity WHERE starts_with(query, %s)",
                 [f'LISTEN "{channel_name(app.schema)}'])
    return int(rows[0][0]) >= len(workers)


def enqueue(app: App, task: str, n: int, queue: str | None = None, **args: Any) -> list[int]:
    t = app.tasks[task] if queue is None else app.tasks[task].configure(queue=queue)
    return app.enqueue_many([t.job(**args) for _ in range(n)])


def jobs(app: App, ids: list[int]) -> dict[int, dict[str, Any]]:
    rows = query(app.dsn, "SELECT id, state, attempt, worker, errors FROM {schema}.jobs "
                          "WHERE id = ANY(%s)", [ids], schema=app.schema)
    return {r[0]: {"state": r[1], "attempt": r[2], "worker": r[3], "errors": r[4]}
            for r in rows}


def run_by(app: App, event: str = "finish") -> dict[int, set[int]]:
    """job id -> pids of the processes whose handler logged ``event`` for it."""
    out: dict[int, set[int]] = {}
    for job_id, pid in query(app.dsn, "SELECT job_id, pid FROM {schema}.exec_log "
                                      "WHERE event = %s", [event], schema=app.schema):
        out.setdefault(job_id, set()).add(pid)
    return out


def logged(worker: WorkerProcess, pattern: str) -> set[int]:
    """Ids of the jobs ``job N: <pattern>`` lines of the worker's log are about."""
    return {int(m.group(1)) for m in re.finditer(rf"job (\d+): {pattern}", worker.log())}


def test_two_hosts_drain_a_backlog(network: tuple[Network, PrivateServer], app: App,
                                   tmp_path: Path) -> None:
    """Two hosts drain one backlog over their wires: every job succeeds, its handler
    finished once, each effect committed once, and both hosts ran jobs."""
    net, server = network
    a_host, b_host = net.hosts
    with on_host(app, server, a_host, "host-a", tmp_path / "a.log", *FAST,
                 "--concurrency", "4") as a, \
            on_host(app, server, b_host, "host-b", tmp_path / "b.log", *FAST,
                    "--concurrency", "4") as b:
        wait_until(lambda: listening(app, a, b), timeout=60, what="both workers listening")
        effects = enqueue(app, "effect", 150)
        sleeps = enqueue(app, "sleep", 150, seconds=0.02)
        wait_until(lambda: states(app.dsn, app.schema) == {"succeeded": 300}, timeout=90,
                   what="the backlog drained")
    assert effect_counts(app.dsn, app.schema) == dict.fromkeys(effects, 1)
    finished = run_by(app)
    assert {job_id: len(pids) for job_id, pids in finished.items()} == \
        dict.fromkeys([*effects, *sleeps], 1)
    by_worker = {w for (w,) in query(app.dsn, "SELECT DISTINCT worker FROM {schema}.jobs",
                                     schema=app.schema)}
    assert by_worker == {"host-a", "host-b"}


@dataclass
class Scene:
    """Two hosts at work: A runs four long jobs (``held``: two sync handlers that do not stop
    when told, two async ones), B runs the ``background`` jobs; ``a_only`` is a queue only A
    serves."""

    app: App
    net: Network
    a_host: Host
    a: WorkerProcess
    b: WorkerProcess
    held: list[int]
    background: list[int]

    @property
    def sync_held(self) -> list[int]:
        return self.held[:2]

    @property
    def async_held(self) -> list[int]:
        return self.held[2:]


@contextlib.contextmanager
def two_hosts_at_work(network: tuple[Network, PrivateServer], app: App, tmp_path: Path,
                      **a_options: Any) -> Iterator[Scene]:
    """A and B at work (see ``Scene``); ``a_options``: connection options in A's DSN. Both
    workers are killed afterwards."""
    net, server = network
    a_host, b_host = net.hosts
    a_dsn = make_conninfo(server.dsn_for(a_host), **a_options)
    with on_host(app, server, a_host, "host-a", tmp_path / "a.log", *FAST, "--concurrency",
                 "4", "--prefetch", "0", queues=("default", "only-a"), dsn=a_dsn) as a:
        wait_until(lambda: listening(app, a), timeout=60, what="A listening")
        # A claims and starts all four (no prefetch); on attempt 1 each would run for two
        # minutes
        held = [*enqueue(app, "effect_until_cancelled", 2, seconds=120),
                *enqueue(app, "async_effect", 2, seconds=120)]

        def a_holds_all() -> bool:
            rows = jobs(app, held)
            return all(j["state"] == "running" and j["worker"] == "host-a"
                       for j in rows.values()) and set(run_by(app, "start")) == set(held)

        wait_until(a_holds_all, timeout=60, what="A claimed and started the four jobs")
        with on_host(app, server, b_host, "host-b", tmp_path / "b.log", *FAST, "--concurrency",
                     "4") as b:
            wait_until(lambda: listening(app, a, b), timeout=60, what="B listening")
            background = [*enqueue(app, "sleep", 40, seconds=0.05), *enqueue(app, "effect", 20)]
            wait_until(lambda: any(b.pid in pids for pids in run_by(app).values()),
                       timeout=60, what="B running background jobs")
            yield Scene(app, net, a_host, a, b, held, background)


def rescued_while_cut_off(scene: Scene) -> None:
    """Wait (A cut off) until B rescued and finished A's jobs and A, unable to renew their
    leases, took them from their handlers."""
    app, a = scene.app, scene.a
    wait_until(lambda: all(j["state"] == "succeeded" for j in jobs(app, scene.held).values()),
               timeout=60, what="B rescued and finished A's jobs")
    wait_until(lambda: logged(a, r"lease expired[^\n]*cancelling its handler") >= set(scene.held),
               timeout=60, what="A taking the jobs from their handlers while cut off")


def rejoins(scene: Scene) -> list[int]:
    """After the heal: wait until every job succeeded and A, the same process, claimed and
    finished new jobs of a queue only it serves (returned)."""
    app, a = scene.app, scene.a
    total = len(scene.held) + len(scene.background)
    wait_until(lambda: states(app.dsn, app.schema).get("succeeded") == total, timeout=90,
               what="every job succeeded")
    later = [*enqueue(app, "sleep", 5, queue="only-a"), *enqueue(app, "effect", 5, queue="only-a")]
    wait_until(lambda: all(j["state"] == "succeeded" for j in jobs(app, later).values()),
               timeout=90, what="A finished new jobs after the heal")
    assert a.proc.poll() is None  # A never exited: the same process throughout
    return later


def check_outcomes(scene: Scene, later: list[int]) -> None:
    """What the database says once the work is done (see the tests' docs)."""
    app, a, b = scene.app, scene.a, scene.b
    rows = jobs(app, scene.held)
    for job_id in scene.held:  # rescued from A after their lease, finished by B
        job = rows[job_id]
        assert job["state"] == "succeeded" and job["worker"] == "host-b", job
        assert job["attempt"] >= 2, job
        rescue = [e for e in job["errors"] if e.get("worker") == "host-a"]
        assert rescue and rescue[0]["error"].startswith("lease expired"), job
    assert {j["worker"] for j in jobs(app, later).values()} == {"host-a"}
    effect_jobs = [*scene.held, *scene.background[40:], *later[5:]]
    assert effect_counts(app.dsn, app.schema) == dict.fromkeys(effect_jobs, 1)
    effect_pids = dict(query(app.dsn, "SELECT job_id, pid FROM {schema}.effect_rows",
                             schema=app.schema))
    assert {effect_pids[j] for j in scene.held} == {b.pid}
    assert {effect_pids[j] for j in later[5:]} == {a.pid}
    finished = run_by(app)
    assert all(a.pid not in finished.get(j, set()) for j in scene.async_held)  # cancelled
    assert all(finished[j] == {a.pid} for j in later)


def test_fc39_partitioned_host_is_fenced_and_rejoins(network: tuple[Network, PrivateServer],
                                                app: App, tmp_path: Path) -> None:
    """Host A's traffic is dropped silently (no RST: its connections just hang) while it runs
    jobs, for longer than their lease. Leases here are 2 s (heartbeat 0.3 s, rescues every
    0.5 s) instead of the default 30 s, so the test takes seconds.

    While A is cut off: host B rescues A's jobs once their leases expired and finishes them,
    and A, unable to renew, takes them from its handlers, while its renewal still hangs.
    After the heal: A's sync handlers, which do not stop when told, try to commit their
    effects, and fencing refuses each such completion (A's log says so); its async handlers
    were cancelled and never finished; each effect exists once, from B; and A, the same
    process, claims and finishes new jobs."""
    with two_hosts_at_work(network, app, tmp_path) as scene:
        scene.net.partition(scene.a_host)
        rescued_while_cut_off(scene)
        # before any of A's connections failed: A did not wait for its renewal to time out
        assert "heartbeat:" not in scene.a.log().split("lease expired", 1)[0]
        scene.net.heal(scene.a_host)
        wait_until(lambda: logged(scene.a, "stale complete rejected") >= set(scene.sync_held),
                   timeout=90, what="A's completions refused after the heal")
        later = rejoins(scene)
    check_outcomes(scene, later)


def test_fc39_host_cut_off_past_its_tcp_timeouts_reconnects(network: tuple[Network, PrivateServer],
                                                       app: App, tmp_path: Path) -> None:
    """As above, but the partition lasts until A's connections have timed out. A's DSN sets
    short TCP timeouts (tcp_user_timeout 2 s, keepalives after 1 s idle, 1 s apart, 2 of
    them, connect_timeout 2 s) instead of skipjack's 30 s, so that takes seconds. After the
    heal A reconnects by itself (the same process), claims and finishes new jobs; nothing of
    its cut-off work commits; each effect exists once."""
    with two_hosts_at_work(network, app, tmp_path, tcp_user_timeout=2000, keepalives_idle=1,
                           keepalives_interval=1, keepalives_count=2,
                           connect_timeout=2) as scene:
        scene.net.partition(scene.a_host)
        rescued_while_cut_off(scene)
        for part in ("heartbeat: ", "listener: ", "claim failed: "):
            wait_until(lambda p=part: p in scene.a.log(), timeout=60,  # type: ignore[misc]
                       what=f"A's connection failing ({part.strip()})")
        scene.net.heal(scene.a_host)
        later = rejoins(scene)
        wait_until(lambda: "listener: listening again" in scene.a.log(), timeout=60,
                   what="A listening again")
    check_outcomes(scene, later)
