"""FC-33 (b): a real failover. etcd and two Patroni nodes (PostgreSQL 15, synchronous
replication); workers and an enqueuer reach them through one multi-host DSN
(``host=a,b port=p1,p2 target_session_attrs=read-write``). The primary's machine is crashed
(its Patroni and every PostgreSQL process SIGKILLed at once, so nothing restarts it and its
leader key expires), Patroni promotes the synchronous standby, and the same worker processes
carry on against it. Afterwards, from the new primary: every enqueue that returned is there,
every outcome read before the crash is unchanged, every job succeeded with its effect once,
and the attempt counts agree with the handler starts seen outside the database.

Skipped where the cluster cannot run: it needs root (PostgreSQL runs as the postgres user),
Patroni, etcd and PostgreSQL 15 (Debian: ``apt-get install patroni etcd-server etcd-client``;
``.ci/run`` installs them).
"""

from __future__ import annotations

import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import psycopg
import pytest

from skipjack import App
from skipjack_tools.ha import HACluster, unavailable

from support import WorkerProcess, create_log_tables, effect_counts, query, wait_until

SCHEMA = "skipjack_ha"
TASK = "ha.effect"
# a lease longer than a failover (most jobs are not rescued: they finish on the new primary)
WORKER_ARGS = ("--concurrency", "8", "--lease", "10", "--heartbeat", "1", "--rescue-interval",
               "1", "--poll-interval", "0.5")

Start = tuple[int, int, int]  # (attempt, lease_version, pid) of one handler start
JobRow = tuple[str, int, int, datetime | None]  # state, attempt, lease_version, finished_at


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[HACluster]:
    """A fresh cluster per test (the failover leaves one node dead); its logs are copied to
    ``tmp_path/cluster`` when it is torn down, however the test ended."""
    reason = unavailable()
    if reason:
        pytest.skip(f"Patroni/etcd cluster unavailable: {reason}")
    with HACluster(keep_logs=tmp_path / "cluster") as ha:
        yield ha


@pytest.fixture
def ha_app(cluster: HACluster) -> Iterator[App]:
    app = App(cluster.dsn, schema=SCHEMA)
    app.migrate()
    create_log_tables(cluster.dsn, SCHEMA)
    app.task(name=TASK, max_attempts=100)(lambda seconds=0.02: None)  # enqueued by name
    yield app
    app.close()


class Enqueuer(threading.Thread):
    """Enqueues ``total`` jobs in batches of ``batch``, each on a new connection, to the
    ``queues`` in turn, and keeps the ids of every call that returned (per queue); a failed
    call is counted and tried again."""

    def __init__(self, app: App, total: int, queues: list[str], batch: int = 10) -> None:
        super().__init__(daemon=True)
        self.app, self.total, self.queues, self.batch = app, total, queues, batch
        self.ids: list[int] = []
        self.by_queue: dict[str, list[int]] = {q: [] for q in queues}
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        calls = 0
        while len(self.ids) < self.total and not self.stop.is_set():
            queue = self.queues[calls % len(self.queues)]
            task = self.app.tasks[TASK].configure(queue=queue)
            try:
                with psycopg.connect(self.app.dsn, autocommit=True, connect_timeout=2) as conn:
                    ids = self.app.enqueue_many([task.job() for _ in range(self.batch)],
                                                conn=conn)
                self.by_queue[queue].extend(ids)
                self.ids.extend(ids)
                calls += 1
            except psycopg.Error as exc:
                self.failures.append(str(exc).strip())
            self.stop.wait(0.02)  # pacing: a steady trickle, not a burst


def start_worker(cluster: HACluster, tmp_path: Path, n: int,
                 queue: str = "default") -> WorkerProcess:
    return WorkerProcess(cluster.dsn, SCHEMA, [queue], *WORKER_ARGS, app="failover_app:app",
                         log=tmp_path / f"worker{n}.log",
                         env={"SKIPJACK_HA_STARTS": str(tmp_path / "starts")})


def wait_serving(workers: list[WorkerProcess]) -> None:
    for w in workers:
        wait_until(lambda w=w: " serving " in w.log(), timeout=60,  # type: ignore[misc]
                   what=f"worker {w.pid} serving")


def jobs(dsn: str) -> dict[int, JobRow]:
    rows = query(dsn, "SELECT id, state, attempt, lease_version, finished_at FROM {schema}.jobs",
                 schema=SCHEMA)
    return {r[0]: (r[1], r[2], r[3], r[4]) for r in rows}


def succeeded(dsn: str) -> dict[int, JobRow]:
    return {i: row for i, row in jobs(dsn).items() if row[0] == "succeeded"}


