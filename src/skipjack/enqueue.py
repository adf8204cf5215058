"""Writing jobs: one planner for the statements of an enqueue and for the resolution of
idempotency keys, and two thin drivers (sync and async) that run what it plans.

A call is cut into chunks of at most ``CHUNK_JOBS`` jobs and ``CHUNK_MAX_CHARS``
characters of args (``chunks``); each chunk is one INSERT (``insert_statement``). On
the app's own connection the INSERTs of a call go out in pipeline mode, each sent while the
caller's iterable builds the next chunk. Then ``resolve_ids`` maps the returned rows to
input order, reading the ids of keys that other jobs already hold (and inserting anew the jobs
whose key was freed meanwhile).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import nullcontext
from datetime import UTC
from itertools import chain
from operator import attrgetter
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from .errors import DuplicateJobError, ValidationError
from .jobs import JobSpec
from .sql import Queries
from .sql.arrays import number_array, text_array

# A bulk enqueue writes at most this many jobs, or this many characters of args, per
# statement (a statement must stay well under PostgreSQL's 1 GiB message limit; a larger job,
# up to max_args_bytes, is a statement of its own). 10,000 jobs from a generator: 1,000 per
# statement took 61 ms, 500 66 ms, 2,000 74 ms, one statement after the whole list 95-101 ms
# (docs/performance.md).
CHUNK_JOBS = 1000
CHUNK_MAX_CHARS = 32 * 1024 * 1024

# A key whose holder finished between our insert and our look-up of its id is free again:
# such jobs are inserted anew, for at most this many rounds.
KEY_ROUNDS = 3

Chunk = tuple[list[JobSpec], bool]  # the specs, and whether another chunk follows
Statement = tuple[bytes, dict[str, Any]]
Row = tuple[Any, ...]


def chunks(jobs: Iterable[JobSpec]) -> Iterator[Chunk]:
    """The specs in chunks of at most CHUNK_JOBS jobs and CHUNK_MAX_CHARS characters of args.

    Raises:
        ValidationError: an item is not a JobSpec (named by its index).
    """
    chunk: list[JobSpec] = []
    chars = 0
    for i, spec in enumerate(jobs):
        if not isinstance(spec, JobSpec):
            hint = (f" {spec!r}: to enqueue a task this code does not import, declare it by "
                    "its name on this app (@app.task(name=...)); see docs/enqueueing.md"
                    if isinstance(spec, str) else "")
            raise ValidationError(
                f"jobs[{i}]",
                f"must be a JobSpec (from Task.job()), got {type(spec).__name__}{hint}")
        size = len(spec.args_json)
        if chunk and (len(chunk) == CHUNK_JOBS or chars + size > CHUNK_MAX_CHARS):
            yield chunk, True
            chunk, chars = [], 0
        chunk.append(spec)
        chars += size
    if chunk:
        yield chunk, False


def _iso(values: list[Any]) -> list[Any]:
    """Aware datetimes as ISO 8601 text in UTC: the same instants, with none of the offsets
    PostgreSQL cannot read (one with seconds or microseconds, which Python allows)."""
    return [None if v is None else v.astimezone(UTC).isoformat() for v in values]


# The columns of a bulk enqueue besides args: (JobSpec attribute, statement parameter,
# array literal of a list of values, conversion of the values first). run_at goes as ISO 8601
# text: datetimes equal in Python may still differ in their offset (the two 02:30 of a night
# when the clocks go back compare equal), and the text keeps them apart.
_BULK_COLUMNS: tuple[tuple[str, str, Callable[[list[Any]], str],
                           Callable[[list[Any]], list[Any]] | None], ...] = (
    ("queue", "queue", text_array, None),
    ("task", "task", text_array, None),
    ("priority", "priority", number_array, None),
    ("max_attempts", "max_attempts", number_array, None),
    ("run_at", "run_at", text_array, _iso),
    ("delay", "delay", number_array, None),
    ("idempotency_key", "idempotency_key", text_array, None),
    ("lease", "lease_seconds", number_array, None),
    ("unique_states", "unique_states", number_array, None),
)


def insert_statement(q: Queries, specs: list[JobSpec],
                     metadata: str | None = None) -> Statement:
    """ENQUEUE_ONE with plain values for one job, else ENQUEUE with args as one array
    literal (see ``skipjack.sql.arrays.text_array``) and each other column as one value
    when every job shares it, else as an array literal; their *_NO_KEYS forms when no job
    has an idempotency key. ``metadata`` (JSON text, or None) goes with every job."""
    keyed = any(s.idempotency_key is not None for s in specs)
    if len(specs) == 1:
        s = specs[0]
        return q.ENQUEUE_ONE if keyed else q.ENQUEUE_ONE_NO_KEYS, {
            "queue": s.queue, "task": s.task, "args": s.args_json, "priority": s.priority,
            "max_attempts": s.max_attempts, "run_at": s.run_at, "delay": s.delay,
            "idempotency_key": s.idempotency_key, "lease_seconds": s.lease,
            "unique_states": s.unique_states, "metadata": metadata}
    params: dict[str, Any] = {"args": text_array([s.args_json for s in specs]),
                              "metadata": metadata}
    for attr, name, array, convert in _BULK_COLUMNS:
        values = list(map(attrgetter(attr), specs))
        if convert is not None:
            values = convert(values)
        if values.count(values[0]) == len(values):
            params[name], params["same_" + name] = None, values[0]
        else:
            params[name], params["same_" + name] = array(values), None
    return q.ENQUEUE if keyed else q.ENQUEUE_NO_KEYS, params


class Plan:
    """The statements of one enqueue call, planned as the caller's iterable is read.

    Args:
        q: the app's statements.
        jobs: the specs; with ``read_all`` they are read in full now (the caller's connection
            may be what the iterable reads from), else as ``inserts`` is iterated.

    Raises:
        ValidationError: an item read now is not a JobSpec.
    """

    def __init__(self, q: Queries, jobs: Iterable[JobSpec], *, read_all: bool) -> None:
        self._q = q
        self._chunks = chunks(jobs)
        if read_all:
            self._chunks = iter(list(self._chunks))
        self._first = next(self._chunks, None)
        self.specs: list[JobSpec] = []  # every spec of the inserts sent so far
        self.metadata: str | None = None  # JSON text stored with every job (hooks')
        self.inserted: frozenset[int] = frozenset()  # ids of the rows the inserts created

    @property
    def empty(self) -> bool:
        """Whether the call has no job at all."""
        return self._first is None

    @property
    def several(self) -> bool:
        """Whether the call takes more than one statement (it then needs a transaction)."""
        return self._first is not None and self._first[1]

    def inserts(self) -> Iterator[Statement]:
        """One INSERT per chunk, the next chunk read from the iterable only when asked for.

        Raises:
            ValidationError: an item is not a JobSpec (or the iterable raised it).
        """
        if self._first is None:
            return
        for chunk, _ in chain([self._first], self._chunks):
            self.specs += chunk
            yield insert_statement(self._q, chunk, self.metadata)

    def resolve_ids(self, rows: list[Row]) -> Generator[Statement, list[Row], list[int]]:
        """The ids in input order from the rows the inserts returned. It yields each further
        statement it needs (the ids of keys held by other jobs; the jobs whose key was freed
        meanwhile, inserted anew) and is sent that statement's rows; it returns the ids.

        Raises:
            DuplicateJobError: a key is held by a job this transaction cannot see.
        """
        existing: list[tuple[int, str]] = []
        for _ in range(KEY_ROUNDS):
            missing = _missing_keys(self.specs, [*rows, *existing])
            if not missing:
                break
            existing += yield self._q.EXISTING_KEYS, {"keys": missing}
            for chunk, _ in chunks(_specs_to_retry(self.specs, [*rows, *existing])):
                rows += yield insert_statement(self._q, chunk, self.metadata)
        self.inserted = frozenset(job_id for job_id, _ in rows)
        return _assign_ids(self.specs, rows, existing)


def not_encodable(exc: UnicodeEncodeError | psycopg.Error) -> ValidationError:
    """The error for a job value the database's encoding (one not UTF8) cannot store: the
    server's refusal of the statement, or the client's on a caller's connection in that
    encoding (the statement was then not sent)."""
    if isinstance(exc, UnicodeEncodeError):
        what = f"holds {exc.object[exc.start:exc.end]!r}, which the database's encoding " \
               f"({exc.encoding}) cannot store"
    else:
        what = f"cannot be stored: {(exc.diag.message_primary or str(exc)).strip()}"
    return ValidationError("job", f"a value {what}: use a UTF8 database, or leave such "
                                  "characters out")


def needs_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
                      several: bool) -> bool:
    """Whether several statements need a transaction of their own: on an autocommit
    connection outside any (the app's own, or a caller's). One statement is atomic, and a
    caller's open transaction already holds them all."""
    return (several and conn.autocommit
            and conn.info.transaction_status == TransactionStatus.IDLE)


