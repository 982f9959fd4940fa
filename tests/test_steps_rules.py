"""Durable steps without processes: the daemon's rules (supervisor.core.steps)
and the worker's replay (session_worker.worker.steps) over a fake link."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable
from typing import Any

import msgspec
import pytest

from ipc import messages as m
from ipc.settings import SessionSettings
from session_worker.errors import StepError
from session_worker.worker.steps import Interruption, TurnSteps
from supervisor.store.state_store import Step, StepRecord, StepStart
from supervisor.core.steps import MAX_STEPS_IN_FLIGHT, cause_of, plan_resume, resumes_after, step_problem

SETTINGS = msgspec.convert({"agent": {"limits": {"max_memory_mb": 64},
                                      "worker": {"max_step_kb": 1, "max_turn_steps_mb": 1}}},
                           SessionSettings)


@pytest.mark.pure
@pytest.mark.parametrize("reason,signal,detail,cause", [
    ("killed_memory", 9, "memory cap 64 MiB exceeded at 70 MiB", "memory cap of 64 MiB reached"),
    ("crashed", 9, "", "the worker crashed (signal SIGKILL)"),
    ("crashed", None, "", "the worker crashed (exit code 3)"),
    ("node_lost", 9, "lost the node host on 10.0.0.7 (ActorDiedError)",
     "the worker was lost with its node (lost the node host on 10.0.0.7 (ActorDiedError))"),
    ("killed_heartbeat", 9, "", "the worker stopped answering (missed heartbeats) and was killed"),
])
def test_the_cause_a_handler_is_told(reason: str, signal: int | None, detail: str, cause: str) -> None:
    info = m.ExitInfo(reason=reason, signal=signal, code=None if signal else 3, detail=detail)
    assert cause_of(info, SETTINGS) == cause


@pytest.mark.pure
def test_which_deaths_a_turn_resumes_after() -> None:
    assert resumes_after(SETTINGS, m.ExitInfo(reason="killed_memory"))
    assert not resumes_after(SETTINGS, m.ExitInfo(reason="killed_turn_timeout"))
    assert not resumes_after(SETTINGS, m.ExitInfo(reason="stopped"))
    off = msgspec.convert({"agent": {"worker": {"retry_aborted_turn": False}}}, SessionSettings)
    assert not resumes_after(off, m.ExitInfo(reason="crashed"))


@pytest.mark.pure
def test_a_step_is_journaled_within_its_turn_number_and_caps() -> None:
    def done(n: int, size: int = 10, turn: int = 2, key: str = "") -> m.StepDone:
        return m.StepDone(turn=turn, n=n, key=key or f"k{n}", result=b"x" * size)

    flying = {1: "k1"}
    # Steps end in any order: by number, not by position.
    assert step_problem(SETTINGS, 2, 1, flying, done(1)) == ""
    assert step_problem(SETTINGS, 2, 1, flying, done(7)) == ""  # (an interrupted step's answer: no start)
    assert "began as 'k1' and ended as 'other'" in step_problem(SETTINGS, 2, 1, flying, done(1, key="other"))
    assert "out of range" in step_problem(SETTINGS, 2, 1, flying, done(-1))
    assert "out of range" in step_problem(SETTINGS, 2, 1, flying, done(1 << 31))
    assert "turn 3" in step_problem(SETTINGS, 2, 1, flying, done(1, turn=3))
    assert "agent.worker.max_step_kb = 1" in step_problem(SETTINGS, 2, 1, flying, done(1, size=2000))
    assert "max_turn_steps_mb = 1" in step_problem(SETTINGS, 2, (1 << 20) - 5, flying, done(1))
    # A handler is untrusted for size: its keys, and a flood of empty steps or starts.
    assert "too long" in step_problem(SETTINGS, 2, 1, flying, m.StepDone(turn=2, n=1, key="k" * 100_000))
    assert "max_turn_steps_mb = 1" in step_problem(SETTINGS, 2, (1 << 20) - 32, flying,
                                                   m.StepDone(turn=2, n=2, key="k"))
    assert "max_turn_steps_mb = 1" in step_problem(SETTINGS, 2, (1 << 20) - 32, {},
                                                   m.StepBegun(turn=2, n=1, key="k"))
    # ... and for how many steps it keeps in flight.
    assert step_problem(SETTINGS, 2, 1, flying, m.StepBegun(turn=2, n=2, key="k2")) == ""
    assert "began twice" in step_problem(SETTINGS, 2, 1, flying, m.StepBegun(turn=2, n=1, key="k1"))
    full = {n: "k" for n in range(MAX_STEPS_IN_FLIGHT)}
    assert f"more than {MAX_STEPS_IN_FLIGHT} steps in flight" in step_problem(
        SETTINGS, 2, 1, full, m.StepBegun(turn=2, n=MAX_STEPS_IN_FLIGHT, key="k"))


class Link:
    """The daemon's side for TurnSteps: journals and answers at once."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.steps: TurnSteps | None = None

    def send(self, msg: Any) -> None:
        self.sent.append(msg)
        if isinstance(msg, m.StepDone):
            asyncio.get_running_loop().call_soon(self.steps.saved, m.StepSaved(turn=msg.turn, n=msg.n))

    def flush(self) -> None:
        pass


