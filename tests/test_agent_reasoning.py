"""Reasoning models over the OpenAI-compatible API, on loopback: DeepSeek's
thinking mode and Kimi stream `delta.reasoning_content` (OpenRouter and vLLM
`delta.reasoning`), want it back on the tool-call follow-ups of the turn
and (DeepSeek) not for earlier turns; `[provider] reasoning_history` picks
what is sent.  The client gets the reasoning as its own calls
(`TurnContext.reasoning`), never as reply text, and compaction counts it.

Each stream is also fed cut into small random pieces (`shredded`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fakellm import FakeLLM, Stream, chunk, fake_llm, text_stream, tool_call_stream
from test_agent_dialects import SEEDS, done, maybe_shred, turns
from test_agent_support import LoopSettings, AgentSettings, ToolsSettings

__all__ = ["fake_llm"]

pytestmark = pytest.mark.component


def thinking(stream: Stream, *pieces: str, key: str = "reasoning_content") -> Stream:
    """`stream` with reasoning deltas before its content, as DeepSeek sends them."""
    events = list(stream.events)
    events[1:1] = [chunk({key: piece, "content": None}) for piece in pieces]
    return Stream(events, done=stream.done)


def deepseek_check(body: Any) -> str | None:
    """DeepSeek's thinking mode with tools: the assistant tool-call messages
    of the running turn (after the last user message) must carry
    `reasoning_content`; earlier turns' must not."""
    messages = body["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i > last_user and m.get("tool_calls") and not m.get("reasoning_content"):
            return "Missing `reasoning_content` field in the assistant message at message index %d" % i
        if i < last_user and "reasoning_content" in m:
            return "reasoning_content of a previous turn must not be sent (message index %d)" % i
    return None


@pytest.mark.parametrize("seed", SEEDS)
def test_deepseek_reasoning_goes_back_within_the_turn_only(fake_llm: FakeLLM, tmp_path: Path, seed: int | None) -> None:
    fake_llm.check = deepseek_check
    calls = thinking(tool_call_stream(("c1", "list_dir", {"path": "."})), "Need to ", "look first.")
    final = thinking(text_stream("Empty ", "dir."), "Nothing there.")
    fake_llm.script(maybe_shred(calls, seed), maybe_shred(final, seed), maybe_shred(thinking(text_stream("Hi."), "Greet."), seed))
    (first, ctx), (second, ctx2) = turns(fake_llm, tmp_path, "what is here?", "hello")
    assert done(first).reply == "Empty dir."
    assert ctx.text == "Empty dir."
    assert "".join(ctx.reasonings) == "Need to look first.Nothing there."
    assert done(second).reply == "Hi." and "".join(ctx2.reasonings) == "Greet."
    follow_up = fake_llm.requests[1].json["messages"]
    assert follow_up[-2]["reasoning_content"] == "Need to look first."
    assert follow_up[-2]["tool_calls"][0]["id"] == "c1" and follow_up[-1]["role"] == "tool"
    # Every request passed the strict check (3 requests, no 400 among them).
    assert len(fake_llm.requests) == 3
    assert not any("reasoning_content" in m for m in fake_llm.requests[2].json["messages"])


@pytest.mark.parametrize("seed", SEEDS)
def test_openrouter_reasoning_field_goes_back_under_its_own_name(fake_llm: FakeLLM, tmp_path: Path, seed: int | None) -> None:
    calls = thinking(tool_call_stream(("c1", "list_dir", {"path": "."})), "Listing.", key="reasoning")
    fake_llm.script(maybe_shred(calls, seed), text_stream("done"))
    ((outcome, ctx),) = turns(fake_llm, tmp_path, "ls")
    assert done(outcome).reply == "done" and "".join(ctx.reasonings) == "Listing."
    sent = fake_llm.requests[1].json["messages"][-2]
    assert sent["reasoning"] == "Listing." and "reasoning_content" not in sent


@pytest.mark.parametrize(("mode", "expect"), [("all", [True, True]), ("none", [False, False]), ("tool_turns", [False, True])])
def test_reasoning_history_setting(fake_llm: FakeLLM, tmp_path: Path, mode: str, expect: list[bool]) -> None:
    fake_llm.script(
        thinking(text_stream("one"), "first thought"),
        thinking(tool_call_stream(("c1", "list_dir", {"path": "."})), "second thought"),
        text_stream("two"),
    )
    turns(fake_llm, tmp_path, "a", "b", reasoning_history=mode)
    sent = fake_llm.requests[2].json["messages"]
    assistants = [m for m in sent if m["role"] == "assistant"]
    assert ["reasoning_content" in m for m in assistants] == expect


def test_compaction_counts_reasoning(fake_llm: FakeLLM, tmp_path: Path) -> None:
    # The text alone is a few tokens; the reasoning ~1000 (4000 chars / 4).
    fake_llm.script(thinking(text_stream("ok"), "x" * 4000), text_stream("summary"), text_stream("fine"))
    (_, (second, ctx)) = turns(
        fake_llm, tmp_path, "a", "b",
        agent=AgentSettings(system_prompt="s", loop=LoopSettings(compaction_threshold_tokens=600, compaction_keep_recent_turns=1)),
        tools=ToolsSettings(enabled=[]),
    )
    assert done(second).reply == "fine"
    (notice,) = ctx.notices_of("compaction")
    assert notice["tokens_before"] >= 1000 and notice["method"] == "summarized"
    assert notice["tokens_after"] < 100
    # The summary request went out as the second request.
    assert "Write the updated summary now." in fake_llm.requests[1].json["messages"][-1]["content"]


@pytest.mark.parametrize(("mode", "fails"), [("none", 0), ("all", 1)])
def test_the_deepseek_check_bites(fake_llm: FakeLLM, tmp_path: Path, mode: str, fails: int) -> None:
    """The strict server above is strict: "none" omits what the follow-up
    needs, "all" sends what a later turn must not."""
    fake_llm.check = deepseek_check
    fake_llm.script(thinking(tool_call_stream(("c1", "list_dir", {"path": "."})), "look"), text_stream("x"), text_stream("y"))
    outcomes = [o for o, _ in turns(fake_llm, tmp_path, "a", "b", reasoning_history=mode)]
    failed = [i for i, o in enumerate(outcomes) if not hasattr(o, "reply")]
    assert failed == [fails]
    assert "reasoning_content" in outcomes[fails].reason
