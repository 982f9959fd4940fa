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


# -- errors that say what happened --------------------------------------------


def test_openrouter_error_body_reaches_the_client_in_full_and_400_is_not_retried(
    fake_llm: FakeLLM, tmp_path: Path
) -> None:
    fake_llm.script(
        Reply(
            400,
            {
                "error": {
                    "message": "Provider returned error",
                    "code": 400,
                    "metadata": {
                        "raw": '{"error":{"message":"Unsupported parameter: tool_choice"}}',
                        "provider_name": "Azure",
                    },
                }
            },
        )
    )
    ((outcome, _),) = turns(fake_llm, tmp_path, "hi")
    reason = failed(outcome).reason
    assert "Provider returned error" in reason and "code=400" in reason
    assert "upstream Azure said" in reason and "Unsupported parameter: tool_choice" in reason
    assert "parameter" in reason  # the likely cause is named
    assert len(fake_llm.requests) == 1


@pytest.mark.parametrize(
    ("status", "body", "expect"),
    [
        (401, {"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}}, "SESSIOND_T_KEY"),
        (404, {"error": {"message": "The model does not exist", "code": "model_not_found"}}, "unknown model 'test-model'"),
        (403, {"error": "forbidden"}, "no access to model 'test-model'"),
    ],
)
def test_client_errors_name_the_likely_cause_and_are_not_retried(
    fake_llm: FakeLLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    status: int, body: dict[str, Any], expect: str,
) -> None:
    monkeypatch.setenv("SESSIOND_T_KEY", "sk-abcdef")
    fake_llm.script(Reply(status, body))
    ((outcome, _),) = turns(fake_llm, tmp_path, "hi", api_key_env="SESSIOND_T_KEY")
    reason = failed(outcome).reason
    assert f"HTTP {status}" in reason and expect in reason
    if isinstance(body["error"], dict):
        assert body["error"]["code"] in reason
    assert len(fake_llm.requests) == 1


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("style", ["data", "event"])
def test_error_event_after_some_tokens(fake_llm: FakeLLM, tmp_path: Path, seed: int | None, style: str) -> None:
    error = {"message": "upstream overloaded", "type": "server_error", "code": "overloaded"}
    tail: Any = (
        {"error": error} if style == "data" else f"event: error\ndata: {json.dumps(error)}\n\n"
    )
    fake_llm.script(
        maybe_shred(Stream([chunk({"content": "Partial "}), chunk({"content": "answer"}), tail], done=False), seed),
        text_stream("fresh"),
    )
    (first, ctx), (second, _) = turns(fake_llm, tmp_path, "q1", "q2")
    reason = failed(first).reason
    assert ctx.text == "Partial answer"
    assert "upstream overloaded" in reason and "code=overloaded" in reason and "type=server_error" in reason
    assert done(second).reply == "fresh"
    sent = fake_llm.requests[1].json["messages"]
    assert sent[-3]["content"] == "q1"
    assert sent[-2]["role"] == "assistant" and sent[-2]["content"].startswith("Partial answer")
    assert sent[-1] == {"role": "user", "content": "q2"}


@pytest.mark.parametrize(
    ("headers", "wait"), [({"Retry-After": "0.3"}, 0.3), ({"retry-after-ms": "250", "Retry-After": "9"}, 0.25)]
)
def test_429_waits_as_the_server_asks(fake_llm: FakeLLM, tmp_path: Path, headers: dict[str, str], wait: float) -> None:
    fake_llm.script(Reply(429, {"error": {"message": "Rate limit reached", "code": "rate_limit_exceeded"}}, headers), text_stream("ok"))
    ((outcome, ctx),) = turns(fake_llm, tmp_path, "hi")
    assert done(outcome).reply == "ok"
    first, second = fake_llm.requests
    assert second.received_at - first.received_at >= wait
    (retry,) = ctx.notices_of("provider_retry")
    assert retry["delay_secs"] == pytest.approx(wait) and "rate_limit_exceeded" in retry["error"]
    assert second.json == first.json


def test_retry_after_past_the_turn_timeout_fails_now(fake_llm: FakeLLM, tmp_path: Path) -> None:
    from test_agent_support import AgentSettings

    fake_llm.script(Reply(503, {"error": {"message": "busy"}}, {"Retry-After": "30"}))
    started = time.monotonic()
    ((outcome, _),) = turns(fake_llm, tmp_path, "hi", agent=AgentSettings(turn_timeout_secs=5))
    assert time.monotonic() - started < 4
    reason = failed(outcome).reason
    assert "busy" in reason and "agent.turn_timeout_secs" in reason
    assert len(fake_llm.requests) == 1


# -- history after a failed turn ------------------------------------------------


def check_strictly(body: Any) -> str | None:
    """What strict chat templates enforce: after the system message, user and
    assistant alternate, starting with user; tool messages only right after
    an assistant tool call (or another tool message)."""
    previous = "assistant"
    for m in body["messages"]:
        role = m["role"]
        if role == "system":
            continue
        if role == "tool":
            if previous not in ("assistant_calls", "tool"):
                return "tool message without a tool call"
        elif role == "user" and previous == "user":
            return "Conversation roles must alternate user/assistant/user/assistant/..."
        elif role == "assistant" and previous not in ("user", "tool"):
            return "Conversation roles must alternate user/assistant/user/assistant/..."
        previous = "assistant_calls" if role == "assistant" and m.get("tool_calls") else role
    return None


@pytest.mark.parametrize("failure", ["http_400", "stream_cut_before_text", "error_after_tool"])
def test_history_stays_alternating_after_a_failed_turn(fake_llm: FakeLLM, tmp_path: Path, failure: str) -> None:
    fake_llm.check = check_strictly
    if failure == "http_400":
        fake_llm.script(Reply(400, {"error": {"message": "bad request"}}))
    elif failure == "stream_cut_before_text":
        fake_llm.script(Stream([chunk({"role": "assistant"})], cut=True))
    else:
        fake_llm.script(
            tool_call_stream(("c1", "list_dir", {"path": "."})),
            Reply(400, {"error": {"message": "bad request"}}),
        )
    fake_llm.script(text_stream("second answer"))
    (first, _), (second, _) = turns(fake_llm, tmp_path, "q1", "q2")
    failed(first)
    assert done(second).reply == "second answer"
    sent = fake_llm.requests[-1].json["messages"]
    assert check_strictly({"messages": sent}) is None
    # The failed input is still there, answered by a note saying it failed.
    i = [m.get("content") for m in sent].index("q1")
    after = sent[i + 1 :]
    assert after[-1] == {"role": "user", "content": "q2"}
    assert after[-2]["role"] == "assistant" and "request failed" in after[-2]["content"]


def test_old_history_with_two_user_messages_is_merged_when_sent(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.check = check_strictly
    fake_llm.script(text_stream("ok"))
    session = Session(fake_llm, tmp_path)

    async def go() -> TurnResult | TurnFailure:
        session.handler = make_handler(session.settings, session.ws)
        # As an older version stored a failed turn: its input, no reply.
        session.handler.restore(None, [{"v": 1, "ops": [{"op": "append", "message": {"role": "user", "content": "lost"}}], "failed": True}])
        try:
            return (await session.turn("again"))[0]
        finally:
            await session.close()

    assert done(run(go())).reply == "ok"
    assert fake_llm.requests[0].json["messages"][1:] == [{"role": "user", "content": "lost\n\nagain"}]


# -- servers that do not know every parameter ---------------------------------


def test_stream_options_rejected_by_name_is_dropped_for_the_session(fake_llm: FakeLLM, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def old_azure(body: Any) -> str | None:
        if "stream_options" in body:
            return "Unrecognized request argument supplied: stream_options"
        return None

    fake_llm.check = old_azure
    fake_llm.script(text_stream("one"), text_stream("two"))
    with caplog.at_level("WARNING", logger="sessiond.worker.agent"):
        (first, ctx), (second, _) = turns(fake_llm, tmp_path, "a", "b")
    assert done(first).reply == "one" and done(second).reply == "two"
    # Rejected once, retried once without it, never sent again.
    assert ["stream_options" in r.json for r in fake_llm.requests] == [True, False, False]
    (notice,) = ctx.notices_of("provider_retry")
    assert notice["dropped_parameter"] == "stream_options" and "Unrecognized request argument" in notice["error"]
    assert len([r for r in caplog.records if "stream_options" in r.getMessage()]) == 1


def test_stream_usage_off_sends_no_stream_options(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(text_stream("ok"))
    ((outcome, _),) = turns(fake_llm, tmp_path, "a", stream_usage=False)
    assert done(outcome).reply == "ok" and "stream_options" not in fake_llm.requests[0].json


def test_a_400_naming_no_optional_parameter_is_not_retried(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(Reply(400, {"error": {"message": "messages: roles must alternate"}}))
    ((outcome, _),) = turns(fake_llm, tmp_path, "a")
    failed(outcome)
    assert len(fake_llm.requests) == 1


# -- odd tool calls -------------------------------------------------------------


def calls_stream(*tool_call_deltas: list[dict[str, Any]]) -> Stream:
    events: list[Any] = [chunk({"role": "assistant", "content": None})]
    events += [chunk({"tool_calls": delta}) for delta in tool_call_deltas]
    events.append(chunk({}, "tool_calls"))
    return Stream(events)


def fn(name: str | None, arguments: str) -> dict[str, Any]:
    out: dict[str, Any] = {"arguments": arguments}
    if name is not None:
        out["name"] = name
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["", None])
def test_nameless_tool_call_gets_an_error_the_model_can_act_on(fake_llm: FakeLLM, tmp_path: Path, seed: int | None, name: str | None) -> None:
    fake_llm.script(
        maybe_shred(calls_stream([{"index": 0, "id": "c1", "type": "function", "function": fn(name, '{"path": "."}')}]), seed),
        text_stream("sorry"),
    )
    ((outcome, ctx),) = turns(fake_llm, tmp_path, "list")
    assert done(outcome).reply == "sorry"
    (result,) = ctx.notices_of("tool_result")
    assert result["id"] == "c1" and not result["ok"] and "no function name" in result["output"]
    sent = fake_llm.requests[1].json["messages"]
    assert sent[-2]["tool_calls"][0]["function"]["name"] == "missing_tool_name"
    assert sent[-1]["tool_call_id"] == "c1" and "list_dir" in sent[-1]["content"]


@pytest.mark.parametrize("seed", SEEDS)
def test_tool_call_without_id_gets_one_and_runs(fake_llm: FakeLLM, tmp_path: Path, seed: int | None) -> None:
    fake_llm.script(
        maybe_shred(calls_stream([{"index": 0, "function": fn("write_file", '{"path": "a.txt", ')}],
                                 [{"index": 0, "function": fn(None, '"content": "A"}')}]), seed),
        text_stream("done"),
    )
    ((outcome, ctx),) = turns(fake_llm, tmp_path, "write")
    assert done(outcome).reply == "done" and (tmp_path / "ws" / "a.txt").read_text() == "A"
    sent = fake_llm.requests[1].json["messages"]
    call_id = sent[-2]["tool_calls"][0]["id"]
    assert call_id.startswith("call_") and sent[-1]["tool_call_id"] == call_id
    assert ctx.notices_of("tool_result")[0]["id"] == call_id


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("style", ["mistral_ids_no_index", "no_ids_no_index", "same_index_new_ids"])
def test_parallel_calls_without_a_usable_index_are_all_run(fake_llm: FakeLLM, tmp_path: Path, seed: int | None, style: str) -> None:
    a = fn("write_file", '{"path": "a.txt", "content": "A"}')
    b = fn("write_file", '{"path": "b.txt", "content": "B"}')
    if style == "mistral_ids_no_index":
        deltas = [[{"id": "AbC123xyz", "function": a}, {"id": "DeF456uvw", "function": b}]]
    elif style == "no_ids_no_index":
        deltas = [[{"function": a}], [{"function": b}]]
    else:
        deltas = [[{"index": 0, "id": "c1", "function": a}], [{"index": 0, "id": "c2", "function": b}]]
    fake_llm.script(maybe_shred(calls_stream(*deltas), seed), text_stream("both"))
    ((outcome, ctx),) = turns(fake_llm, tmp_path, "two files")
    assert done(outcome).reply == "both"
    assert (tmp_path / "ws" / "a.txt").read_text() == "A" and (tmp_path / "ws" / "b.txt").read_text() == "B"
    assert [n["ok"] for n in ctx.notices_of("tool_result")] == [True, True]
    sent = fake_llm.requests[1].json["messages"]
    ids = [c["id"] for c in sent[-3]["tool_calls"]]
    assert len(set(ids)) == 2 and [m["tool_call_id"] for m in sent[-2:]] == ids


# -- usage ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_usage_of_every_call_of_a_turn_is_summed(fake_llm: FakeLLM, tmp_path: Path, seed: int | None) -> None:
    calls = tool_call_stream(("c1", "list_dir", {"path": "."}))
    calls.events.append({"id": "x", "object": "chat.completion.chunk", "choices": [],
                         "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120,
                                   "completion_tokens_details": {"reasoning_tokens": 7}}})
    answer = text_stream("ok")
    answer.events.append({"choices": [], "usage": {"prompt_tokens": 150, "completion_tokens": 3}})
    fake_llm.script(maybe_shred(calls, seed), maybe_shred(answer, seed))
    ((outcome, _),) = turns(fake_llm, tmp_path, "look")
    assert done(outcome).usage == {"prompt_tokens": 250, "completion_tokens": 23, "reasoning_tokens": 7}
    assert fake_llm.requests[0].json["stream_options"] == {"include_usage": True}


def test_no_usage_chunk_means_no_usage(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(text_stream("ok"))
    ((outcome, _),) = turns(fake_llm, tmp_path, "hi")
    assert done(outcome).usage == {}
