"""The agent loop end to end over loopback: tool dispatch, limits,
interrupts, permissions, sub-agents, durability and compaction."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from fakellm import FakeLLM, Hang, Reply, Stream, chunk, fake_llm, text_stream, tool_call_stream
from session_worker.agent import AgentHandler
from session_worker.agent._compaction import RequestSizes, estimate_tokens, system_content
from session_worker.agent._history import History
from session_worker.worker.factories import load_factory
from session_worker.handler import SpawnError, TurnFailure, TurnResult
from ipc.settings import SessionSettings
from test_agent_support import (
    AgentSettings,
    FakeCtx,
    LoopSettings,
    PermissionRule,
    SubagentSettings,
    ToolsSettings,
    make_handler,
    make_settings,
    poll,
    run,
)

__all__ = ["fake_llm"]


def assert_valid_history(messages: list[dict[str, Any]]) -> None:
    """What providers require: each assistant tool call answered by exactly
    one tool message right after it, and no tool message otherwise."""
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] == "assistant" and m.get("tool_calls"):
            ids = [c["id"] for c in m["tool_calls"]]
            following = messages[i + 1 : i + 1 + len(ids)]
            assert [f["role"] for f in following] == ["tool"] * len(ids), messages
            assert sorted(f["tool_call_id"] for f in following) == sorted(ids)
            for call in m["tool_calls"]:
                json.loads(call["function"]["arguments"])
            i += 1 + len(ids)
        else:
            assert m["role"] != "tool", messages
            i += 1


def wire(value: Any) -> Any:
    """What the daemon stores and hands back: a msgpack round trip."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(value))


async def turn(handler: AgentHandler, settings: SessionSettings, ws: Path, text: str, **ctx_kw: Any) -> tuple[TurnResult, FakeCtx]:
    ctx = FakeCtx(settings, ws, **ctx_kw)
    return await handler.handle(text, ctx), ctx


@pytest.mark.component
def test_load_factory_builds_the_agent(fake_llm: FakeLLM, tmp_path: Path) -> None:
    from session_worker.handler import Handler, HandlerInit

    factory = load_factory("agent")
    handler = factory(HandlerInit("s", make_settings(fake_llm), tmp_path / "new" / "ws"))
    assert isinstance(handler, Handler) and isinstance(handler, AgentHandler)
    assert (tmp_path / "new" / "ws").is_dir()
    run(handler.aclose())


