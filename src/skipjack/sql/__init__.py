"""Every SQL statement skipjack runs, grouped by stage of a job's life.

The statements are templates in the modules of this package (``enqueue``, ``claim``,
``outcomes``, ``maintenance``, ``admin``, ``cron``, ``workers``, ``schema``, and ``roles``
(privileges)), in which
``{schema}`` stands for the quoted schema name, and ``{channel}`` and ``{due_channel}`` for
the schema's notification channels (``skipjack.channels``, as string literals); values are
always bound parameters (``%(name)s``), never interpolated. ``Queries`` renders them for one
schema, each on first use, as UTF-8 bytes, so running a statement costs no re-rendering
(psycopg then caches its parse of the text).

Fencing: every write about a claimed job (complete, retry, discard, release, heartbeat,
rescue) matches ``state = 'running' AND lease_version = <token read at claim>``. A write that
matches no row is stale: the job was rescued and re-claimed meanwhile, and nothing changes.
Each claim raises ``lease_version`` by a random step (1..2^31), not by one: claims commit
without waiting for their WAL flush (``synchronous_commit = off`` on the claiming
connection), so a server crash can undo one, and the next claim of that job must not hand
the undone claim's token out again.

Row locks: statements that take job rows before updating them lock them FOR NO KEY UPDATE
(what an UPDATE of non-key columns takes anyway), never FOR UPDATE, so a row of the
application's that references a job (a foreign key takes FOR KEY SHARE on the job's row for
its transaction) does not hide the job from claims, heartbeats, rescues or cancels. Only the
pruner's DELETE takes FOR UPDATE.
"""

from __future__ import annotations

from typing import overload

from psycopg import sql

from ..channels import channel_name, due_channel_name
from . import admin, claim, cron, enqueue, maintenance, outcomes, results, schema, workers


def render(template: str, schema: str, **literals: object) -> sql.Composed:
    """Fill ``{schema}`` with the quoted schema name and any other placeholder with a literal.

    Args:
        template: SQL text with ``{schema}`` (and optional ``{name}``) placeholders; literal
            braces written doubled.
        schema: the schema name, quoted with ``psycopg.sql.Identifier``.
        literals: further placeholders, each rendered with ``psycopg.sql.Literal``.
    """
    values: dict[str, sql.Composable] = {k: sql.Literal(v) for k, v in literals.items()}
    return sql.SQL(template).format(schema=sql.Identifier(schema), **values)


class Statement:
    """One statement template as an attribute of ``Queries``: read on an instance, it is
    the template rendered for that instance's schema (UTF-8 ``bytes``), computed once."""

    def __init__(self, template: str) -> None:
        self.template = template
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Statement: ...

    @overload
    def __get__(self, obj: Queries, owner: type | None = None) -> bytes: ...

    def __get__(self, obj: Queries | None, owner: type | None = None) -> Statement | bytes:
        if obj is None:
            return self
        text = render(self.template, obj.schema, channel=obj.channel,
                      due_channel=obj.due_channel).as_string().encode()
        obj.__dict__[self.name] = text  # later reads find it on the instance
        return text


