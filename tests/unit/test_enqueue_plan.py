"""Unit: the enqueue planner (skipjack.enqueue): chunks, statements, and the resolution of
idempotency keys, driven by hand without a database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from skipjack import App, DuplicateJobError, JobSpec, ValidationError
from skipjack import enqueue as planner

APP = App("postgresql://unused", schema="unit")
Q = APP.queries
TASK = APP.task(name="unit.t", queue="q")(lambda **_: None)


def specs(n: int, key: str | None = None) -> list[JobSpec]:
    return [TASK.configure(idempotency_key=f"{key}{i}").job(i=i) if key else TASK.job(i=i)
            for i in range(n)]


def test_chunks_cut_at_the_job_count_and_at_the_args_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cut = [(len(c), more) for c, more in planner.chunks(specs(2_500))]
    assert cut == [(1000, True), (1000, True), (500, False)]
    monkeypatch.setattr(planner, "CHUNK_MAX_CHARS", 20)  # each job's args: 7 characters
    assert [len(c) for c, _ in planner.chunks(specs(7))] == [2, 2, 2, 1]


def test_an_item_that_is_not_a_spec_is_named_by_its_index() -> None:
    with pytest.raises(ValidationError, match=r"jobs\[2\]: must be a JobSpec \(from "
                                              r"Task.job\(\)\), got str 'oops': to enqueue a "
                                              r"task this code does not import, declare it by "
                                              r"its name on this app"):
        list(planner.chunks([*specs(2), "oops"]))  # type: ignore[list-item]
    with pytest.raises(ValidationError, match=r"jobs\[0\]: must be a JobSpec \(from "
                                              r"Task.job\(\)\), got dict$"):
        list(planner.chunks([{"task": "t"}]))  # type: ignore[list-item]


def test_one_job_is_one_plain_row_and_many_share_what_they_have_in_common() -> None:
    text, params = planner.insert_statement(Q, specs(1))
    assert text == Q.ENQUEUE_ONE_NO_KEYS and params["queue"] == "q" and params["args"] == '{"i":0}'
    text, params = planner.insert_statement(Q, [TASK.job(i=1), TASK.configure(priority=5).job()])
    assert text == Q.ENQUEUE_NO_KEYS
    assert (params["queue"], params["same_queue"]) == (None, "q")
    assert (params["priority"], params["same_priority"]) == ("{0,5}", None)
    assert params["args"] == '{"{\\"i\\":1}","{}"}'
    text, _ = planner.insert_statement(Q, specs(2, key="k"))
    assert text == Q.ENQUEUE


def test_a_plan_reads_a_generator_as_its_inserts_are_taken_unless_told_to_read_all() -> None:
    read: list[int] = []

    def gen() -> Iterator[JobSpec]:
        for i in range(1500):
            read.append(i)
            yield TASK.job(i=i)

    lazy = planner.Plan(Q, gen(), read_all=False)
    assert lazy.several and len(read) == 1001  # the first chunk, and one more to know
    assert len(list(lazy.inserts())) == 2 and len(read) == 1500 and len(lazy.specs) == 1500
    read.clear()
    eager = planner.Plan(Q, gen(), read_all=True)
    assert len(read) == 1500 and not planner.Plan(Q, [], read_all=True).several
    assert planner.Plan(Q, iter([]), read_all=False).empty and not eager.empty


def drive(plan: planner.Plan, rows: list[tuple[int, str | None]],
          answers: list[list[tuple[int, str | None]]]) -> tuple[list[int], list[bytes]]:
    """Run the key resolution with canned rows for each statement it asks for."""
    asked: list[bytes] = []
    resolution = plan.resolve_ids(list(rows))
    try:
        statement = next(resolution)
        while True:
            asked.append(statement[0])
            statement = resolution.send(list(answers.pop(0)))
    except StopIteration as done:
        return done.value, asked


def test_ids_come_back_in_input_order() -> None:
    plan = planner.Plan(Q, specs(3), read_all=True)
    list(plan.inserts())
    assert drive(plan, [(12, None), (10, None), (11, None)], []) == ([10, 11, 12], [])


def test_a_key_held_by_another_job_gets_that_jobs_id() -> None:
    keyed = [TASK.job(i=0), TASK.configure(idempotency_key="a").job(), TASK.job(i=2)]
    plan = planner.Plan(Q, keyed, read_all=True)
    list(plan.inserts())
    ids, asked = drive(plan, [(21, None), (22, None)], [[(5, "a")]])
    assert ids == [21, 5, 22] and asked == [Q.EXISTING_KEYS]


def test_a_key_freed_meanwhile_is_inserted_anew_and_one_never_seen_is_refused() -> None:
    plan = planner.Plan(Q, specs(1, key="k"), read_all=True)
    list(plan.inserts())
    ids, asked = drive(plan, [], [[], [(30, "k0")]])  # not held, so inserted again
    assert ids == [30] and asked == [Q.EXISTING_KEYS, Q.ENQUEUE_ONE]
    plan = planner.Plan(Q, specs(1, key="k"), read_all=True)
    list(plan.inserts())
    with pytest.raises(DuplicateJobError, match="'k0'"):
        drive(plan, [], [[], []] * planner.KEY_ROUNDS)


def test_positional_only_parameters_can_never_be_given() -> None:
    from skipjack.jobs import HandlerArguments

    def handler(a: int, /, **kw: object) -> None: ...

    spec = HandlerArguments.of(handler)
    assert spec is not None
    assert "positional-only" in (spec.mismatch({"a": 1}) or "")