def _steps(link: Link, resumed: m.Resumed | None = None) -> TurnSteps:
    link.steps = TurnSteps(1, link.send, link.flush, resumed, 1 << 20, 1 << 30)
    return link.steps


@pytest.mark.component
def test_a_resumed_turn_replays_its_steps_and_answers_the_one_in_flight() -> None:
    ran: list[str] = []

    async def first_run() -> list[bytes]:
        link = Link()
        steps = _steps(link)
        assert await steps.step("a", lambda: ran.append("a") or ("A", 1)) == ["A", 1]  # msgpack's types
        await steps.durable()
        return [s.result for s in link.sent if isinstance(s, m.StepDone)]

    journal = asyncio.run(first_run())
    resumed = m.Resumed(reason="killed_memory", cause="memory cap of 64 MiB reached", step=1, running="b",
                        steps=[m.StepResult(key="a", result=journal[0])])

    async def second_run() -> tuple[Any, Any, list[Any]]:
        link = Link()
        steps = _steps(link, resumed)
        a = await steps.step("a", lambda: ran.append("a again"))
        b = await steps.step("b", lambda: ran.append("b"), interrupted=lambda why: f"killed: {why.cause}")
        return a, b, link.sent

    a, b, sent = asyncio.run(second_run())
    assert a == ["A", 1] and b == "killed: memory cap of 64 MiB reached"
    assert ran == ["a"]  # neither the journaled step nor the one in flight ran again
    assert [type(x).__name__ for x in sent] == ["StepDone"]  # the answer is journaled; nothing began
    assert _steps(Link(), resumed).interruption == Interruption(
        reason="killed_memory", cause="memory cap of 64 MiB reached", key="b", step=1)


@pytest.mark.component
def test_a_resumed_turn_that_asks_for_other_steps_fails() -> None:
    resumed = m.Resumed(reason="crashed", cause="c", step=1, steps=[m.StepResult(key="a", result=b"\x01")])

    async def run() -> None:
        await _steps(Link(), resumed).step("not-a", lambda: 1)

    with pytest.raises(StepError, match="step 0 'not-a'.*journaled is 'a'"):
        asyncio.run(run())


@pytest.mark.component
def test_a_step_that_acts_waits_for_the_steps_before_it_and_a_refusal_fails_the_next() -> None:
    async def run() -> list[str]:
        order: list[str] = []
        answers: list[m.StepSaved] = []

        def send(msg: Any) -> None:
            order.append(type(msg).__name__)
            if isinstance(msg, m.StepDone):
                answers.append(m.StepSaved(turn=1, n=msg.n, error="too big" if msg.n == 2 else ""))

        steps = TurnSteps(1, send, lambda: None, None, 1 << 20, 1 << 30)
        await steps.step("llm", lambda: 1, idempotent=True)  # returns at once
        task = asyncio.ensure_future(steps.step("tool", lambda: order.append("tool ran"), wait=False))
        await asyncio.sleep(0)
        assert "tool ran" not in order  # waiting for the LLM step's flush
        steps.saved(answers.pop(0))
        await task  # (wait=False: returned before its own flush)
        default = asyncio.ensure_future(steps.step("plain", lambda: 3))
        await asyncio.sleep(0)
        steps.saved(answers.pop(0))  # the tool's
        for _ in range(5):  # (a few passes of the loop: the barrier's gather, then fn)
            await asyncio.sleep(0)
        assert not default.done()  # a plain step returns once its own result is durable
        steps.saved(answers.pop(0))  # refused
        with pytest.raises(StepError, match="step 2 was not saved: too big"):
            await default
        return order

    assert asyncio.run(run()) == ["StepBegun", "StepDone", "StepBegun", "tool ran", "StepDone",
                                  "StepBegun", "StepDone"]


# ---------------------------------------------------------------- steps that overlap


