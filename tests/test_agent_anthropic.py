"""The agent against Anthropic's Messages API (`[provider] kind =
"anthropic"`), over loopback: the exact request body and headers, thinking
blocks sent back with their signatures, tool_use and tool_result blocks,
errors inside the stream, stop reasons and usage.

Each stream is also fed cut into small random pieces (`shredded`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fakellm import FakeLLM, Stream, fake_llm
from test_agent_dialects import SEEDS, done, failed, maybe_shred, turns
from test_agent_support import AgentSettings, ToolsSettings

__all__ = ["fake_llm"]

pytestmark = pytest.mark.component

KEY = "sk-ant-test-0123456789"


def ev(kind: str, **data: Any) -> str:
    """One Messages API stream event, named as Anthropic names them."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def start(input_tokens: int = 25) -> str:
    return ev("message_start", message={
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test", "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 1},
    })


def end(stop_reason: str, output_tokens: int = 15) -> list[str]:
    return [
        ev("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": None},
           usage={"output_tokens": output_tokens}),
        ev("message_stop"),
    ]


def text_block(index: int, *pieces: str) -> list[str]:
    return [
        ev("content_block_start", index=index, content_block={"type": "text", "text": ""}),
        *[ev("content_block_delta", index=index, delta={"type": "text_delta", "text": p}) for p in pieces],
        ev("content_block_stop", index=index),
    ]


def answer(*pieces: str, stop_reason: str = "end_turn") -> Stream:
    return Stream([start(), ev("ping"), *text_block(0, *pieces), *end(stop_reason)], done=False)


def settings(**kw: Any) -> dict[str, Any]:
    return {"kind": "anthropic", "api_key_env": "SESSIOND_T_ANTHROPIC", "max_tokens": 2048, **kw}


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_T_ANTHROPIC", KEY)


@pytest.mark.parametrize("seed", SEEDS)
def test_thinking_and_tool_use_then_the_exact_next_request(fake_llm: FakeLLM, tmp_path: Path, seed: int | None) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "a.txt").write_text("A")
    calls = Stream([
        start(),
        ev("content_block_start", index=0, content_block={"type": "thinking", "thinking": "", "signature": ""}),
        ev("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "The user wants "}),
        ev("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "a listing. ✓"}),
        ev("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "EqQBCgIYAhIM+sig/=="}),
        ev("content_block_stop", index=0),
        ev("content_block_start", index=1, content_block={"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"}),
        ev("content_block_stop", index=1),
        *text_block(2, "Let me ", "look."),
        ev("content_block_start", index=3, content_block={"type": "tool_use", "id": "toolu_01A", "name": "list_dir", "input": {}}),
        ev("content_block_delta", index=3, delta={"type": "input_json_delta", "partial_json": ""}),
        ev("content_block_delta", index=3, delta={"type": "input_json_delta", "partial_json": '{"pa'}),
        ev("content_block_delta", index=3, delta={"type": "input_json_delta", "partial_json": 'th": "."}'}),
        ev("content_block_stop", index=3),
        *end("tool_use", 40),
    ], done=False)
    fake_llm.script(maybe_shred(calls, seed), maybe_shred(answer("One file: ", "a.txt."), seed), answer("Bye."))
    (first, ctx), (second, _) = turns(
        fake_llm, tmp_path, "list it", "thanks",
        agent=AgentSettings(system_prompt="Be brief."), tools=ToolsSettings(enabled=["list_dir"]),
        **settings(thinking_budget_tokens=1024),
    )
    result = done(first)
    assert result.reply == "Let me look.\n\nOne file: a.txt."
    assert "".join(ctx.reasonings) == "The user wants a listing. ✓"
    (call,) = ctx.notices_of("tool_call")
    assert call == {"id": "toolu_01A", "name": "list_dir", "arguments": {"path": "."}}
    (tool_result,) = ctx.notices_of("tool_result")
    assert tool_result["ok"] and "a.txt" in tool_result["output"]
    assert result.usage == {"prompt_tokens": 50, "completion_tokens": 55}

    first_request, follow_up, next_turn = fake_llm.requests
    assert follow_up.path == "/v1/messages"
    assert follow_up.headers["x-api-key"] == KEY and follow_up.headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in follow_up.headers
    tools = follow_up.json.pop("tools")
    assert [t["name"] for t in tools] == ["list_dir"] and set(tools[0]) == {"name", "description", "input_schema"}
    assert tools[0]["input_schema"]["properties"]["path"]["type"] == "string"
    assert follow_up.json == {
        "model": "test-model",
        "max_tokens": 2048,
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "list it"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "The user wants a listing. ✓", "signature": "EqQBCgIYAhIM+sig/=="},
                {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_01A", "name": "list_dir", "input": {"path": "."}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A", "content": tool_result["output"]},
            ]},
        ],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "stream": True,
    }
    assert first_request.json["messages"] == [{"role": "user", "content": "list it"}]
    # The next turn: earlier turns' thinking is not sent back (tool_turns).
    assert done(second).reply == "Bye."
    sent = next_turn.json["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user", "assistant", "user"]
    assert not any(b["type"] in ("thinking", "redacted_thinking") for m in sent if m["role"] == "assistant" for b in m["content"])
    assert sent[-1] == {"role": "user", "content": "thanks"}


