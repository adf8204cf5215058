"""Hooks: code of the application's (error reporting, metrics, tracing, tenancy context) that
runs around each enqueue and each job's execution, without forking skipjack.

Subclass ``Hook``, override what you need, and register it with
``skipjack.App.add_hook`` (or ``App(hooks=[...])``)::

    class Tenancy(skipjack.Hook):
        def enqueue(self, call):
            call.metadata["tenant"] = current_tenant()      # stored with every job of the call
            return None

        def run(self, job):
            return tenant_context(job.metadata["tenant"])   # entered around the handler

        def ended(self, attempt):
            if attempt.outcome == "discarded":
                report(attempt.error)

Three points of a job's life:

- ``Hook.enqueue``, in the enqueuing thread, around the statements that write the jobs
  of one ``enqueue``/``enqueue_many`` call (inside the caller's transaction when it gave
  ``conn=``). It may add text entries to ``EnqueueCall.metadata``; they are stored with
  every job of the call and come back as ``skipjack.Job.metadata`` in the worker.
- ``Hook.run``, around one attempt of a handler, entered and exited where the handler runs:
  in its thread for a sync handler, in its asyncio task for an ``async def`` one, so context
  variables it sets (a span made current, a logging context, a tenant) are the handler's. The
  same hook serves sync and async handlers. It sees the handler's exception on exit.
- ``Hook.ended``, once per attempt after its outcome was recorded (or refused, or not
  written because the worker lost the lease), with the ``Attempt``: the job, what became
  of it, how long the handler ran, its exception and when the job runs again. It runs on
  the worker's event loop thread: it must return quickly and never block.

A hook can never lose a job or its outcome: whatever a hook method raises (``Exception``) is
logged (at most once a minute per hook and method, on the ``skipjack.hooks`` logger) and the
enqueue, the handler or the recording goes on without that hook. A ``run`` context manager
cannot swallow the handler's exception either: what the handler raised decides the outcome.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from .context import Job
from .jobs import JobSpec

log = logging.getLogger("skipjack.hooks")

# What became of an attempt (see Attempt).
AttemptOutcome = Literal["succeeded", "retried", "discarded", "cancelled", "snoozed",
                         "released", "lost", "stale"]

# Seconds between two logs of the failures of one hook's method.
FAILURE_LOG_EVERY = 60.0


@dataclass
class EnqueueCall:
    """One ``enqueue``/``enqueue_many`` call, as ``Hook.enqueue`` sees it.

    Attributes:
        jobs: the specs written so far, in input order (an iterable is read as its jobs are
            written, so the list is complete only when the hook's context exits).
        in_transaction: whether the caller gave ``conn=``: the jobs then commit (or roll
            back) with the caller's transaction, after the hook's context exited.
        metadata: text entries stored with every job of the call (``str`` to ``str``; at most
            64 entries of 1,024 characters each), e.g. a W3C ``traceparent``.
        ids: the job ids in input order, set once the statements succeeded (before the
            context exits); None while they run, or when they failed.
        inserted: the ids of the jobs this call created; the others' idempotency keys
            matched jobs that already existed.
    """

    jobs: list[JobSpec]
    in_transaction: bool
    metadata: dict[str, str] = field(default_factory=dict)
    ids: list[int] | None = None
    inserted: frozenset[int] = frozenset()


@dataclass(slots=True)
class Attempt:
    """What became of one attempt of a job, as ``Hook.ended`` sees it.

    Attributes:
        job: the job as claimed (its ``attempt`` is this attempt's number, from 1).
        outcome: ``succeeded``; ``retried`` (failed, runnable again at ``run_at``);
            ``discarded`` (failed for the last time, or ``skipjack.Discard``: the dead
            letter); ``cancelled``; ``snoozed`` (``skipjack.Snooze``, runnable again at
            ``run_at``, the attempt not counted); ``released`` (given back without counting
            the attempt: the worker stopped, the task is unknown to it, or its own
            transaction lost the database); ``lost`` (the worker lost the job's lease:
            nothing was written, another claim owns the job); ``stale`` (the outcome was
            refused by fencing, for the same reason).
        duration: seconds the handler ran (monotonic clock); None when it never started (a
            prefetched job released at shutdown, or cancelled while it waited).
        error: the exception the handler raised (or a ``TimeoutError`` past the task's
            timeout), else None.
        run_at: when a retried, snoozed or released job becomes runnable again (database
            clock, UTC), else None.
    """

    job: Job
    outcome: AttemptOutcome
    duration: float | None = None
    error: BaseException | None = None
    run_at: datetime | None = None

    @property
    def failed(self) -> bool:
        """Whether the handler failed: it raised (other than Snooze) or timed out, and the
        job was retried or discarded for it."""
        return self.error is not None and self.outcome in ("retried", "discarded")


class Hook:
    """Code run around enqueues and executions; override any of the three methods (the
    defaults do nothing). See ``skipjack.hooks``."""

    def enqueue(self, call: EnqueueCall) -> AbstractContextManager[object] | None:
        """Called before the jobs of ``call`` are written; return a context manager to be
        entered around the writing (its exit sees ``call.ids`` on success, or the
        exception), or None."""
        return None

    def run(self, job: Job) -> AbstractContextManager[object] | None:
        """Called as an attempt of ``job`` starts, where its handler runs; return a context
        manager to be entered around the handler call, or None."""
        return None

    def ended(self, attempt: Attempt) -> None:
        """Called once per attempt after its outcome was recorded (on the worker's event loop:
        return quickly)."""


METADATA_MAX_ENTRIES = 64
METADATA_MAX_CHARS = 1024

Entered = list[tuple[Hook, AbstractContextManager[object]]]


def _storable(text: str) -> bool:
    """Whether PostgreSQL can store ``text`` in jsonb: no NUL, valid UTF-8 (no lone
    surrogates)."""
    if "\x00" in text:
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class Hooks:
    """The hooks of one app, and the one place that calls them, each call guarded so that a
    hook that raises is logged and skipped (see ``skipjack.hooks``)."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self._all: list[Hook] = []
        self._enqueue: list[Hook] = []
        self._run: list[Hook] = []
        self._ended: list[Hook] = []
        self._failures: dict[tuple[int, str], float] = {}  # (hook id, method) -> last logged
        # whether any hook runs around enqueues, around handlers, after attempts (plain
        # attributes: read for every job)
        self.on_enqueue = self.on_run = self.on_ended = False
        for hook in hooks:
            self.add(hook)

    def add(self, hook: Hook) -> None:
        """Register ``hook`` (a ``Hook``); the methods it overrides are called from now
        on, after those of hooks registered before it.

        Raises:
            TypeError: ``hook`` is not a ``Hook``.
        """
        if not isinstance(hook, Hook):
            raise TypeError(f"hooks: a skipjack.Hook is needed, got {type(hook).__name__}")
        self._all.append(hook)
        kind = type(hook)
        if kind.enqueue is not Hook.enqueue:
            self._enqueue.append(hook)
            self.on_enqueue = True
        if kind.run is not Hook.run:
            self._run.append(hook)
            self.on_run = True
        if kind.ended is not Hook.ended:
            self._ended.append(hook)
            self.on_ended = True

    def __iter__(self) -> Iterator[Hook]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    # --- enqueue ---------------------------------------------------------------------------

    def around_enqueue(self, jobs: list[JobSpec],
                       in_transaction: bool) -> AbstractContextManager[EnqueueCall | None]:
        """A context manager around the writing of one enqueue call's jobs (``jobs``: the
        list its plan fills as it writes them): it yields the ``EnqueueCall`` that the
        hooks see (the caller sets its ``ids`` and ``inserted`` on success), or None when no
        hook has ``enqueue`` (nothing to do)."""
        if not self._enqueue:
            return nullcontext(None)
        return self._around_enqueue(EnqueueCall(jobs, in_transaction))

    @contextmanager
    def _around_enqueue(self, call: EnqueueCall) -> Iterator[EnqueueCall]:
        entered = self._enter(self._enqueue, "enqueue", call)
        try:
            yield call
        except BaseException as exc:
            self.exit(entered, exc, "enqueue")
            raise
        self.exit(entered, None, "enqueue")

    def exit(self, entered: Entered, exc: BaseException | None, method: str) -> None:
        """Exit the entered context managers, last first, with ``exc`` (or none); what they
        raise is logged, what they return is ignored (they cannot swallow ``exc``)."""
        for hook, cm in reversed(entered):
            try:
                cm.__exit__(type(exc) if exc is not None else None, exc,
                            exc.__traceback__ if exc is not None else None)
            except BaseException as raised:
                if method == "enqueue" and not isinstance(raised, Exception):
                    raise  # KeyboardInterrupt in the enqueuing process is the caller's
                self._failed(hook, method)

    def metadata_json(self, call: EnqueueCall) -> str | None:
        """The call's metadata as JSON text for the jobs' ``metadata`` column, or None when
        there is none. Entries that are not text, or past the limits, are left out (and the
        hook's mistake logged): the jobs are written without them."""
        metadata = call.metadata
        if not metadata:
            return None
        if not isinstance(metadata, dict):
            self._warn_once(("metadata", ""), "enqueue metadata left out: call.metadata must "
                            "stay a dict of text, got %s", type(metadata).__name__)
            return None
        kept: dict[str, str] = {}
        dropped: list[str] = []
        for key, value in metadata.items():
            if (isinstance(key, str) and isinstance(value, str) and len(kept)
                    < METADATA_MAX_ENTRIES and len(key) <= METADATA_MAX_CHARS
                    and len(value) <= METADATA_MAX_CHARS and _storable(key + value)):
                kept[key] = value
            else:
                dropped.append(repr(key)[:80])
        if dropped:
            self._warn_once(("metadata", ""), "enqueue metadata %s left out: entries must be "
                            "text without NUL or lone surrogates, at most %d of %d characters "
                            "each (said at most once a minute)", ", ".join(dropped[:5]),
                            METADATA_MAX_ENTRIES, METADATA_MAX_CHARS)
        return json.dumps(kept, ensure_ascii=False) if kept else None

    # --- run -------------------------------------------------------------------------------

    def wrap(self, job: Job, fn: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
        """``fn`` (the handler) with every hook's ``run`` context entered around each call:
        a coroutine function when ``is_async``; ``fn`` itself when no hook has ``run``."""
        if not self._run:
            return fn
        if is_async:
            async def hooked_async(**kwargs: Any) -> Any:
                entered = self._enter_run(job)
                try:
                    result = await fn(**kwargs)
                except BaseException as exc:
                    self.exit(entered, exc, "run")
                    raise
                self.exit(entered, None, "run")
                return result

            return hooked_async

        def hooked(**kwargs: Any) -> Any:
            entered = self._enter_run(job)
            try:
                result = fn(**kwargs)
            except BaseException as exc:
                self.exit(entered, exc, "run")
                raise
            self.exit(entered, None, "run")
            return result

        return hooked

    def _enter_run(self, job: Job) -> Entered:
        return self._enter(self._run, "run", job)

    def _enter(self, hooks: list[Hook], method: str, arg: object) -> Entered:
        """Call ``method`` of each of ``hooks`` with ``arg`` and enter the context managers
        they return. What a hook raises is logged and that hook skipped: any exception in
        the worker (``run``), where nothing of a hook's may end it; an ``Exception`` in the
        enqueuing process, whose KeyboardInterrupt is the caller's."""
        caught = BaseException if method == "run" else Exception
        entered: Entered = []
        for hook in hooks:
            try:
                cm = getattr(hook, method)(arg)
                if cm is not None:
                    cm.__enter__()
                    entered.append((hook, cm))
            except caught:
                self._failed(hook, method)
        return entered

    # --- ended -----------------------------------------------------------------------------

    def ended(self, attempt: Attempt) -> None:
        """Call every hook's ``ended`` with ``attempt`` (on the worker's event loop: even a
        ``BaseException`` such as SystemExit from a hook is contained)."""
        for hook in self._ended:
            try:
                hook.ended(attempt)
            except BaseException:
                self._failed(hook, "ended")

    # --- failures --------------------------------------------------------------------------

    def _failed(self, hook: Hook, method: str) -> None:
        """Log the exception being handled, from ``hook.method``, at most once a minute."""
        self._warn_once((id(hook), method), "hook %s.%s failed; going on without it (said at "
                        "most once a minute per hook)", type(hook).__name__, method,
                        exc_info=True)

    def _warn_once(self, key: tuple[Any, str], message: str, *args: Any,
                   exc_info: bool = False) -> None:
        now = time.monotonic()
        last = self._failures.get(key)
        if last is None or now - last >= FAILURE_LOG_EVERY:
            self._failures[key] = now
            log.error(message, *args, exc_info=exc_info)
