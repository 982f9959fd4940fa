"""Durable steps without processes: the daemon's rules (supervisor.core.steps)
and the worker's replay (session_worker.steps) over a fake link."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from ipc import messages as m
from ipc.settings import SessionSettings
from session_worker.errors import StepError
from session_worker.steps import Interruption, TurnSteps
from supervisor.core.steps import cause_of, resumes_after, step_problem

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
def test_a_step_is_journaled_in_order_and_within_its_caps() -> None:
    def done(n: int, size: int = 10, turn: int = 2) -> m.StepDone:
        return m.StepDone(turn=turn, n=n, key=f"k{n}", result=b"x" * size)

    have = [m.StepResult(key="k0", result=b"x")]
    assert step_problem(SETTINGS, 2, have, 1, done(1)) == ""
    assert "out of order" in step_problem(SETTINGS, 2, have, 1, done(2))
    assert "turn 3" in step_problem(SETTINGS, 2, have, 1, done(1, turn=3))
    assert "agent.worker.max_step_kb = 1" in step_problem(SETTINGS, 2, have, 1, done(1, size=2000))
    assert "max_turn_steps_mb = 1" in step_problem(SETTINGS, 2, have, (1 << 20) - 5, done(1))
    # A handler is untrusted for size: its keys, and a flood of empty steps.
    assert "too long" in step_problem(SETTINGS, 2, have, 1, m.StepDone(turn=2, n=1, key="k" * 100_000))
    assert "max_turn_steps_mb = 1" in step_problem(SETTINGS, 2, have, (1 << 20) - 32,
                                                   m.StepDone(turn=2, n=1, key="k"))


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