class Journal:
    """The daemon's side for TurnSteps, as records: every start and end is
    appended as it arrives (supervisor.core.ledger), and answered (StepSaved)
    at the next `flush()`, which also makes everything so far durable."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.durable = 0  # records[:durable] survive a power loss
        self.sent: list[Any] = []
        self._answers: list[m.StepSaved] = []
        self.steps: TurnSteps | None = None

    def send(self, msg: Any) -> None:
        self.sent.append(msg)
        if isinstance(msg, m.StepBegun):
            self.records.append(StepStart(turn=msg.turn, n=msg.n, key=msg.key))
            if msg.durable:
                self._answers.append(m.StepSaved(turn=msg.turn, n=msg.n, begun=True))
        elif isinstance(msg, m.StepDone):
            self.records.append(Step(turn=msg.turn, n=msg.n, key=msg.key, result=msg.result, failed=msg.failed))
            if not msg.failed:
                self._answers.append(m.StepSaved(turn=msg.turn, n=msg.n))

    def flush(self) -> None:
        self.durable = len(self.records)
        answers, self._answers = self._answers, []
        assert self.steps is not None
        for answer in answers:
            self.steps.saved(answer)

    def begun(self) -> list[tuple[int, bool]]:
        return [(x.n, x.durable) for x in self.sent if isinstance(x, m.StepBegun)]


async def _passes(n: int = 20) -> None:
    """A few passes of the loop (tasks started, futures' callbacks run)."""
    for _ in range(n):
        await asyncio.sleep(0)


def _turn(journal: Journal, resumed: m.Resumed | None = None) -> TurnSteps:
    journal.steps = TurnSteps(1, journal.send, lambda: None, resumed, 1 << 20, 1 << 30)
    return journal.steps


class Three:
    """A handler's turn: three steps at once (asyncio.gather), each one's
    function waiting for its gate, each answered `x<i>` when it was in
    flight at a death; it records what ran and what was answered."""

    def __init__(self, steps: TurnSteps, open_gates: bool = False) -> None:
        self.steps = steps
        self.gates = [asyncio.Event() for _ in range(3)]
        if open_gates:
            for g in self.gates:
                g.set()
        self.ran: list[int] = []
        self.answered: list[tuple[int, Interruption]] = []

    async def _work(self, i: int) -> str:
        self.ran.append(i)
        await self.gates[i].wait()
        return f"v{i}"

    def _interrupted(self, i: int, why: Interruption) -> str:
        self.answered.append((i, why))
        return f"x{i}"

    async def turn(self) -> list[Any]:
        return list(await asyncio.gather(*(
            self.steps.step(f"k{i}", lambda i=i: self._work(i), interrupted=lambda why, i=i: self._interrupted(i, why))
            for i in range(3))))


@pytest.mark.component
def test_three_steps_at_once_that_end_in_reverse_order_are_known_by_the_order_they_started() -> None:
    async def run() -> tuple[list[Any], Journal, Three]:
        journal = Journal()
        three = Three(_turn(journal))
        turn = asyncio.ensure_future(three.turn())
        await _passes()
        # Step 0 started alone: it runs at once, its start carried by a later
        # flush; 1 and 2 overlap it, so each waits for its own start to be durable.
        assert journal.begun() == [(0, False), (1, True), (2, True)] and three.ran == [0]
        journal.flush()
        await _passes()
        assert three.ran == [0, 1, 2]
        for i in (2, 1, 0):
            three.gates[i].set()
            await _passes()
            journal.flush()
            await _passes()
        return await turn, journal, three

    values, journal, three = asyncio.run(run())
    assert values == ["v0", "v1", "v2"] and three.ran == [0, 1, 2]
    assert [(r.n, type(r).__name__) for r in journal.records] == [
        (0, "StepStart"), (1, "StepStart"), (2, "StepStart"), (2, "Step"), (1, "Step"), (0, "Step")]
    # Replayed by number, whatever order they ended in: nothing runs again.
    plan = plan_resume(journal.records)
    assert [s.n for s in plan.steps] == [0, 1, 2] and plan.in_flight == [] and plan.step == 3

    async def again() -> tuple[list[Any], Three]:
        replay = Three(_turn(Journal(), plan.resumed("crashed", "c", False)), open_gates=True)
        return await replay.turn(), replay

    values, replay = asyncio.run(again())
    assert values == ["v0", "v1", "v2"] and replay.ran == [] and replay.answered == []


def _first_run(order: tuple[int, ...], ended: int, flushed: bool = True) -> tuple[list[StepRecord], int, set[int]]:
    """Three steps at once; the ones in `order[:ended]` end, then the worker
    dies: the records the daemon has, how many of them are durable, what
    ran.  `flushed` False: the daemon never flushed the starts."""

    async def run() -> tuple[list[StepRecord], int, set[int]]:
        journal = Journal()
        three = Three(_turn(journal))
        turn = asyncio.ensure_future(three.turn())
        await _passes()
        if flushed:
            journal.flush()
            await _passes()
        for i in order[:ended]:
            three.gates[i].set()
            await _passes()
        records, durable, ran = list(journal.records), journal.durable, set(three.ran)
        turn.cancel()  # (after the snapshot: a killed worker sends nothing more)
        with contextlib.suppress(asyncio.CancelledError):
            await turn
        return records, durable, ran

    return asyncio.run(run())


def _resumed_run(plan_of: list[StepRecord], uncertain: bool) -> tuple[list[Any], Three, Journal]:
    resumed = plan_resume(plan_of).resumed("daemon_stopped" if uncertain else "crashed", "c", uncertain)

    async def run() -> tuple[list[Any], Three, Journal]:
        journal = Journal()
        three = Three(_turn(journal, resumed), open_gates=True)
        turn = asyncio.ensure_future(three.turn())
        for _ in range(10):
            await _passes()
            journal.flush()
        return await turn, three, journal

    return asyncio.run(run())


@pytest.mark.component
@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
@pytest.mark.parametrize("ended", range(4))
def test_after_a_worker_death_no_step_that_ended_runs_again_and_each_in_flight_is_answered(
        order: tuple[int, ...], ended: int) -> None:
    records, _, ran = _first_run(order, ended)
    assert ran == {0, 1, 2}
    done = set(order[:ended])
    values, three, journal = _resumed_run(records, uncertain=False)
    assert values == [f"v{i}" if i in done else f"x{i}" for i in range(3)]
    assert three.ran == []  # nothing ran twice: the ended ones replayed, the rest answered
    assert sorted(i for i, _ in three.answered) == sorted(set(range(3)) - done)
    assert all(why.certain and why.reason == "crashed" for _, why in three.answered)
    # The answers are journaled: a second death now replays them too.
    again, three2, _ = _resumed_run(records + journal.records, uncertain=False)
    assert again == values and three2.ran == [] and three2.answered == []


@pytest.mark.component
@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
@pytest.mark.parametrize("ended", range(4))
@pytest.mark.parametrize("lost", [False, True])
def test_after_a_daemon_death_no_step_that_may_have_run_runs_again(
        order: tuple[int, ...], ended: int, lost: bool) -> None:
    """The daemon died: what it had appended survives a SIGKILL (`lost`
    False) or only what was flushed (True, a power loss).  A step that
    may have begun is answered (uncertain), never run a second time."""
    records, durable, ran = _first_run(order, ended)
    kept = records[:durable] if lost else records
    values, three, _ = _resumed_run(kept, uncertain=True)
    ended_kept = {r.n for r in kept if isinstance(r, Step)}
    assert values == [f"v{i}" if i in ended_kept else f"x{i}" for i in range(3)]
    assert not set(three.ran) & ran
    assert all(not why.certain for _, why in three.answered)


@pytest.mark.component
@pytest.mark.parametrize("lost", [False, True])
def test_a_death_before_the_overlapping_starts_were_durable(lost: bool) -> None:
    """Steps 1 and 2 wait for their starts to be durable, and never ran;
    step 0 started alone, ran and ended, nothing flushed.  Lost: step 0 is
    the one the resumed turn is unsure of (answered), 1 and 2 run.  Kept:
    step 0 replays; the starts of 1 and 2 say they may have begun: answered,
    never run (a step is never run twice; one may go unrun)."""
    records, durable, ran = _first_run((0, 1, 2), 1, flushed=False)
    assert ran == {0} and durable == 0
    values, three, _ = _resumed_run(records[:durable] if lost else records, uncertain=True)
    assert 0 not in three.ran
    assert values == (["x0", "v1", "v2"] if lost else ["v0", "x1", "x2"])


@pytest.mark.component
def test_a_step_alone_whose_start_was_lost_is_the_one_a_resumed_turn_is_unsure_of() -> None:
    """Sequential steps (the usual turn) cost no flush of their starts: the
    first step not journaled is the one that may have begun."""
    journal = Journal()

    async def run() -> None:
        steps = _turn(journal)
        assert await asyncio.wait_for(asyncio.shield(_settled(journal, steps.step("a", lambda: "A"))), 5) == "A"
        task = asyncio.ensure_future(steps.step("b", lambda: asyncio.sleep(3600)))
        await _passes()
        assert journal.begun() == [(0, False), (1, False)]  # alone each time
        task.cancel()

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(run())
    kept = journal.records[:journal.durable]  # b's start was never flushed
    plan = plan_resume(kept)
    assert plan.step == 1 and plan.in_flight == []
    answered: list[Interruption] = []

    async def again() -> Any:
        second = Journal()
        steps = _turn(second, plan.resumed("daemon_stopped", "the daemon stopped", True))
        assert await steps.step("a", lambda: "ran again") == "A"
        return await _settled(second, steps.step("b", lambda: "ran again",
                                                 interrupted=lambda why: answered.append(why) or "unsure"))

    assert asyncio.run(again()) == "unsure"
    assert answered == [Interruption(reason="daemon_stopped", cause="the daemon stopped", key="b", certain=False,
                                     step=1)]


async def _settled(journal: Journal, step: Awaitable[Any]) -> Any:
    task = asyncio.ensure_future(step)
    while not task.done():
        await _passes(2)
        journal.flush()
    return await task


@pytest.mark.component
def test_a_step_waits_for_the_steps_ended_before_it_started_not_for_those_in_flight() -> None:
    async def run() -> list[str]:
        journal = Journal()
        steps = _turn(journal)
        order: list[str] = []
        slow = asyncio.Event()

        async def long() -> str:
            order.append("long ran")
            await slow.wait()
            return "L"

        first = asyncio.ensure_future(steps.step("long", long))
        await _passes()
        assert await _settled(journal, steps.step("quick", lambda: order.append("quick ran") or "Q",
                                                 wait=False)) == "Q"
        # `quick` ended, not durable (wait=False): a step started now waits for it ...
        third = asyncio.ensure_future(steps.step("after", lambda: order.append("after ran")))
        await _passes()
        assert "after ran" not in order
        journal.flush()
        await _passes()
        assert "after ran" in order  # ... but not for `long`, still in flight
        assert not first.done()
        slow.set()
        await _settled(journal, first)
        await _settled(journal, third)
        return order

    assert asyncio.run(run()) == ["long ran", "quick ran", "after ran"]


@pytest.mark.component
def test_a_step_whose_function_raises_is_closed_and_runs_again_on_a_resumed_turn() -> None:
    journal = Journal()

    async def run() -> None:
        steps = _turn(journal)
        with pytest.raises(ValueError):
            await steps.step("boom", lambda: (_ for _ in ()).throw(ValueError("no")))
        assert await _settled(journal, steps.step("next", lambda: "N")) == "N"

    asyncio.run(run())
    assert [(type(r).__name__, r.n, getattr(r, "failed", None)) for r in journal.records] == [
        ("StepStart", 0, None), ("Step", 0, True), ("StepStart", 1, None), ("Step", 1, False)]
    plan = plan_resume(journal.records)
    assert (plan.step, [s.n for s in plan.steps], plan.in_flight) == (2, [1], [])

    async def again() -> list[Any]:
        second = Journal()
        steps = _turn(second, plan.resumed("crashed", "c", False))
        return [await _settled(second, steps.step("boom", lambda: "ran again")),
                await steps.step("next", lambda: "ran again")]

    assert asyncio.run(again()) == ["ran again", "N"]


@pytest.mark.component
def test_a_resumed_turn_that_starts_another_step_where_one_was_in_flight_fails() -> None:
    resumed = plan_resume([StepStart(turn=1, n=0, key="tool:a")]).resumed("crashed", "c", False)

    async def run() -> None:
        await _turn(Journal(), resumed).step("tool:b", lambda: 1)

    with pytest.raises(StepError, match="step 0 'tool:b'.*journaled is 'tool:a'"):
        asyncio.run(run())


@pytest.mark.pure
def test_a_resume_plan_reads_records_of_every_run_first_record_of_a_number_counting() -> None:
    records: list[StepRecord] = [
        StepStart(turn=1, n=0, key="a"), StepStart(turn=1, n=1, key="b"), StepStart(turn=1, n=2, key="c"),
        Step(turn=1, n=2, key="c", result=b"\xa1c"),
        # A second run: `a` answered, `b` in flight again, a forged second end of `c`.
        Step(turn=1, n=0, key="a", result=b"\xa1a"), StepStart(turn=1, n=1, key="b"),
        Step(turn=1, n=2, key="c", result=b"\xa1X"),
        Step(turn=1, n=4, key="e", failed=True),
    ]
    plan = plan_resume(records)
    assert [(s.n, s.result) for s in plan.steps] == [(0, b"\xa1a"), (2, b"\xa1c")]
    assert plan.in_flight == [m.StepInFlight(n=1, key="b")] and plan.step == 1
    resumed = plan.resumed("crashed", "c", False)
    assert resumed.running == "b" and not resumed.uncertain