def starts(tmp_path: Path) -> dict[int, list[Start]]:
    """Every handler start, as the handlers wrote them to a file (outside the database)."""
    found: dict[int, list[Start]] = defaultdict(list)
    path = tmp_path / "starts"
    text = path.read_text() if path.exists() else ""
    for line in text.split("\n")[:-1]:  # whole lines only: one may be being appended
        job_id, attempt, lease_version, pid = map(int, line.split())
        found[job_id].append((attempt, lease_version, pid))
    return found


def logged_starts(dsn: str) -> set[tuple[int, int]]:
    """(job id, lease_version) of the starts the database kept (exec_log)."""
    rows = query(dsn, "SELECT job_id, lease_version FROM {schema}.exec_log "
                      "WHERE event = 'start'", schema=SCHEMA)
    return {(r[0], r[1]) for r in rows}


def all_succeeded(dsn: str, at_least: int) -> bool:
    rows = jobs(dsn)
    return len(rows) >= at_least and all(row[0] == "succeeded" for row in rows.values())


def audit(dsn: str, tmp_path: Path, enqueued: list[int],
          before: dict[int, JobRow]) -> dict[int, JobRow]:
    """What must hold after any failover; returns the jobs as they ended.

    - every enqueue that returned exists (the table may hold a few more: a call whose commit
      reached the standby but whose reply never came back) and every job succeeded;
    - every job that had succeeded before the crash is as it was then: the same claim
      (lease_version) and the same finish time, so it neither vanished nor ran again;
    - each job's effect (written in its completion's transaction) exists exactly once;
    - attempts agree with the starts the handlers wrote outside the database: the claim that
      recorded the success started the handler with the final (attempt, lease_version), and
      the database kept that start (exec_log); no job has counted more attempts than it had
      starts (a claim lost in the failover ran a handler but is not counted); and every
      start the database kept is one of those.
    """
    final = jobs(dsn)
    assert set(enqueued) <= set(final), "an enqueue that returned was lost"
    assert {row[0] for row in final.values()} == {"succeeded"}
    assert {i: final[i] for i in before} == before, "an outcome recorded before changed"
    assert effect_counts(dsn, SCHEMA) == dict.fromkeys(final, 1)
    seen = starts(tmp_path)
    logged = logged_starts(dsn)
    for job_id, (_, attempt, lease_version, _) in final.items():
        runs = seen[job_id]
        assert (attempt, lease_version) in {(a, v) for a, v, _ in runs}, (job_id, runs)
        assert (job_id, lease_version) in logged, job_id
        assert 1 <= attempt <= len(runs), (job_id, attempt, runs)
    assert logged <= {(job_id, v) for job_id, runs in seen.items() for _, v, _ in runs}
    return final


def test_fc33_failover_loses_no_enqueue_and_no_outcome(cluster: HACluster, ha_app: App,
                                                       tmp_path: Path) -> None:
    """Two workers (each serving a queue of its own, so that each one's part after the
    failover is known) and an enqueuer run while the primary is crashed; the standby is
    promoted, and the same two worker processes finish every job, each exactly once in
    effect."""
    primary, standby = cluster.wait_ready()
    queues = ["ha0", "ha1"]
    workers = [start_worker(cluster, tmp_path, n, q) for n, q in enumerate(queues)]
    enqueuer = Enqueuer(ha_app, total=400, queues=queues)
    try:
        wait_serving(workers)
        enqueuer.start()
        wait_until(lambda: len(enqueuer.ids) >= 150 and len(succeeded(primary.dsn)) >= 50,
                   timeout=60, what="work under way on the first primary")
        before = succeeded(primary.dsn)
        crashed = time.monotonic()
        cluster.crash(primary)
        # every enqueue that returns from now on committed on the new primary
        enqueued_before = {q: len(ids) for q, ids in enqueuer.by_queue.items()}
        promoted = cluster.wait_primary(standby, timeout=60)
        effects_then = len(effect_counts(standby.dsn, SCHEMA))
        wait_until(lambda: len(effect_counts(standby.dsn, SCHEMA)) > effects_then, timeout=60,
                   what="a job finished on the new primary")
        resumed = time.monotonic() - crashed
        enqueuer.join(90)
        assert not enqueuer.is_alive(), "the enqueuer did not finish"
        wait_until(lambda: all_succeeded(standby.dsn, len(enqueuer.ids)), timeout=90,
                   what="every job succeeded on the new primary")
        assert [w.proc.poll() for w in workers] == [None, None], "a worker exited"
    finally:
        enqueuer.stop.set()
        enqueuer.join(30)
        for w in workers:
            w.kill()
    final = audit(standby.dsn, tmp_path, enqueuer.ids, before)
    assert enqueuer.failures, "the enqueuer should have seen the failover"
    # the workers followed the new primary: each queue's jobs enqueued there ran in the
    # worker process that served the queue from the start
    for w, q in zip(workers, queues, strict=True):
        later = enqueuer.by_queue[q][enqueued_before[q]:]
        pids = query(standby.dsn, "SELECT DISTINCT pid FROM {schema}.effect_rows "
                                  "WHERE job_id = ANY(%s)", [later], schema=SCHEMA)
        assert len(later) >= 50 and pids == [(w.pid,)], (q, len(later), pids)
    uncounted = sum(len(runs) - final[i][1] for i, runs in starts(tmp_path).items())
    stale = sum(w.log().count(" rejected: ") for w in workers)
    print(f"\nfailover: {standby.name} accepted writes {promoted:.1f}s after the crash of "
          f"{primary.name}; the first job finished there {resumed:.1f}s after the crash; "
          f"{len(final)} jobs, {len(before)} succeeded before the crash, "
          f"{len(enqueuer.failures)} enqueue calls failed; {uncounted} handler runs not "
          f"counted as attempts (released, or a claim lost), {stale} stale outcomes refused")


