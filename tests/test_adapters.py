"""The framework adapters in the test's process: the real `openai-agents`
and `langgraph` against the scripted LLM server, with a context that
journals steps and replays them as a resumed turn would (tests/
test_adapters_e2e.py does the same through the daemon, with real kills);
`ctx.run` under the permission rules.  What a client sees (notices, usage,
stop reasons, limits), what the model is told, what the record holds.
The frameworks' side (tools, agents, graphs) is tests/adapter_cases.py,
imported by the `cases` fixture: not at collection."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

from fakellm import FakeLLM, Reply, chunk, fake_llm, text_stream, tool_call_stream
from ipc.settings import BudgetSettings
from session_worker.handler import CommandRefused, HandlerInit, Interruption, TurnFailure
from test_agent_support import AgentSettings, FakeCtx, PermissionRule, ToolsSettings, make_settings

__all__ = ["fake_llm"]  # (the fixture)

_encode, _decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode


@pytest.fixture(scope="module")
def cases() -> Iterator[ModuleType]:
    import adapter_cases

    yield adapter_cases


class StepCtx(FakeCtx):
    """Journals each step's result by key, as msgpack (what the daemon
    keeps); given a journal, replays it: a journaled step returns its
    result, the step `running` (its worker died in it) gets `interrupted`'s
    result when there is one, else runs again."""

    def __init__(self, *args: Any, journal: dict[str, bytes] | None = None, running: str = "",
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replay = dict(journal or {})
        self.running = running
        self.journal: dict[str, bytes] = {}
        self.ran: list[str] = []

    async def step(self, key: str, fn: Any, *, kind: str = "", interrupted: Any = None, idempotent: bool = False,
                   wait: bool = True) -> Any:
        if key in self.replay:
            self.journal[key] = self.replay[key]
            return _decode(self.replay[key])
        if key == self.running and interrupted is not None:
            value = interrupted(Interruption(reason="crashed", cause="the worker crashed (signal SIGKILL)", key=key))
        else:
            self.ran.append(key)
            value = fn()
            if inspect.isawaitable(value):
                value = await value
        self.journal[key] = _encode(value)
        return _decode(self.journal[key])


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def usage_stream(text: str, prompt: int, completion: int) -> Any:
    stream = text_stream(text)
    stream.events = [*stream.events, {**chunk({}), "choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}]
    return stream


@pytest.mark.component
def test_parallel_tool_calls_are_steps_clients_see_them_and_the_record_keeps_them(
        fake_llm: FakeLLM, tmp_path: Path, cases: ModuleType) -> None:
    cases.counts.clear()
    fake_llm.script(tool_call_stream(("c1", "count", {"n": 1}), ("c2", "count", {"n": 2}), text="Counting."),
                    usage_stream("Done.", 30, 4))
    h, s = cases.openai_session(fake_llm, tmp_path)
    ctx = StepCtx(s, tmp_path)
    result = run(h.handle("count to two", ctx))
    assert result.reply == "Counting.\n\nDone." and ctx.text == "Counting.\n\nDone."
    assert set(ctx.journal) == {"llm:1", "tool:count:c1", "tool:count:c2", "llm:2"}
    assert sorted(cases.counts) == [1, 2]
    assert [d["id"] for d in ctx.notices_of("tool_call")] == ["c1", "c2"]
    assert {d["id"]: d["output"] for d in ctx.notices_of("tool_result")} == {"c1": "counted 1", "c2": "counted 2"}
    assert result.usage == {"prompt_tokens": 30, "completion_tokens": 4}
    messages = [op["message"] for op in result.record["ops"]]
    assert [m.get("type") for m in messages if m.get("type", "").startswith("function_call")] == \
        ["function_call", "function_call", "function_call_output", "function_call_output"]
    # The next turn's request carries the conversation, restored from the record.
    again, _ = cases.openai_session(fake_llm, tmp_path)
    again.restore(None, [result.record])
    fake_llm.script(text_stream("Again."))
    run(again.handle("and again?", StepCtx(s, tmp_path)))
    sent = fake_llm.requests[-1].json["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool", "tool", "assistant", "user"]


@pytest.mark.component
def test_a_resumed_turn_replays_its_steps_and_answers_the_running_tool_as_killed(
        fake_llm: FakeLLM, tmp_path: Path, cases: ModuleType) -> None:
    cases.counts.clear()
    fake_llm.script(tool_call_stream(("c1", "count", {"n": 1}), ("c2", "count", {"n": 2})), text_stream("Ok."))
    h, s = cases.openai_session(fake_llm, tmp_path)
    first = StepCtx(s, tmp_path)
    run(h.handle("count", first))
    journal = {k: v for k, v in first.journal.items() if k in ("llm:1", "tool:count:c1")}
    cases.counts.clear()
    fake_llm.script(text_stream("Resumed."))
    resumed, _ = cases.openai_session(fake_llm, tmp_path)
    ctx = StepCtx(s, tmp_path, journal=journal, running="tool:count:c2")
    result = run(resumed.handle("count", ctx))
    assert ctx.ran == ["llm:2"] and cases.counts == []  # no journaled call again, no tool run again
    assert len(fake_llm.requests) == 3
    tools = {m["tool_call_id"]: m["content"] for m in fake_llm.requests[-1].json["messages"] if m["role"] == "tool"}
    assert tools == {"c1": "counted 1",
                     "c2": "error: the worker crashed (signal SIGKILL) while this tool ran; "
                           "it may or may not have completed"}
    assert result.reply == "Resumed."  # the journaled response had no text


@pytest.mark.component
def test_permission_rules_and_a_tools_own_approval_ask_the_clients(fake_llm: FakeLLM, tmp_path: Path, cases: ModuleType) -> None:
    cases.counts.clear()
    fake_llm.script(tool_call_stream(("c1", "count", {"n": 5}), ("c2", "launch", {"target": "moon"}),
                                     ("c3", "count", {"n": 6})), text_stream("ok"))
    h, s = cases.openai_session(fake_llm, tmp_path, permissions=[
        PermissionRule(tool="count", match="5", action="deny"), PermissionRule(tool="count", action="ask")])
    ctx = StepCtx(s, tmp_path, answers=[False, True])
    run(h.handle("go", ctx))
    tools = {m["tool_call_id"]: m["content"] for m in fake_llm.requests[-1].json["messages"] if m["role"] == "tool"}
    assert tools["c1"] == "error: permission denied: a rule forbids this count call."
    assert {tools["c2"], tools["c3"]} == {"error: permission denied: the user did not approve this launch call.",
                                          "counted 6"} or tools["c3"].startswith("error: permission denied")
    assert sorted(name for name, _ in ctx.asked) == ["count", "launch"]
    assert cases.counts in ([6], [])


@pytest.mark.component
def test_limits_budget_and_guardrails_end_the_turn_as_the_agent_does(fake_llm: FakeLLM, tmp_path: Path, cases: ModuleType) -> None:
    loop = tool_call_stream(("c1", "count", {"n": 1}))
    fake_llm.script(loop, loop)
    h, s = cases.openai_session(fake_llm, tmp_path, agent=AgentSettings(max_turns=2))
    ctx = StepCtx(s, tmp_path)
    result = run(h.handle("forever", ctx))
    assert ctx.limits == [("turns", 2, 2)] and "agent.max_turns" in result.reply
    fake_llm.script(loop)
    h, s = cases.openai_session(fake_llm, tmp_path, agent=AgentSettings(budget=BudgetSettings(turn_max_llm_calls=1)))
    stopped: list[Any] = []
    ctx = StepCtx(s, tmp_path)
    ctx.budget_exceeded = lambda *args: stopped.append(args)  # type: ignore[method-assign]
    result = run(h.handle("count", ctx))
    assert stopped == [("agent.budget.turn_max_llm_calls", 1, 1, "LLM calls")]
    assert "turn_max_llm_calls" in result.reply and len(fake_llm.requests) == 3
    guarded = cases.guarded_agent()
    fake_llm.script(text_stream("never"))
    h, s = cases.openai_session(fake_llm, tmp_path, sdk_agent=guarded)
    result = run(h.handle("the secret is 42", StepCtx(s, tmp_path)))
    assert (result.stop_reason, result.stop_detail) == ("filtered", "input guardrail no_secrets")


@pytest.mark.component
def test_a_provider_the_sdk_cannot_use_fails_the_turn_naming_the_key(fake_llm: FakeLLM, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   cases: ModuleType) -> None:
    h, s = cases.openai_session(fake_llm, tmp_path, kind="anthropic")
    with pytest.raises(TurnFailure, match="provider.kind"):
        run(h.handle("hi", StepCtx(s, tmp_path)))
    monkeypatch.setenv("ADAPTER_KEY", "sk-adapter-secret-1")
    h, s = cases.openai_session(fake_llm, tmp_path, api_key_env="ADAPTER_KEY", max_retries=0)
    fake_llm.script(Reply(401, {"error": {"message": "bad key sk-adapter-secret-1"}}))
    with pytest.raises(TurnFailure) as failed:
        run(h.handle("hi", StepCtx(s, tmp_path)))
    assert "sk-adapter-secret-1" not in failed.value.reason and failed.value.record is not None
    assert fake_llm.requests[-1].headers["authorization"] == "Bearer sk-adapter-secret-1"


@pytest.mark.component
def test_ctx_run_runs_as_the_bash_tool_under_its_rules(fake_llm: FakeLLM, tmp_path: Path, cases: ModuleType) -> None:
    s = make_settings(fake_llm, tools=ToolsSettings(bash_timeout_secs=0.5), permissions=[
        PermissionRule(tool="bash", match="rm *", action="deny"),
        PermissionRule(tool="bash", match="sudo *", action="ask")])
    ctx = FakeCtx(s, tmp_path, answers=[False])
    done = run(ctx.run("echo hi; exit 3"))
    assert (done.output, done.exit_code, done.status, str(done)) == ("hi\n", 3, "[exit code: 3]", "hi\n[exit code: 3]")
    slow = run(ctx.run("sleep 5", timeout_secs=60))  # capped at bash_timeout_secs
    assert slow.exit_code is None and "timed out after 0.5 s" in slow.status
    with pytest.raises(CommandRefused, match="a rule forbids"):
        run(ctx.run("rm -rf /"))
    with pytest.raises(CommandRefused, match="did not approve"):
        run(ctx.run("sudo true"))
    assert ctx.asked == [("bash", {"command": "sudo true"})]
    off = FakeCtx(make_settings(fake_llm, tools=ToolsSettings(enabled=["read_file"])), tmp_path)
    with pytest.raises(CommandRefused, match=r'\[tools\] enabled has no "bash"'):
        run(off.run("true"))


@pytest.mark.component
def test_a_graphs_nodes_and_tool_calls_are_steps_and_an_interrupt_asks_the_clients(
        fake_llm: FakeLLM, tmp_path: Path, cases: ModuleType) -> None:
    cases.ran_tools.clear()
    make = cases.graph_handler(cases.tool_graph())
    s = make_settings(fake_llm)
    h = make(HandlerInit(session="s", settings=s, workspace=tmp_path))
    h.restore(None, [])
    ctx = StepCtx(s, tmp_path, answers=[False])
    result = run(h.handle("find a and b", ctx))
    assert result.reply == "Found both." and ctx.text == "Found both."
    assert sorted(cases.ran_tools) == ["a", "b"]
    assert {k for k in ctx.journal if k.startswith("tool:")} == {"tool:lookup:t1", "tool:lookup:t2"}
    assert any(k.startswith("node:1:think:") for k in ctx.journal) and "ask:1" in ctx.journal
    assert ctx.asked == [("publish", {"tool": "publish", "what": "the answer"})]
    assert [d["id"] for d in ctx.notices_of("tool_result")] == ["t1", "t2"]
    restored = make(HandlerInit(session="s", settings=s, workspace=tmp_path))
    restored.restore(None, [result.record])
    assert restored._values["log"] == ["approved=False"] and restored._values["messages"][-1].text == "Found both."
    # A resumed turn: every step journaled, nothing runs again.
    cases.ran_tools.clear()
    again = make(HandlerInit(session="s", settings=s, workspace=tmp_path))
    replay = StepCtx(s, tmp_path, journal=ctx.journal)
    run(again.handle("find a and b", replay))
    assert replay.ran == [] and cases.ran_tools == [] and replay.asked == []


@pytest.mark.pure
def test_history_lists_the_tool_calls_of_a_record_of_responses_items() -> None:
    """`sessionctl history` reads an adapter's record (the SDK's items) as it
    reads the agent's (chat messages)."""
    from supervisor.api.transfer import _tools

    record = {"ops": [{"op": "append", "message": m} for m in (
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "count", "arguments": '{"n": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "counted 1"},
        {"role": "assistant", "content": "done"})]}
    calls, results = _tools(_encode(record))
    assert calls == [{"id": "c1", "name": "count", "arguments": '{"n": 1}'}]
    assert results == [{"id": "c1", "name": "count", "output": "counted 1"}]


