"""The agent against the dialects of real providers, over loopback: how a
reply ends (truncated, filtered), errors and retries, strict servers,
parameters a server does not know, odd tool calls, usage, reasoning text,
and Anthropic's Messages API.

Each stream is also fed cut into small random pieces (`shredded`), and each
test checks both what the client saw and what the next request carried.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from fakellm import FakeLLM, Reply, Stream, chunk, fake_llm, shredded, text_stream, tool_call_stream
from session_worker.agent import AgentHandler
from session_worker.handler import TurnFailure, TurnResult
from ipc.settings import SessionSettings
from test_agent_support import FakeCtx, make_handler, make_settings, run

__all__ = ["fake_llm"]

pytestmark = pytest.mark.component

SEEDS = [None, 1, 2]


def maybe_shred(stream: Stream, seed: int | None) -> Stream:
    return stream if seed is None else shredded(stream, seed)


class Session:
    """One AgentHandler over several turns, as a worker runs it."""

    def __init__(self, llm: FakeLLM, tmp_path: Path, **kw: Any) -> None:
        self.settings: SessionSettings = make_settings(llm, **kw)
        self.ws = tmp_path / "ws"
        self.handler: AgentHandler | None = None

    async def turn(self, text: str) -> tuple[TurnResult | TurnFailure, FakeCtx]:
        if self.handler is None:
            self.handler = make_handler(self.settings, self.ws)
        ctx = FakeCtx(self.settings, self.ws)
        try:
            return await self.handler.handle(text, ctx), ctx
        except TurnFailure as exc:
            return exc, ctx

    async def close(self) -> None:
        if self.handler is not None:
            await self.handler.aclose()


def turns(llm: FakeLLM, tmp_path: Path, *texts: str, **kw: Any) -> list[tuple[TurnResult | TurnFailure, FakeCtx]]:
    session = Session(llm, tmp_path, **kw)

    async def go() -> list[tuple[TurnResult | TurnFailure, FakeCtx]]:
        try:
            return [await session.turn(t) for t in texts]
        finally:
            await session.close()

    return run(go())


def done(outcome: TurnResult | TurnFailure) -> TurnResult:
    assert isinstance(outcome, TurnResult), f"turn failed: {outcome}"
    return outcome


def failed(outcome: TurnResult | TurnFailure) -> TurnFailure:
    assert isinstance(outcome, TurnFailure), f"turn did not fail: {outcome}"
    return outcome


# -- why a reply ended --------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("finish", "stop"), [("length", "truncated"), ("content_filter", "filtered")]
)
def test_truncated_or_filtered_reply_ends_the_turn_with_its_reason(
    fake_llm: FakeLLM, tmp_path: Path, seed: int | None, finish: str, stop: str
) -> None:
    fake_llm.script(maybe_shred(text_stream("The answer is", " 4", finish_reason=finish), seed), text_stream("ok"))
    (first, ctx), (second, _) = turns(fake_llm, tmp_path, "q", "next")
    result = done(first)
    assert result.reply == "The answer is 4"
    assert (result.stop_reason, result.stop_detail) == (stop, finish)
    assert ctx.text == "The answer is 4"
    assert done(second).stop_reason == ""
    # The cut reply is in the history as the model wrote it.
    assert fake_llm.requests[1].json["messages"][-3:] == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "The answer is 4"},
        {"role": "user", "content": "next"},
    ]


@pytest.mark.parametrize("seed", SEEDS)
def test_tool_call_cut_by_the_token_limit_is_not_run(fake_llm: FakeLLM, tmp_path: Path, seed: int | None) -> None:
    # Arguments cut mid-JSON, then finish_reason "length".
    stream = tool_call_stream(("c1", "write_file", '{"path": "a.txt", "content": "hal'))
    stream.events[-1] = chunk({}, "length")
    fake_llm.script(maybe_shred(stream, seed), text_stream("ok"))
    (first, ctx), (second, _) = turns(fake_llm, tmp_path, "write", "again")
    result = done(first)
    assert result.stop_reason == "truncated"
    assert not (tmp_path / "ws" / "a.txt").exists()
    assert ctx.notices_of("tool_call") == []
    (notice,) = ctx.notices_of("tool_calls_not_run")
    assert notice["reason"] == "truncated" and notice["calls"] == [{"id": "c1", "name": "write_file"}]
    # The next request carries no unanswered tool call, and says what happened.
    sent = fake_llm.requests[1].json["messages"]
    assert not any(m.get("tool_calls") for m in sent) and not any(m["role"] == "tool" for m in sent)
    assert "write_file not run" in sent[-2]["content"] and sent[-1]["content"] == "again"
