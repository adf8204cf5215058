"""Job actions of the dashboard and the command line: retry, cancel and discard, for a
selection of ids or for every job matching a filter, each through the same fenced and
validated method of ``skipjack.App`` the API offers, and an account of what each did
(or, in a dry run, would do), job by job.

A retry applies only to discarded jobs (``skipjack.App.retry_discarded_each``), a
discard only to waiting ones (``skipjack.App.discard``), a cancel to waiting and running
ones (``skipjack.App.cancel``); the others are left alone, and the account says why."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .admin import RetryResult
from .app import App
from .search import JobFilter

Action = Literal["retry", "cancel", "discard"]
ACTIONS: tuple[Action, ...] = ("retry", "cancel", "discard")

# The states each action may change; a filter's matches are read only in these.
ACTS_ON: dict[Action, tuple[str, ...]] = {
    "retry": ("discarded",),
    "cancel": ("scheduled", "available", "running"),
    "discard": ("scheduled", "available"),
}
PAST = {"retry": "retried", "cancel": "cancelled", "discard": "discarded"}

# Seconds a cancel keeps trying while workers' claims hold some of a batch's rows.
CANCEL_TIMEOUT = 5.0


@dataclass
class Account:
    """What an action did: ``done`` jobs changed (``requested`` of them, for a cancel, are
    running and were asked to stop), and the others left alone, counted by reason;
    ``outcomes`` says it per job id (the past participle, e.g. ``"retried"``, or why the job
    was left alone). A dry run's account (``preview``) says what would be done."""

    action: Action
    done: int = 0
    requested: int = 0
    left_alone: Counter[str] = field(default_factory=Counter)
    outcomes: dict[int, str] = field(default_factory=dict)
    dry_run: bool = False

    def add(self, other: Account) -> None:
        self.done += other.done
        self.requested += other.requested
        self.left_alone.update(other.left_alone)
        self.outcomes.update(other.outcomes)

    def _done(self, job_id: int, what: str | None = None) -> None:
        self.done += 1
        self.outcomes[job_id] = what or PAST[self.action]

    def _left(self, job_id: int, why: str, detail: str | None = None) -> None:
        self.left_alone[why] += 1
        self.outcomes[job_id] = f"left alone: {detail or why}"

    def describe(self) -> str:
        """One sentence, e.g. ``3 jobs retried; 2 left alone: 1 not discarded (succeeded),
        1 no such job.``"""
        verb = f"would be {PAST[self.action]}" if self.dry_run else PAST[self.action]
        done = f"{self.done} job{'s' if self.done != 1 else ''} {verb}"
        if self.action == "cancel" and self.requested:
            done += (f" ({self.requested} of them running: asked to stop at their next "
                     "heartbeat)")
        left = sum(self.left_alone.values())
        if not left:
            return done + "."
        reasons = ", ".join(f"{n} {why}s" if n > 1 and why == "no such job" else f"{n} {why}"
                            for why, n in sorted(self.left_alone.items(), key=lambda i: -i[1]))
        return f"{done}; {left} left alone: {reasons}."


def _why(state: tuple[str, bool] | None, action: Action) -> str:
    if state is None:
        return "no such job"
    name, cancel_requested = state
    if action == "cancel" and name == "running" and cancel_requested:
        return "already asked to stop"
    if action == "cancel" and name in ACTS_ON["cancel"]:
        return "held by a worker's open claim transaction"
    wants = {"retry": "not discarded", "cancel": "already finished",
             "discard": "not waiting"}[action]
    return f"{wants} ({name})"


def _retried(account: Account, results: list[RetryResult]) -> Account:
    """``account`` with the answers of ``App.retry_discarded_each``."""
    for result in results:
        if result.outcome == "retried":
            account._done(result.id, "would be retried" if account.dry_run else None)
        elif result.outcome == "key_held":
            account._left(result.id, "idempotency key held by another job",
                          result.describe().partition(" left alone: ")[2])
        elif result.outcome == "not_found":
            account._left(result.id, "no such job")
        else:
            account._left(result.id, f"not discarded ({result.state or 'changed meanwhile'})")
    return account


def apply(app: App, action: Action, ids: Sequence[int]) -> Account:
    """Run ``action`` on the jobs ``ids`` (at most ``skipjack.admin.BATCH`` is
    best; repeated ids count once).

    Raises:
        psycopg.Error: the database refused or could not be reached (a batch applied before
            stays applied).
    """
    asked = list(dict.fromkeys(ids))
    account = Account(action)
    if not asked:
        return account
    if action == "retry":
        return _retried(account, app.retry_discarded_each(asked))
    if action == "discard":
        moved = set(app.discard(asked))
        rest = [i for i in asked if i not in moved]
        states = app.job_states(rest) if rest else {}
        for job_id in asked:
            if job_id in moved:
                account._done(job_id)
            else:
                account._left(job_id, _why(states.get(job_id), action))
        return account
    before = app.job_states(asked)
    counts = app.cancel(asked, timeout=CANCEL_TIMEOUT)
    after = app.job_states(asked)
    for job_id in asked:
        was, now = before.get(job_id), after.get(job_id)
        if was is None or was[0] not in ACTS_ON["cancel"] or was == ("running", True):
            account._left(job_id, _why(was, action))
        elif now is not None and now[0] != "cancelled" and now != ("running", True):
            account._left(job_id, _why(now, action))  # finished meanwhile, or held
        elif now == ("running", True):
            account._done(job_id, "asked to stop (running)")
        else:
            account._done(job_id)
    account.requested = counts["requested"]
    return account


def preview(app: App, action: Action, ids: Sequence[int]) -> Account:
    """What ``apply`` would do to the jobs ``ids`` as they are now, changing nothing (a
    dry run; a job may change before a real run)."""
    asked = list(dict.fromkeys(ids))
    account = Account(action, dry_run=True)
    if action == "retry":  # the retry itself, rolled back: held keys are known exactly
        return _retried(account, app.retry_discarded_each(asked, dry_run=True) if asked
                        else [])
    states = app.job_states(asked) if asked else {}
    for job_id in asked:
        state = states.get(job_id)
        if state is not None and state[0] in ACTS_ON[action] and state != ("running", True):
            if action == "cancel" and state[0] == "running":
                account.requested += 1
                account._done(job_id, "would be asked to stop (running)")
            else:
                account._done(job_id, f"would be {PAST[action]}")
        else:
            account._left(job_id, _why(state, action))
    return account


def apply_matching(app: App, action: Action, where: JobFilter, *,
                   dry_run: bool = False) -> Account:
    """Run ``action`` on every job matching ``where`` in the states it applies to
    (``ACTS_ON``), a batch at a time; a filter naming another state matches none.
    ``dry_run``: only say what it would do (``preview``).

    Raises:
        ValidationError: a filter field out of range.
        psycopg.Error: as ``apply`` (the batches before stay applied).
    """
    account = Account(action, dry_run=dry_run)
    for state in _states(action, where):
        for ids in app.matching_ids(dataclasses.replace(where, state=state)):
            account.add(preview(app, action, ids) if dry_run else apply(app, action, ids))
    return account


def _states(action: Action, where: JobFilter) -> Iterable[str]:
    if where.state is None:
        return ACTS_ON[action]
    return (where.state,) if where.state in ACTS_ON[action] else ()