class Queries:
    """Every statement, rendered for one schema, each as UTF-8 encoded SQL text (``bytes``,
    which psycopg sends as is). The text is ASCII unless the schema name is not; such a name
    then needs connections with the UTF8 client encoding (PostgreSQL's default for UTF8
    databases).

    Args:
        schema: the PostgreSQL schema that holds skipjack's tables (an identifier; it is
            quoted, never interpolated).
    """

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.channel = channel_name(schema)
        self.due_channel = due_channel_name(schema)
        self._searches: dict[tuple[tuple[str, ...], str, bool, bool], bytes] = {}

    # enqueue
    ENQUEUE = Statement(enqueue.ENQUEUE)
    ENQUEUE_NO_KEYS = Statement(enqueue.ENQUEUE_NO_KEYS)
    ENQUEUE_ONE = Statement(enqueue.ENQUEUE_ONE)
    ENQUEUE_ONE_NO_KEYS = Statement(enqueue.ENQUEUE_ONE_NO_KEYS)
    EXISTING_KEYS = Statement(enqueue.EXISTING_KEYS)

    # claim (and what runs around a claim)
    CLAIM = Statement(claim.CLAIM)
    CLAIM_OLDEST = Statement(claim.CLAIM_OLDEST)
    CLAIM_IN_TRANSACTION = Statement(claim.CLAIM_IN_TRANSACTION)
    LOCK_QUEUE = Statement(claim.LOCK_QUEUE)
    CLAIM_LIMITED = Statement(claim.CLAIM_LIMITED)
    CLAIM_LIMITED_OLDEST = Statement(claim.CLAIM_LIMITED_OLDEST)
    HELD_BACK = Statement(claim.HELD_BACK)
    NO_WAIT_FOR_FLUSH = Statement(claim.NO_WAIT_FOR_FLUSH)
    LIMITED_QUEUES = Statement(claim.LIMITED_QUEUES)
    SERVER_TIMEOUTS = Statement(claim.SERVER_TIMEOUTS)
    LOAD_ARGS = Statement(claim.LOAD_ARGS)
    CLAIM_CANDIDATES = Statement(claim.CLAIM_CANDIDATES)
    CLAIM_CANDIDATES_OLDEST = Statement(claim.CLAIM_CANDIDATES_OLDEST)
    CLAIM_BY_ID = Statement(claim.CLAIM_BY_ID)
    COUNT_UNDONE_ATTEMPT = Statement(claim.COUNT_UNDONE_ATTEMPT)
    CLAIM_OPEN = Statement(claim.CLAIM_OPEN)
    TAKE_CLAIM_LOCK = Statement(claim.TAKE_CLAIM_LOCK)
    CLAIM_LOCK_AWAITED = Statement(claim.CLAIM_LOCK_AWAITED)
    END_OVERDUE_CLAIM = Statement(claim.END_OVERDUE_CLAIM)
    OVERDUE_LOCK_TIMEOUT = Statement(claim.OVERDUE_LOCK_TIMEOUT)
    NOTE_ERROR = Statement(claim.NOTE_ERROR)
    END_HANDLER_TRANSACTION = Statement(claim.END_HANDLER_TRANSACTION)

    # outcomes and lease renewal (fenced)
    RECORD_OUTCOMES = Statement(outcomes.RECORD_OUTCOMES)
    RECORD_MANY_OUTCOMES = Statement(outcomes.RECORD_MANY_OUTCOMES)
    HEARTBEAT = Statement(outcomes.HEARTBEAT)
    RECORD_PROGRESS = Statement(results.RECORD_PROGRESS)

    # waiting for an outcome
    MARK_AWAITED = Statement(results.MARK_AWAITED)
    JOB_OUTCOME = Statement(results.JOB_OUTCOME)

    # maintenance: stager, rescuer, pruner, the notification queue's watch, the analysis
    # after growth
    STAGE = Statement(maintenance.STAGE)
    STAGE_CANDIDATES = Statement(maintenance.STAGE_CANDIDATES)
    STAGE_ONE = Statement(maintenance.STAGE_ONE)
    NEXT_DUE = Statement(maintenance.NEXT_DUE)
    RESCUE_CANDIDATES = Statement(maintenance.RESCUE_CANDIDATES)
    RESCUE = Statement(maintenance.RESCUE)
    PRUNE = Statement(maintenance.PRUNE)
    PRUNE_CRON = Statement(maintenance.PRUNE_CRON)
    NOTIFY_QUEUES = Statement(maintenance.NOTIFY_QUEUES)
    NOTIFY_QUEUE_STATUS = Statement(maintenance.NOTIFY_QUEUE_STATUS)
    ROLLUP_THROUGHPUT = Statement(maintenance.ROLLUP_THROUGHPUT)
    PRUNE_THROUGHPUT = Statement(maintenance.PRUNE_THROUGHPUT)
    ANALYZE_CHECK = Statement(maintenance.ANALYZE_CHECK)
    ANALYZE_JOBS = Statement(maintenance.ANALYZE_JOBS)

    # operators
    STATS = Statement(admin.STATS)
    QUEUE_DEPTH = Statement(admin.QUEUE_DEPTH)
    QUEUE_GAUGES = Statement(admin.QUEUE_GAUGES)
    ESTIMATED_ROWS = Statement(admin.ESTIMATED_ROWS)
    OLDEST_RUNNABLE = Statement(admin.OLDEST_RUNNABLE)
    LIST_JOBS = Statement(admin.LIST_JOBS)
    GET_JOB = Statement(admin.GET_JOB)
    DISCARD_WAITING = Statement(admin.DISCARD_WAITING)
    CANCEL_WAITING = Statement(admin.CANCEL_WAITING)
    REQUEST_CANCEL = Statement(admin.REQUEST_CANCEL)
    CANCEL_PENDING = Statement(admin.CANCEL_PENDING)
    SET_PAUSED = Statement(admin.SET_PAUSED)
    SET_LIMITS = Statement(admin.SET_LIMITS)
    LIST_QUEUES = Statement(admin.LIST_QUEUES)
    NOTIFY_SETTINGS = Statement(admin.NOTIFY_SETTINGS)
    THROUGHPUT = Statement(admin.THROUGHPUT)
    THROUGHPUT_BY_QUEUE = Statement(admin.THROUGHPUT_BY_QUEUE)
    RUNNING_JOBS = Statement(admin.RUNNING_JOBS)
    SET_STATEMENT_TIMEOUT = Statement(admin.SET_STATEMENT_TIMEOUT)
    JOB_STATES = Statement(admin.JOB_STATES)
    RUNNABLE_NOW = Statement(admin.RUNNABLE_NOW)
    ENQUEUED = Statement(admin.ENQUEUED)
    STATES_IN_QUEUES = Statement(admin.STATES_IN_QUEUES)
    END_SCHEMA_SESSIONS = Statement(admin.END_SCHEMA_SESSIONS)

    def record_outcomes(self, count: int) -> bytes:
        """The statement that writes a batch of ``count`` outcomes: RECORD_OUTCOMES (rows
        looked up by primary key) up to ``outcomes.FEW_OUTCOMES``, else
        RECORD_MANY_OUTCOMES (see ``skipjack.sql.outcomes``)."""
        return self.RECORD_OUTCOMES if count <= outcomes.FEW_OUTCOMES \
            else self.RECORD_MANY_OUTCOMES

    @staticmethod
    def prepare_outcomes(count: int) -> bool | None:
        """psycopg's ``prepare`` argument for a batch of ``count`` outcomes: False (planned
        at each execution, for the table's size of the moment) from
        ``outcomes.PLANNED_OUTCOMES`` on, else None (prepared once run a few times); see
        ``skipjack.sql.outcomes``."""
        return False if count >= outcomes.PLANNED_OUTCOMES else None

    def job_search(self, conditions: tuple[str, ...], time: str = "created", *,
                   ids_only: bool = False, ascending: bool = False) -> bytes:
        """A job search (see ``skipjack.sql.admin.job_search``) rendered for this
        schema; each shape is rendered once."""
        key = (conditions, time, ids_only, ascending)
        text = self._searches.get(key)
        if text is None:
            template = admin.job_search(conditions, time, ids_only=ids_only,
                                        ascending=ascending)
            text = self._searches[key] = render(template, self.schema).as_string().encode()
        return text
    RETRY_DISCARDED = Statement(admin.RETRY_DISCARDED)

    # the live worker registry
    REGISTER_WORKER = Statement(workers.REGISTER_WORKER)
    UNREGISTER_WORKER = Statement(workers.UNREGISTER_WORKER)
    EXPIRE_WORKERS = Statement(workers.EXPIRE_WORKERS)
    LIST_WORKERS = Statement(workers.LIST_WORKERS)

    # cron
    CRON_LAST_SLOT = Statement(cron.CRON_LAST_SLOT)
    CRON_CLAIM_SLOT = Statement(cron.CRON_CLAIM_SLOT)
    CRON_SET_JOB = Statement(cron.CRON_SET_JOB)
    CRON_MISSED = Statement(cron.CRON_MISSED)
    CRON_LIST = Statement(cron.CRON_LIST)

    # schema
    DB_NOW = Statement(schema.DB_NOW)
    DB_EPOCH = Statement(schema.DB_EPOCH)
    DROP_SCHEMA = Statement(schema.DROP_SCHEMA)
    SCHEMA_VERSION = Statement(schema.SCHEMA_VERSION)
    SCHEMA_EXISTS = Statement(schema.SCHEMA_EXISTS)
    MIGRATION_LOCK = Statement(schema.MIGRATION_LOCK)
    SET_LOCK_TIMEOUT = Statement(schema.SET_LOCK_TIMEOUT)
    LOCK_HOLDERS = Statement(schema.LOCK_HOLDERS)
    CREATE_MIGRATIONS_TABLE = Statement(schema.CREATE_MIGRATIONS_TABLE)
    APPLIED_MIGRATIONS = Statement(schema.APPLIED_MIGRATIONS)
    RECORD_MIGRATION = Statement(schema.RECORD_MIGRATION)
    PROBE_NOTIFY = Statement(schema.PROBE_NOTIFY)
    PING = Statement(schema.PING)