def test_claims_lost_in_a_failover_only_run_their_jobs_again(cluster: HACluster, ha_app: App,
                                                             tmp_path: Path) -> None:
    """Claims commit with ``synchronous_commit = off``: the primary does not wait for the
    standby (nor its own disk) before the worker runs the job, so a failover can lose a claim.
    That only makes the job run again, never loses it nor records an outcome twice:

    - WAL is one sequence, and the standby receives and replays it in order. Everything that
      waits for the standby (an enqueue, an outcome, the effect written with it, a start
      logged by the handler) comes after the claim in that sequence; once it is on the
      standby, so is the claim.
    - A claim that did not reach the standby leaves the job there as it was before it:
      available, with the previous attempt count and fencing token. The new primary hands it
      out again (with the same attempt number: the lost claim is not counted) and a new,
      random token.
    - The worker that ran it under the lost claim holds a token that matches no row on the
      new primary: its heartbeat finds no lease, and its outcome and the effect in the same
      transaction are refused by the fence (or never committed at all).

    Made to happen here: replication is stalled (the primary's WAL senders SIGSTOPped), a
    stopped worker is resumed and claims jobs, which commit on the primary alone while each
    handler waits on its first synchronous write; then the primary crashes.
    """
    primary, standby = cluster.wait_ready()
    worker = start_worker(cluster, tmp_path, 0)
    try:
        wait_serving([worker])
        warm = ha_app.enqueue_many([ha_app.tasks[TASK].job() for _ in range(4)])
        wait_until(lambda: set(succeeded(primary.dsn)) == set(warm), timeout=60,
                   what="the first jobs done")
        before = succeeded(primary.dsn)
        worker.signal(signal.SIGSTOP)
        ids = ha_app.enqueue_many([ha_app.tasks[TASK].job() for _ in range(6)])
        wait_until(lambda: set(ids) <= set(jobs(standby.dsn)), timeout=30,
                   what="the enqueued jobs replayed on the standby")
        cluster.stall_replication(primary)
        worker.signal(signal.SIGCONT)

        def claimed() -> dict[int, JobRow] | None:
            rows = jobs(primary.dsn)
            seen = starts(tmp_path)
            ok = all(rows[i][0] == "running" and (rows[i][1], rows[i][2]) in
                     {(a, v) for a, v, _ in seen[i]} for i in ids)
            return {i: rows[i] for i in ids} if ok else None

        lost = wait_until(claimed, timeout=30, what="the jobs claimed and their handlers running")
        on_standby = jobs(standby.dsn)
        assert {i: on_standby[i][:3] for i in ids} == dict.fromkeys(ids, ("available", 0, 0))
        cluster.crash(primary)
        promoted = cluster.wait_primary(standby, timeout=60)
        wait_until(lambda: all_succeeded(standby.dsn, len(warm) + len(ids)), timeout=60,
                   what="every job succeeded on the new primary")
        assert worker.proc.poll() is None, "the worker exited"
    finally:
        worker.kill()
    final = audit(standby.dsn, tmp_path, [*warm, *ids], before)
    seen = starts(tmp_path)
    kept = logged_starts(standby.dsn)
    for i in ids:
        _, attempt, token, _ = lost[i]
        assert attempt == 1
        assert (i, token) not in kept  # the lost claim's start never reached the database
        assert final[i][2] != token  # the outcome is a later claim's
        # the handler ran under the lost claim and again under a claim with the same attempt
        # number: the attempt count is one lower than the runs
        assert next(v for a, v, _ in seen[i] if a == 1) == token
        assert sum(1 for a, _, _ in seen[i] if a == 1) >= 2
        assert final[i][1] < len(seen[i])
    print(f"\nlost claims: {len(ids)} jobs claimed on {primary.name} only; {standby.name} "
          f"accepted writes {promoted:.1f}s after the crash; each ran again and succeeded once")