def run(conn: psycopg.Connection[Any], plan: Plan, *, pipelined: bool) -> list[int]:
    """Run ``plan`` on ``conn``: its inserts in pipeline mode when ``pipelined`` (the app's own
    connection; on a caller's they go one after the other: pipeline mode there is the
    caller's to choose, and psycopg refuses it after a ``stream()``), then its key resolution.
    Returns the job ids in input order."""
    atomic = conn.transaction() if needs_transaction(conn, plan.several) else nullcontext()
    # tuple rows, whatever the row factory of the caller's connection
    with atomic, conn.cursor(row_factory=tuple_row) as cur:
        sent: list[psycopg.Cursor[Row]] = []
        with conn.pipeline() if pipelined and plan.several else nullcontext():
            for statement in plan.inserts():
                sent.append(c := conn.cursor(row_factory=tuple_row) if sent else cur)
                c.execute(*statement)
        resolution = plan.resolve_ids([row for c in sent for row in c.fetchall()])
        try:
            statement = next(resolution)
            while True:
                statement = resolution.send(cur.execute(*statement).fetchall())
        except StopIteration as done:
            ids: list[int] = done.value
            return ids


async def run_async(conn: psycopg.AsyncConnection[Any], plan: Plan, *,
                    pipelined: bool) -> list[int]:
    """``run`` on an async connection."""
    atomic = conn.transaction() if needs_transaction(conn, plan.several) else nullcontext()
    async with atomic, conn.cursor(row_factory=tuple_row) as cur:
        sent: list[psycopg.AsyncCursor[Row]] = []
        async with conn.pipeline() if pipelined and plan.several else nullcontext():
            for statement in plan.inserts():
                sent.append(c := conn.cursor(row_factory=tuple_row) if sent else cur)
                await c.execute(*statement)
        resolution = plan.resolve_ids([row for c in sent for row in await c.fetchall()])
        try:
            statement = next(resolution)
            while True:
                statement = resolution.send(await (await cur.execute(*statement)).fetchall())
        except StopIteration as done:
            ids: list[int] = done.value
            return ids


