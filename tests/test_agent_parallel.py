"""The agent runs a response's calls of `[tools] parallel` tools at once:
their results reach the model in the order of the calls, any other call
runs alone and in order, `ask` prompts come one at a time, and
`max_tool_calls_per_turn` is unchanged.  Component tier: the loop against
the FakeLLM on loopback, with a custom tool that can only finish when its
siblings run beside it (tests/agent_tools_example.py: `rendezvous`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import agent_tools_example
from fakellm import FakeLLM, fake_llm, text_stream, tool_call_stream
from ipc.settings import PermissionRule
from session_worker.agent._loop import _batches
from session_worker.agent._stream import ToolCall
from test_agent_loop import assert_valid_history, turn
from test_agent_support import AgentSettings, FakeCtx, ToolsSettings, make_handler, make_settings, poll, run

__all__ = ["fake_llm"]

RENDEZVOUS = "agent_tools_example:rendezvous"


@pytest.fixture(autouse=True)
def _clear() -> None:
    agent_tools_example.RENDEZVOUS.clear()


def _three(wait_secs: float = 10.0) -> Any:
    return tool_call_stream(*[(f"c{i}", "rendezvous", {"n": i, "of": 3, "wait_secs": wait_secs}) for i in range(3)])


def _tool_messages(llm: FakeLLM, request: int = 1) -> list[tuple[str, str]]:
    return [(m["tool_call_id"], m["content"]) for m in llm.requests[request].json["messages"] if m["role"] == "tool"]


def _go(settings: Any, ws: Path, ctx_kw: dict[str, Any] | None = None) -> FakeCtx:
    async def go() -> FakeCtx:
        handler = make_handler(settings, ws)
        _, ctx = await turn(handler, settings, ws, "go", **(ctx_kw or {}))
        await handler.aclose()
        return ctx

    return run(go())


@pytest.mark.component
def test_calls_of_parallel_tools_run_at_once_and_are_answered_in_the_order_of_the_calls(
        fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(_three(), text_stream("done"))
    settings = make_settings(fake_llm, tools=ToolsSettings(custom=[RENDEZVOUS], parallel=["rendezvous"]))
    ctx = _go(settings, tmp_path / "ws")
    # All three started before any ended, and they ended in reverse order.
    assert agent_tools_example.RENDEZVOUS == ["start 0", "start 1", "start 2", "end 2", "end 1", "end 0"]
    assert _tool_messages(fake_llm) == [("c0", "0: met"), ("c1", "1: met"), ("c2", "2: met")]
    assert_valid_history(fake_llm.requests[1].json["messages"])
    assert [n["id"] for n in ctx.notices_of("tool_result")] == ["c0", "c1", "c2"]


@pytest.mark.component
def test_a_tool_not_listed_runs_one_call_at_a_time(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(_three(wait_secs=0.05), text_stream("done"))
    settings = make_settings(fake_llm, tools=ToolsSettings(custom=[RENDEZVOUS], parallel=[]))
    _go(settings, tmp_path / "ws")
    assert _tool_messages(fake_llm) == [("c0", "0: alone"), ("c1", "1: alone"), ("c2", "2: met")]
    assert agent_tools_example.RENDEZVOUS == ["start 0", "end 0", "start 1", "end 1", "start 2", "end 2"]


@pytest.mark.pure
def test_consecutive_calls_of_parallel_tools_run_together_any_other_alone_in_order() -> None:
    names = ["read_file", "list_dir", "write_file", "read_file", "bash", "bash", "read_file", "read_file"]
    calls = [ToolCall(id=str(i), name=name, arguments="{}") for i, name in enumerate(names)]
    batches = _batches(calls, ["read_file", "list_dir"])
    assert [[c.id for c in b] for b in batches] == [["0", "1"], ["2"], ["3"], ["4"], ["5"], ["6", "7"]]
    assert [c.id for b in _batches(calls, []) for c in b] == [c.id for c in calls]


@pytest.mark.component
def test_parallel_calls_keep_the_permission_rules_asks_one_at_a_time_and_the_call_limit(
        fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(tool_call_stream(*[(f"c{i}", "read_file", {"path": f"f{i}"}) for i in range(5)]),
                    text_stream("done"))
    rules = [PermissionRule(tool="read_file", match="f1", action="deny"),
             PermissionRule(tool="read_file", match="f[23]", action="ask")]
    settings = make_settings(fake_llm, permissions=rules, agent=AgentSettings(max_tool_calls_per_turn=4),
                             tools=ToolsSettings(parallel=["read_file"]))
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(5):
        (ws / f"f{i}").write_text(f"text {i}")

    class OneAtATime(FakeCtx):
        asking = 0

        async def ask_permission(self, tool: str, arguments: dict[str, Any]) -> bool:
            assert self.asking == 0, "two prompts at once"
            self.asking += 1
            try:
                for _ in range(5):
                    await asyncio.sleep(0)  # (the other call would ask now, were it let)
                return await super().ask_permission(tool, arguments)
            finally:
                self.asking -= 1

    async def go() -> OneAtATime:
        handler = make_handler(settings, ws)
        ctx = OneAtATime(settings, ws, answers=[True, False])
        await handler.handle("go", ctx)
        await handler.aclose()
        return ctx

    ctx = run(go())
    assert [a[1]["path"] for a in ctx.asked] == ["f2", "f3"]
    results = dict(_tool_messages(fake_llm))
    assert list(results) == ["c0", "c1", "c2", "c3", "c4"]
    assert results["c0"] == "text 0" and "a rule forbids" in results["c1"]
    assert results["c2"] == "text 2" and "did not approve" in results["c3"]
    assert "at most 4 tool calls" in results["c4"]
    assert ctx.limits == [("tool_calls", 5, 4)]


@pytest.mark.component
def test_an_interrupt_keeps_what_finished_and_answers_the_rest_in_the_order_of_the_calls(
        fake_llm: FakeLLM, tmp_path: Path) -> None:
    # Call 2 (n=5) ends as soon as the three have started; 0 and 1 wait for
    # calls that never come, until the interrupt.
    fake_llm.script(tool_call_stream(*[(f"c{i}", "rendezvous", {"n": n, "of": 3}) for i, n in enumerate((0, 1, 5))]),
                    text_stream("fresh"))
    settings = make_settings(fake_llm, tools=ToolsSettings(custom=[RENDEZVOUS], parallel=["rendezvous"]))
    ws = tmp_path / "ws"

    async def go() -> Any:
        handler = make_handler(settings, ws)
        task = asyncio.create_task(handler.handle("run", FakeCtx(settings, ws)))
        await poll(lambda: "end 5" in agent_tools_example.RENDEZVOUS, what="call 2's end")
        task.cancel()
        result = await asyncio.wait_for(task, 5)
        await turn(handler, settings, ws, "again")
        await handler.aclose()
        return result

    assert run(go()).interrupted
    results = _tool_messages(fake_llm)
    assert [r[0] for r in results] == ["c0", "c1", "c2"]
    assert "interrupted" in results[0][1] and "interrupted" in results[1][1] and results[2][1] == "5: met"
    assert_valid_history(fake_llm.requests[1].json["messages"])