@pytest.mark.component
def test_a_graph_past_agent_max_turns_ends_with_the_limit(fake_llm: FakeLLM, tmp_path: Path, cases: ModuleType) -> None:
    s = make_settings(fake_llm, agent=AgentSettings(max_turns=3))
    h = cases.graph_handler(cases.spin_graph())(HandlerInit(session="s", settings=s, workspace=tmp_path))
    h.restore(None, [])
    ctx = StepCtx(s, tmp_path)
    result = run(h.handle("go", ctx))
    assert ctx.limits == [("turns", 3, 3)] and "agent.max_turns" in result.reply and result.record is None


@pytest.mark.component
def test_a_graphs_model_streams_its_text_token_by_token_and_a_replay_says_it_once(
        fake_llm: FakeLLM, tmp_path: Path, cases: ModuleType) -> None:
    """A node's model streamed its answer, but clients saw it only when the
    node ended, as one piece (issue 30: streaming as the built-in agent's)."""
    s = make_settings(fake_llm)
    make = cases.graph_handler(cases.streaming_graph())
    h = make(HandlerInit(session="s", settings=s, workspace=tmp_path))
    h.restore(None, [])
    ctx = StepCtx(s, tmp_path)
    result = run(h.handle("hi", ctx))
    assert result.reply == "-- signed"  # the default reply: the last AI message
    assert "".join(ctx.emits) == "Hello there, world\n\n-- signed"
    assert len(ctx.emits) > 3, ctx.emits  # the model's pieces as they came, then the other node's
    # Resumed with both nodes journaled: nothing runs, each message said once.
    again = make(HandlerInit(session="s", settings=s, workspace=tmp_path))
    replay = StepCtx(s, tmp_path, journal=ctx.journal)
    run(again.handle("hi", replay))
    assert replay.ran == [] and "".join(replay.emits) == ""