def note_not_migrated(exc: psycopg.errors.UndefinedTable, schema: str) -> None:
    """Add a note saying to migrate when the missing relation is one of skipjack's (not, say,
    a table the caller's iterable read)."""
    if f'relation "{schema}.' in (exc.diag.message_primary or ""):
        exc.add_note(f"skipjack: schema {schema!r} has no skipjack tables on this database: "
                     "run `skipjack migrate` (or App.migrate()) first, or check the schema name")


def _specs_to_retry(specs: list[JobSpec], rows: list[Row]) -> list[JobSpec]:
    missing = set(_missing_keys(specs, rows))
    return [s for s in specs if s.idempotency_key in missing]


def _missing_keys(specs: list[JobSpec], rows: list[Row]) -> list[str]:
    inserted = {key for _, key in rows if key is not None}
    return sorted({s.idempotency_key for s in specs
                   if s.idempotency_key is not None and s.idempotency_key not in inserted})


def _assign_ids(specs: list[JobSpec], rows: list[Row],
                existing: list[tuple[int, str]]) -> list[int]:
    """Map returned rows back to input order: keyed jobs by key, the rest by id order
    (rows were inserted in input order, so their identity values ascend with it)."""
    if not existing and len(rows) == len(specs) and all(key is None for _, key in rows):
        return sorted(job_id for job_id, _ in rows)  # no keys: the common bulk case
    by_key = {key: job_id for job_id, key in existing}
    by_key.update({key: job_id for job_id, key in rows if key is not None})
    unkeyed = iter(sorted(job_id for job_id, key in rows if key is None))
    ids = []
    for spec in specs:
        if spec.idempotency_key is None:
            ids.append(next(unkeyed))
        elif spec.idempotency_key in by_key:
            ids.append(by_key[spec.idempotency_key])
        else:
            raise DuplicateJobError(
                f"idempotency_key {spec.idempotency_key!r} is taken by a job not visible to "
                "this transaction (uncommitted elsewhere, or committed after its snapshot)"
            )
    return ids