@pytest.mark.parametrize("seed", SEEDS)
def test_error_event_mid_stream_fails_the_turn_with_anthropics_words(fake_llm: FakeLLM, tmp_path: Path, seed: int | None) -> None:
    broken = Stream([
        start(), *text_block(0, "Partial ", "answer")[:-1],
        ev("error", error={"type": "overloaded_error", "message": "Overloaded"}),
    ], done=False)
    fake_llm.script(maybe_shred(broken, seed), answer("fresh"))
    (first, ctx), (second, _) = turns(fake_llm, tmp_path, "q1", "q2", **settings())
    reason = failed(first).reason
    assert "Overloaded" in reason and "overloaded_error" in reason
    assert ctx.text == "Partial answer"
    assert done(second).reply == "fresh"
    sent = fake_llm.requests[1].json["messages"]
    assert sent[0] == {"role": "user", "content": "q1"}
    assert sent[1]["role"] == "assistant" and sent[1]["content"][0]["text"].startswith("Partial answer")
    assert sent[2] == {"role": "user", "content": "q2"}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("stop_reason", "stop"), [("max_tokens", "truncated"), ("refusal", "refused")])
def test_stop_reason_ends_the_turn_early(fake_llm: FakeLLM, tmp_path: Path, seed: int | None, stop_reason: str, stop: str) -> None:
    fake_llm.script(maybe_shred(answer("Once upon", " a time", stop_reason=stop_reason), seed))
    ((outcome, ctx),) = turns(fake_llm, tmp_path, "story", **settings())
    result = done(outcome)
    assert (result.reply, result.stop_reason, result.stop_detail) == ("Once upon a time", stop, stop_reason)
    assert ctx.text == "Once upon a time"
    assert result.usage == {"prompt_tokens": 25, "completion_tokens": 15}


def test_stream_cut_before_message_stop_fails_the_turn(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(Stream([start(), *text_block(0, "half")], done=False))
    ((outcome, ctx),) = turns(fake_llm, tmp_path, "q", **settings())
    assert "ended before the response was complete" in failed(outcome).reason
    assert ctx.text == "half"


def test_default_max_tokens_and_no_thinking(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(answer("ok"))
    ((outcome, _),) = turns(fake_llm, tmp_path, "q", **{**settings(), "max_tokens": None})
    assert done(outcome).reply == "ok"
    body = fake_llm.requests[0].json
    assert body["max_tokens"] == 4096 and "thinking" not in body
    assert "stream_options" not in body