@pytest.mark.component
def test_write_then_read_file_through_the_model(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(
        tool_call_stream(("w1", "write_file", {"path": "dir/note.md", "content": "línea 1\n"}), text="Writing."),
        tool_call_stream(("r1", "read_file", {"path": "dir/note.md"})),
        text_stream("It says ", "línea 1."),
    )
    settings = make_settings(fake_llm)
    ws = tmp_path / "ws"

    async def go() -> tuple[TurnResult, FakeCtx]:
        handler = make_handler(settings, ws)
        try:
            return await turn(handler, settings, ws, "save and read back")
        finally:
            await handler.aclose()

    result, ctx = run(go())
    assert (ws / "dir" / "note.md").read_text() == "línea 1\n"
    last = fake_llm.requests[2].json["messages"]
    assert last[-1] == {"role": "tool", "tool_call_id": "r1", "content": "línea 1\n"}
    assert_valid_history(last)
    assert result.reply == "Writing.\n\nIt says línea 1."
    assert [n["name"] for n in ctx.notices_of("tool_result")] == ["write_file", "read_file"]
    assert all(n["ok"] for n in ctx.notices_of("tool_result"))


@pytest.mark.component
def test_parallel_interleaved_tool_calls(fake_llm: FakeLLM, tmp_path: Path) -> None:
    a = json.dumps({"path": "a.txt", "content": "AAA"})
    b = json.dumps({"path": "b.txt", "content": "BBB"})
    events: list[Any] = [
        chunk({"role": "assistant", "tool_calls": [{"index": 0, "id": "ca", "type": "function", "function": {"name": "write_file", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "cb", "type": "function", "function": {"name": "write_file", "arguments": ""}}]}),
    ]
    for i in range(0, len(a), 5):
        events.append(chunk({"tool_calls": [{"index": 1, "function": {"arguments": b[i : i + 5]}}]}))
        events.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": a[i : i + 5]}}]}))
    events.append(chunk({}, "tool_calls"))
    fake_llm.script(Stream(events), text_stream("done"))
    settings = make_settings(fake_llm)
    ws = tmp_path / "ws"

    async def go() -> None:
        handler = make_handler(settings, ws)
        await turn(handler, settings, ws, "two files")
        await handler.aclose()

    run(go())
    assert (ws / "a.txt").read_text() == "AAA" and (ws / "b.txt").read_text() == "BBB"
    msgs = fake_llm.requests[1].json["messages"]
    assert [m.get("tool_call_id") for m in msgs[-2:]] == ["ca", "cb"]
    assert_valid_history(msgs)


@pytest.mark.process
def test_bad_calls_get_readable_error_results(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(
        tool_call_stream(
            ("u1", "no_such_tool", {}),
            ("j1", "read_file", '{"path": "x'),
            ("m1", "write_file", {"path": "x"}),
            ("t1", "bash", {"command": 42}),
            ("n1", "bash", {"command": "echo ok", "timeout_secs": None}),
        ),
        text_stream("sorry"),
    )
    settings = make_settings(fake_llm)
    ws = tmp_path / "ws"

    async def go() -> None:
        handler = make_handler(settings, ws)
        await turn(handler, settings, ws, "go")
        await handler.aclose()

    run(go())
    msgs = fake_llm.requests[1].json["messages"]
    assert_valid_history(msgs)
    results = {m["tool_call_id"]: m["content"] for m in msgs if m["role"] == "tool"}
    assert results["u1"].startswith("error: unknown tool 'no_such_tool'") and "bash" in results["u1"]
    assert "not a JSON object" in results["j1"] and '{"path": "x' in results["j1"]
    assert "missing required argument(s): content" in results["m1"]
    assert "'command' must be of type string" in results["t1"]
    assert results["n1"] == "ok\n[exit code: 0]"
    # The invalid arguments went back to the provider as "{}".
    calls = {c["id"]: c for c in msgs[-6]["tool_calls"]}
    assert calls["j1"]["function"]["arguments"] == "{}"


@pytest.mark.process
def test_max_turns_stops_with_a_clear_reply(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(
        tool_call_stream(("c1", "bash", {"command": "echo one > one.txt"})),
        tool_call_stream(("c2", "bash", {"command": "echo two > two.txt"})),
        text_stream("never used in this turn"),
    )
    settings = make_settings(fake_llm, agent=AgentSettings(max_turns=2))
    ws = tmp_path / "ws"

    async def go() -> tuple[TurnResult, FakeCtx, list[dict[str, Any]]]:
        handler = make_handler(settings, ws)
        result, ctx = await turn(handler, settings, ws, "loop forever")
        history = handler.snapshot()["messages"]
        # The session goes on: the next input makes a valid request.
        await turn(handler, settings, ws, "continue")
        await handler.aclose()
        return result, ctx, history

    result, ctx, history = run(go())
    assert len(fake_llm.requests) == 3
    assert ctx.limits == [("turns", 2, 2)]
    assert "max_turns" in result.reply and "Stopped" in result.reply
    assert result.record["limit"] == "turns"
    assert (ws / "one.txt").exists() and not (ws / "two.txt").exists()
    assert_valid_history(history)
    assert "not run" in history[-2]["content"]
    assert_valid_history(fake_llm.requests[2].json["messages"])


@pytest.mark.component
def test_max_tool_calls_per_response(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(
        tool_call_stream(*[(f"c{i}", "write_file", {"path": f"f{i}", "content": "x"}) for i in range(3)]),
        text_stream("ok"),
    )
    settings = make_settings(fake_llm, agent=AgentSettings(max_tool_calls_per_turn=2))
    ws = tmp_path / "ws"

    async def go() -> FakeCtx:
        handler = make_handler(settings, ws)
        _, ctx = await turn(handler, settings, ws, "three")
        await handler.aclose()
        return ctx

    ctx = run(go())
    assert sorted(p.name for p in ws.iterdir()) == ["f0", "f1"]
    msgs = fake_llm.requests[1].json["messages"]
    assert_valid_history(msgs)
    assert "at most 2 tool calls" in msgs[-1]["content"]
    assert ctx.limits == [("tool_calls", 3, 2)]


@pytest.mark.component
def test_interrupt_mid_stream_keeps_partial_text_and_valid_history(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(
        Stream([chunk({"role": "assistant", "content": "partial "}), chunk({"content": "answer"}), Hang()]),
        text_stream("fresh"),
    )
    settings = make_settings(fake_llm)
    ws = tmp_path / "ws"

    async def go() -> tuple[TurnResult, AgentHandler]:
        handler = make_handler(settings, ws)
        ctx = FakeCtx(settings, ws)
        task = asyncio.create_task(handler.handle("talk", ctx))
        await poll(lambda: ctx.text == "partial answer", what="partial text")
        task.cancel()
        result = await asyncio.wait_for(task, 5)
        # The stream is closed at once: the server sees the client go.
        gone = fake_llm.requests[0].client_gone
        await poll(gone.is_set, what="client disconnect")
        await turn(handler, settings, ws, "again")
        await handler.aclose()
        return result, handler

    result, handler = run(go())
    assert result.interrupted and result.reply == "partial answer"
    assert result.record["interrupted"] is True
    msgs = fake_llm.requests[1].json["messages"]
    assert msgs[1:] == [
        {"role": "user", "content": "talk"},
        {"role": "assistant", "content": "partial answer\n\n[interrupted by the user]"},
        {"role": "user", "content": "again"},
    ]


@pytest.mark.process
def test_interrupt_during_a_tool_answers_the_call_and_kills_it(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(
        tool_call_stream(
            ("b1", "bash", {"command": "sleep 300 & echo $! > pid; wait"}),
            ("b2", "read_file", {"path": "pid"}),
        ),
        text_stream("fresh"),
    )
    settings = make_settings(fake_llm)
    ws = tmp_path / "ws"

    async def go() -> tuple[TurnResult, AgentHandler]:
        handler = make_handler(settings, ws)
        ctx = FakeCtx(settings, ws)
        task = asyncio.create_task(handler.handle("run", ctx))
        await poll(lambda: (ws / "pid").exists() and (ws / "pid").read_text().strip() != "", what="pid file")
        task.cancel()
        result = await asyncio.wait_for(task, 5)
        await turn(handler, settings, ws, "again")
        await handler.aclose()
        return result, handler

    result, handler = run(go())
    assert result.interrupted
    pid = int((ws / "pid").read_text())

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    # SIGKILL is delivered asynchronously: poll with a deadline.
    deadline = time.monotonic() + 5
    while not gone():
        assert time.monotonic() < deadline, f"the tool's child {pid} survived the interrupt"
        time.sleep(0.01)
    msgs = fake_llm.requests[1].json["messages"]
    assert_valid_history(msgs)
    results = [m["content"] for m in msgs if m["role"] == "tool"]
    assert len(results) == 2 and all("interrupted" in r for r in results)


@pytest.mark.process
def test_permissions_allow_deny_ask(fake_llm: FakeLLM, tmp_path: Path) -> None:
    rules = [
        PermissionRule(tool="bash", match="rm *", action="deny"),
        PermissionRule(tool="write_file", match="*.md", action="ask"),
        PermissionRule(tool="*", match="secret*", action="deny"),
    ]
    fake_llm.script(
        tool_call_stream(
            ("d1", "bash", {"command": "rm -rf keep"}),
            ("a1", "write_file", {"path": "no.md", "content": "x"}),
            ("a2", "write_file", {"path": "yes.md", "content": "y"}),
            ("d2", "read_file", {"path": "secret.txt"}),
            ("ok", "bash", {"command": "echo allowed"}),
        ),
        text_stream("done"),
    )
    settings = make_settings(fake_llm, permissions=rules)
    ws = tmp_path / "ws"
    (tmp_path / "ws" / "keep").mkdir(parents=True)

    async def go() -> FakeCtx:
        handler = make_handler(settings, ws)
        _, ctx = await turn(handler, settings, ws, "go", answers=[False, True])
        await handler.aclose()
        return ctx

    ctx = run(go())
    assert ctx.asked == [
        ("write_file", {"path": "no.md", "content": "x"}),
        ("write_file", {"path": "yes.md", "content": "y"}),
    ]
    assert (ws / "keep").exists() and not (ws / "no.md").exists() and (ws / "yes.md").exists()
    results = {m["tool_call_id"]: m["content"] for m in fake_llm.requests[1].json["messages"] if m["role"] == "tool"}
    assert "a rule forbids" in results["d1"] and "a rule forbids" in results["d2"]
    assert "did not approve" in results["a1"]
    assert results["a2"].startswith("wrote 1 bytes")
    assert results["ok"].startswith("allowed")


@pytest.mark.component
def test_spawn_agent_and_its_failure(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(
        tool_call_stream(("s1", "spawn_agent", {"task": "count files", "handler": "echo"})),
        text_stream("got it"),
        tool_call_stream(("s2", "spawn_agent", {"task": "again"})),
        text_stream("ok"),
    )
    settings = make_settings(fake_llm)
    ws = tmp_path / "ws"

    async def go() -> tuple[FakeCtx, FakeCtx]:
        handler = make_handler(settings, ws)
        _, ok_ctx = await turn(handler, settings, ws, "delegate", spawn_result="42 files")
        _, bad_ctx = await turn(handler, settings, ws, "delegate", spawn_result=SpawnError("max_total_spawns reached"))
        await handler.aclose()
        return ok_ctx, bad_ctx

    ok_ctx, bad_ctx = run(go())
    assert ok_ctx.spawned == [("count files", "echo")] and bad_ctx.spawned == [("again", None)]
    assert fake_llm.requests[1].json["messages"][-1]["content"] == "42 files"
    assert "max_total_spawns reached" in fake_llm.requests[3].json["messages"][-1]["content"]


@pytest.mark.component
def test_spawn_agent_withheld_at_max_depth_and_enabled_list_honoured(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(tool_call_stream(("s1", "spawn_agent", {"task": "x"})), text_stream("ok"))
    settings = make_settings(
        fake_llm,
        agent=AgentSettings(subagents=SubagentSettings(max_depth=1)),
        tools=ToolsSettings(enabled=["read_file", "spawn_agent"]),
    )
    ws = tmp_path / "ws"

    async def go() -> FakeCtx:
        handler = make_handler(settings, ws, depth=1)
        _, ctx = await turn(handler, settings, ws, "x")
        await handler.aclose()
        return ctx

    ctx = run(go())
    offered = [t["function"]["name"] for t in fake_llm.requests[0].json["tools"]]
    assert offered == ["read_file"]
    assert ctx.spawned == []
    assert "unknown tool 'spawn_agent'" in fake_llm.requests[1].json["messages"][-1]["content"]
    # One level up the same settings offer it.
    handler = make_handler(settings, ws, depth=0)
    assert handler.tools.names() == ["read_file", "spawn_agent"]
    run(handler.aclose())


@pytest.mark.component
def test_restore_reproduces_the_next_request(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(
        tool_call_stream(("c1", "write_file", {"path": "a", "content": "1"}), text="Sure."),
        text_stream("first done"),
        Stream([chunk({"content": "half"}), Hang()]),  # turn 2: interrupted
        text_stream("three"),  # turn 3 of the original
        text_stream("three"),  # ... of the one restored from snapshot + records
        text_stream("three"),  # ... of the one restored from records only
    )
    settings = make_settings(fake_llm)
    ws = tmp_path / "ws"

    async def go() -> None:
        a = make_handler(settings, ws)
        r1, _ = await turn(a, settings, ws, "one")
        snap1 = wire(a.snapshot())
        ctx = FakeCtx(settings, ws)
        task = asyncio.create_task(a.handle("two", ctx))
        await poll(lambda: ctx.text == "half")
        task.cancel()
        r2 = await task
        records = [wire(r1.record), wire(r2.record)]
        state_after_two = a.snapshot()
        await turn(a, settings, ws, "three")
        for state, recs in [(snap1, records[1:]), (None, records)]:
            b = make_handler(settings, ws)
            b.restore(state, recs)
            assert b.snapshot() == state_after_two
            await turn(b, settings, ws, "three")
            await b.aclose()
        await a.aclose()

    run(go())
    reqs = fake_llm.requests
    assert len(reqs) == 6
    assert reqs[3].json == reqs[4].json == reqs[5].json
    assert_valid_history(reqs[3].json["messages"])
    assert len(reqs[3].json["messages"]) == 8


@pytest.mark.component
def test_failed_turn_record_restores_too(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(Reply(400, {"error": {"message": "nope"}}), text_stream("a"), text_stream("a"))
    settings = make_settings(fake_llm)
    ws = tmp_path / "ws"

    async def go() -> None:
        a = make_handler(settings, ws)
        with pytest.raises(TurnFailure) as info:
            await a.handle("one", FakeCtx(settings, ws))
        b = make_handler(settings, ws)
        b.restore(None, [wire(info.value.record)])
        await turn(a, settings, ws, "two")
        await turn(b, settings, ws, "two")
        await a.aclose()
        await b.aclose()

    run(go())
    assert fake_llm.requests[1].json == fake_llm.requests[2].json


@pytest.mark.component
def test_unexpected_error_leaves_state_unchanged(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(text_stream("a"), tool_call_stream(("c", "list_dir", {"path": "."})))
    settings = make_settings(fake_llm)
    ws = tmp_path / "ws"

    class Broken(FakeCtx):
        def notice(self, kind: str, data: dict[str, Any]) -> None:
            raise RuntimeError("worker bug")

    async def go() -> None:
        h = make_handler(settings, ws)
        await turn(h, settings, ws, "one")
        before = h.snapshot()
        with pytest.raises(RuntimeError):
            await h.handle("two", Broken(settings, ws))
        assert h.snapshot() == before
        await h.aclose()

    run(go())


# --- compaction -----------------------------------------------------------------


@pytest.mark.pure
def test_remembered_sizes_estimate_exactly_as_a_full_encoding() -> None:
    # The estimate with remembered sizes is the one a json.dumps of the
    # whole request gives, as the history grows, is compacted, is rolled
    # back and is restored (new objects), and as the tools change.
    def full(summary: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
        chars = len(system_content("sys", summary)) + len(json.dumps(messages, ensure_ascii=False))
        return (chars + (len(json.dumps(tools, ensure_ascii=False)) if tools else 0)) // 4

    sizes = RequestSizes()
    tools_a = [{"type": "function", "function": {"name": "a", "parameters": {"x": 1.5}}}]
    tools_b = [*tools_a, {"type": "function", "function": {"name": "b", "description": "é"}}]
    history = History()
    seen = []
    steps: list[tuple[str, Any]] = [
        ("append", {"role": "user", "content": "héllo ✓ \"quoted\"\n"}),
        ("append", {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "a", "arguments": "{}"}}]}),
        ("append", {"role": "tool", "tool_call_id": "c1", "content": "x" * 3000}),
        ("compact", {"op": "compact", "drop": 2, "summary": "S"}),
        ("append", {"role": "user", "content": "🙂"}),
        ("restore", None),
        ("append", {"role": "assistant", "content": ""}),
        ("compact", {"op": "compact", "drop": 4, "summary": None}),
    ]
    for i, (kind, value) in enumerate(steps):
        if kind == "append":
            history.apply({"op": "append", "message": value})
        elif kind == "compact":
            history.apply(value)
        else:
            history = History.restored(history.snapshot(), [])
        for tools in (tools_a, tools_b, []):
            got = estimate_tokens("sys", history.summary, history.messages, tools, sizes)
            assert got == full(history.summary, history.messages, tools), (i, tools)
        seen.append(len(history.messages))
    assert seen == [1, 2, 3, 1, 2, 2, 3, 0]


@pytest.mark.component
def test_compaction_summarizes_then_falls_back_to_dropping_and_restores(fake_llm: FakeLLM, tmp_path: Path) -> None:
    settings = make_settings(
        fake_llm,
        agent=AgentSettings(loop=LoopSettings(compaction_threshold_tokens=256, compaction_keep_recent_turns=1)),
        tools=ToolsSettings(enabled=["list_dir"]),
    )
    ws = tmp_path / "ws"
    big = {n: n * 700 for n in "ABC"}
    fake_llm.script(
        tool_call_stream(("c1", "list_dir", {"path": "."})),
        text_stream("r1"),
        text_stream("SUMMARY-ONE"),          # compaction before turn 2
        text_stream("r2"),
        Reply(400, {"error": {"message": "context too long"}}),  # compaction before turn 3 fails
        text_stream("r3"),
        # Turn 4 (C and r3 are still over the threshold): the original and
        # the restored handler compact the same way and then ask the same.
        text_stream("SUMMARY-TWO"),
        text_stream("next"),
        text_stream("SUMMARY-TWO"),
        text_stream("next"),
    )

    async def go() -> list[FakeCtx]:
        h = make_handler(settings, ws)
        ctxs, records = [], []
        for n in "ABC":
            result, ctx = await turn(h, settings, ws, big[n])
            ctxs.append(ctx)
            records.append(wire(result.record))
        await turn(h, settings, ws, "small")
        r = make_handler(settings, ws)
        r.restore(None, records)
        await turn(r, settings, ws, "small")
        await h.aclose()
        await r.aclose()
        return ctxs

    ctxs = run(go())
    reqs = [r.json for r in fake_llm.requests]
    summary_req = reqs[2]
    assert "tools" not in summary_req
    assert summary_req["messages"][0]["content"].startswith("You compress conversations")
    assert "A" * 100 in summary_req["messages"][1]["content"]
    assert "[called list_dir" in summary_req["messages"][1]["content"]
    turn2 = reqs[3]["messages"]
    assert "SUMMARY-ONE" in turn2[0]["content"]
    assert turn2[1:] == [{"role": "user", "content": big["B"]}]
    (note,) = ctxs[1].notices_of("compaction")
    assert note["method"] == "summarized" and note["dropped_messages"] == 4
    assert note["tokens_after"] < note["tokens_before"]
    turn3 = reqs[5]["messages"]
    assert "SUMMARY-ONE" in turn3[0]["content"]
    assert turn3[1:] == [{"role": "user", "content": big["C"]}]
    (note,) = ctxs[2].notices_of("compaction")
    assert note["method"] == "dropped" and "context too long" in note["error"]
    assert len(reqs) == 10
    assert reqs[6] == reqs[8] and reqs[7] == reqs[9]
    # The new summary is built on the old one.
    assert "Summary so far:\nSUMMARY-ONE" in reqs[6]["messages"][1]["content"]
    assert "SUMMARY-TWO" in reqs[7]["messages"][0]["content"]
    assert reqs[7]["messages"][1:] == [{"role": "user", "content": "small"}]
    assert_valid_history(reqs[7]["messages"])


@pytest.mark.process
def test_compaction_keeps_a_tool_call_with_its_results(fake_llm: FakeLLM, tmp_path: Path) -> None:
    settings = make_settings(
        fake_llm,
        agent=AgentSettings(loop=LoopSettings(compaction_threshold_tokens=256, compaction_keep_recent_turns=1)),
        tools=ToolsSettings(enabled=["bash"]),
    )
    ws = tmp_path / "ws"
    fake_llm.script(
        text_stream("r1"),
        tool_call_stream(("c1", "bash", {"command": "printf 'x%.0s' $(seq 1500)"})),
        text_stream("SUM"),  # compaction between the tool result and the next call
        text_stream("r2"),
    )

    async def go() -> FakeCtx:
        h = make_handler(settings, ws)
        await turn(h, settings, ws, "hello")
        _, ctx = await turn(h, settings, ws, "run it")
        await h.aclose()
        return ctx

    ctx = run(go())
    (note,) = ctx.notices_of("compaction")
    assert note["dropped_messages"] == 2
    msgs = fake_llm.requests[3].json["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert_valid_history(msgs)
