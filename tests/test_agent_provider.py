"""The provider over real loopback HTTP: streaming, dialects, retries, errors,
and the API key never leaking."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fakellm import Delay, FakeLLM, Hang, Reply, Stream, chunk, fake_llm, text_stream, tool_call_stream
from session_worker.agent._provider import Provider, _anext_flushing_first
from session_worker.handler import TurnFailure, TurnResult
from ipc.settings import ProviderSettings
from test_agent_support import FakeCtx, make_handler, make_settings, run

__all__ = ["fake_llm"]

KEY_ENV = "SESSIOND_TEST_PROVIDER_KEY"
KEY = "sk-test-7f3a9c0ffee-DO-NOT-LEAK"


def one_turn(llm: FakeLLM, tmp_path: Path, text: str = "hi", **kw: Any) -> tuple[TurnResult, FakeCtx]:
    settings = make_settings(llm, **kw)
    ws = tmp_path / "ws"

    async def go() -> tuple[TurnResult, FakeCtx]:
        handler = make_handler(settings, ws)
        ctx = FakeCtx(settings, ws)
        try:
            return await handler.handle(text, ctx), ctx
        finally:
            await handler.aclose()

    return run(go())


def failing_turn(llm: FakeLLM, tmp_path: Path, **kw: Any) -> tuple[TurnFailure, FakeCtx]:
    settings = make_settings(llm, **kw)
    ws = tmp_path / "ws"
    ctx = FakeCtx(settings, ws)

    async def go() -> TurnFailure:
        handler = make_handler(settings, ws)
        try:
            with pytest.raises(TurnFailure) as info:
                await handler.handle("hi", ctx)
            return info.value
        finally:
            await handler.aclose()

    return run(go()), ctx


@pytest.mark.component
def test_text_streams_as_deltas_and_request_is_openai_shaped(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(text_stream("Hel", "lo", " wor", "ld"))
    result, ctx = one_turn(fake_llm, tmp_path)
    # Pieces that arrive in one network read are passed on together.
    assert "".join(ctx.emits) == "Hello world" and all(ctx.emits)
    assert result.reply == "Hello world" and not result.interrupted
    (req,) = fake_llm.requests
    body = req.json
    assert body["model"] == "test-model" and body["stream"] is True
    assert body["messages"][0]["role"] == "system"
    assert body["messages"][1:] == [{"role": "user", "content": "hi"}]
    names = {t["function"]["name"] for t in body["tools"]}
    assert names == {"bash", "read_file", "write_file", "list_dir", "spawn_agent"}
    assert "authorization" not in req.headers


@pytest.mark.component
def test_deltas_reach_the_client_before_the_stream_ends(fake_llm: FakeLLM, tmp_path: Path) -> None:
    # The second piece comes 0.3 s after the first: emits must be incremental.
    fake_llm.script(Stream([chunk({"content": "first"}), Delay(0.3), chunk({"content": "second"}, "stop")]))
    settings = make_settings(fake_llm)
    stamps: list[float] = []

    class Ctx(FakeCtx):
        def emit(self, text: str) -> None:
            stamps.append(time.monotonic())
            super().emit(text)

    async def go() -> None:
        handler = make_handler(settings, tmp_path / "ws")
        await handler.handle("hi", Ctx(settings, tmp_path / "ws"))
        await handler.aclose()

    run(go())
    assert len(stamps) == 2 and stamps[1] - stamps[0] >= 0.25


@pytest.mark.component
def test_events_of_one_read_are_emitted_once_in_order(fake_llm: FakeLLM, tmp_path: Path) -> None:
    # One HTTP chunk with five events (text, a tool call, more text), then
    # after a pause the rest.  The first text goes at once, the rest of the
    # read together, and the call is assembled whole.
    first = "".join(
        f"data: {json.dumps(c)}\n\n"
        for c in [
            chunk({"role": "assistant", "content": ""}),
            chunk({"content": "a"}),
            chunk({"content": "b", "tool_calls": [{"index": 0, "id": "c1", "function": {"name": "list_dir", "arguments": "{\"pa"}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": "th\": \".\"}"}}]}),
            chunk({"content": "c"}),
        ]
    )
    fake_llm.script(
        Stream([first, Delay(0.2), chunk({"content": "d"}, "tool_calls")]), text_stream("e")
    )
    result, ctx = one_turn(fake_llm, tmp_path)
    assert ctx.emits[:3] == ["a", "bc", "d"]
    assert ctx.notices_of("tool_call") == [{"id": "c1", "name": "list_dir", "arguments": {"path": "."}}]
    assert result.reply.startswith("abcd")


@pytest.mark.component
def test_first_text_leaves_before_the_rest_of_its_read_is_parsed(fake_llm: FakeLLM, tmp_path: Path) -> None:
    # The worker writes a pass's frames together at the loop's next pass
    # (ipc.connection); the first text is flushed before the provider
    # parses the events still in hand, the rest are not.
    first = "".join(f"data: {json.dumps(chunk({'content': c}))}\n\n" for c in "abc")
    fake_llm.script(Stream([first, Delay(0.1), chunk({"content": "d"}, "stop")]))
    settings = make_settings(fake_llm)
    log: list[str] = []

    class Ctx(FakeCtx):
        def emit(self, text: str) -> None:
            log.append(f"emit {text}")
            super().emit(text)

        def flush(self) -> None:
            log.append("flush")

    async def go() -> None:
        handler = make_handler(settings, tmp_path / "ws")
        await handler.handle("hi", Ctx(settings, tmp_path / "ws"))
        await handler.aclose()

    run(go())
    assert log == ["emit a", "flush", "emit bc", "emit d"]


@pytest.mark.component
def test_no_log_line_per_request(fake_llm: FakeLLM, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Workers log at INFO; httpx would log each request there.
    fake_llm.script(text_stream("a"))
    with caplog.at_level(logging.INFO):
        one_turn(fake_llm, tmp_path)
    assert not [r for r in caplog.records if r.name.startswith("httpx")]


@pytest.mark.pure
def test_anext_flushes_only_before_a_real_wait() -> None:
    log: list[str] = []
    gate: asyncio.Future[None] | None = None
    closed = False

    async def items() -> Any:
        nonlocal gate, closed
        try:
            yield b"1"  # in hand: no suspension
            yield b"2"
            gate = asyncio.get_running_loop().create_future()
            await gate
            yield b"3"
            gate = asyncio.get_running_loop().create_future()
            await gate
            yield b"never"
        finally:
            closed = True

    async def go() -> None:
        it = items()
        flush = lambda: log.append("flush")  # noqa: E731
        for _ in range(2):
            log.append((await _anext_flushing_first(it, flush)).decode())
        reader = asyncio.ensure_future(_anext_flushing_first(it, flush))
        await asyncio.sleep(0)
        assert log == ["1", "2", "flush"] and gate is not None
        gate.set_result(None)
        log.append((await reader).decode())
        # Cancelled while waiting: the cancellation reaches the iterator.
        reader = asyncio.ensure_future(_anext_flushing_first(it, flush))
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert closed and log == ["1", "2", "flush", "3", "flush"]
        with pytest.raises(StopAsyncIteration):
            await _anext_flushing_first(it, flush)

    run(go())


@pytest.mark.component
def test_half_an_emoji_from_the_server_becomes_a_replacement_character(fake_llm: FakeLLM, tmp_path: Path) -> None:
    """A lone surrogate escape ("\\ud83d", as some servers cut an emoji):
    replaced, so the reply can be framed and sent back in the next request."""
    fake_llm.script(text_stream("half ", "\ud83d", " an emoji"), text_stream("next"))
    settings = make_settings(fake_llm)
    ws = tmp_path / "ws"

    async def go() -> tuple[TurnResult, TurnResult]:
        handler = make_handler(settings, ws)
        try:
            first = await handler.handle("hi", FakeCtx(settings, ws))
            return first, await handler.handle("again", FakeCtx(settings, ws))
        finally:
            await handler.aclose()

    first, second = run(go())
    assert first.reply == "half \ufffd an emoji"
    msgspec.msgpack.encode(first.reply)  # what the worker's Delta and Done carry
    assert second.reply == "next"
    assert "half \ufffd an emoji" in json.dumps(fake_llm.requests[-1].json, ensure_ascii=False)


@pytest.mark.component
def test_connection_is_reused_across_calls(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(
        tool_call_stream(("c1", "list_dir", {"path": "."})), text_stream("a"), text_stream("b")
    )
    settings = make_settings(fake_llm)

    async def go() -> None:
        handler = make_handler(settings, tmp_path / "ws")
        await handler.handle("one", FakeCtx(settings, tmp_path))
        await handler.handle("two", FakeCtx(settings, tmp_path))
        await handler.aclose()

    run(go())
    assert len(fake_llm.requests) == 3 and fake_llm.connections == 1


# --- dialects ----------------------------------------------------------------
# Streams written the way each server sends them (field sets and quirks taken
# from their outputs): the tool call reads notes.txt, then a text answer.


def lines(*objs: dict[str, Any] | str, crlf: bool = False) -> list[str | dict[str, Any]]:
    sep = "\r\n" if crlf else "\n"
    out: list[str | dict[str, Any]] = []
    for o in objs:
        out.append(o if isinstance(o, str) else f"data: {json.dumps(o, separators=(',', ':'))}{sep}{sep}")
    return out


def openai_streams() -> tuple[list[Any], list[Any], str]:
    base = {"id": "chatcmpl-A1b2", "object": "chat.completion.chunk", "created": 1727000000,
            "model": "gpt-4o-2024-08-06", "system_fingerprint": "fp_5050236cbd", "usage": None}
    def c(d: dict[str, Any], fin: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": fin}]}
    tool = lines(
        c({"role": "assistant", "content": None, "tool_calls": [{"index": 0, "id": "call_OAI1", "type": "function", "function": {"name": "read_file", "arguments": ""}}], "refusal": None}),
        c({"tool_calls": [{"index": 0, "function": {"arguments": "{\"pa"}}]}),
        c({"tool_calls": [{"index": 0, "function": {"arguments": "th\": \"no"}}]}),
        c({"tool_calls": [{"index": 0, "function": {"arguments": "tes.txt\"}"}}]}),
        c({}, "tool_calls"),
        {**base, "choices": [], "usage": {"prompt_tokens": 82, "completion_tokens": 17, "total_tokens": 99}},
        "data: [DONE]\n\n",
    )
    text = lines(
        c({"role": "assistant", "content": "", "refusal": None}),
        c({"content": "Hel"}), c({"content": "lo"}), c({}, "stop"),
        {**base, "choices": [], "usage": {"prompt_tokens": 90, "completion_tokens": 2, "total_tokens": 92}},
        "data: [DONE]\n\n",
    )
    return tool, text, "call_OAI1"


def vllm_streams() -> tuple[list[Any], list[Any], str]:
    base = {"id": "chatcmpl-8e1f", "object": "chat.completion.chunk", "created": 1727000001,
            "model": "Qwen/Qwen2.5-7B-Instruct"}
    def c(d: dict[str, Any], fin: str | None = None, **more: Any) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": fin, **more}]}
    tool = lines(
        c({"role": "assistant", "content": ""}),
        c({"tool_calls": [{"id": "chatcmpl-tool-9a8b", "type": "function", "index": 0, "function": {"name": "read_file"}}]}),
        c({"tool_calls": [{"index": 0, "function": {"arguments": "{\"path\": \""}}]}),
        c({"tool_calls": [{"index": 0, "function": {"arguments": "notes"}}]}),
        c({"tool_calls": [{"index": 0, "function": {"arguments": ".txt\"}"}}]}),
        c({"content": ""}, "tool_calls", stop_reason=None),
        {**base, "choices": [], "usage": {"prompt_tokens": 10, "total_tokens": 40, "completion_tokens": 30}},
        "data: [DONE]\n\n",
    )
    text = lines(
        c({"role": "assistant", "content": ""}), c({"content": "Hel"}), c({"content": "lo"}),
        c({"content": ""}, "stop", stop_reason=None),
        "data: [DONE]\n\n",
    )
    return tool, text, "chatcmpl-tool-9a8b"


def llamacpp_streams() -> tuple[list[Any], list[Any], str]:
    base = {"created": 1727000002, "id": "chatcmpl-Zq1", "model": "gpt-3.5-turbo",
            "system_fingerprint": "b4689-90e4dba4", "object": "chat.completion.chunk"}
    def c(d: dict[str, Any], fin: str | None = None, **more: Any) -> dict[str, Any]:
        return {"choices": [{"finish_reason": fin, "index": 0, "delta": d}], **base, **more}
    timings = {"prompt_n": 12, "prompt_ms": 30.2, "predicted_n": 9, "predicted_ms": 80.5,
               "predicted_per_second": 111.8}
    usage = {"completion_tokens": 9, "prompt_tokens": 12, "total_tokens": 21}
    tool = lines(
        c({"role": "assistant", "content": None}),
        c({"tool_calls": [{"index": 0, "id": "Xy12AbCd", "type": "function", "function": {"name": "read_file", "arguments": "{\""}}]}),
        c({"tool_calls": [{"index": 0, "function": {"arguments": "path\":\"notes.txt"}}]}),
        c({"tool_calls": [{"index": 0, "function": {"arguments": "\"}"}}]}),
        c({}, "tool_calls", usage=usage, timings=timings),
        "data: [DONE]\n\n",
    )
    text = lines(
        c({"role": "assistant", "content": None}), c({"content": "Hel"}), c({"content": "lo"}),
        c({}, "stop", usage=usage, timings=timings),
        "data: [DONE]\n\n",
    )
    return tool, text, "Xy12AbCd"


def ollama_streams(old: bool) -> tuple[list[Any], list[Any], str]:
    base = {"id": "chatcmpl-429", "object": "chat.completion.chunk", "created": 1727000003,
            "model": "llama3.1", "system_fingerprint": "fp_ollama"}
    def c(d: dict[str, Any], fin: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": {"role": "assistant", **d}, "finish_reason": fin}]}
    call: dict[str, Any] = {"id": "call_b9x2k1", "type": "function",
                            "function": {"name": "read_file", "arguments": "{\"path\":\"notes.txt\"}"}}
    if not old:
        call["index"] = 0
    # Whole tool call in one chunk; old versions say "stop" after tool calls.
    tool = lines(
        c({"content": "", "tool_calls": [call]}),
        c({"content": ""}, "stop" if old else "tool_calls"),
        "data: [DONE]\n\n",
    )
    text = lines(c({"content": "Hel"}), c({"content": "lo"}), c({"content": ""}, "stop"),
                 {**base, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
                 "data: [DONE]\n\n")
    return tool, text, "call_b9x2k1"


def crlf_pings_streams() -> tuple[list[Any], list[Any], str]:
    # \r\n line endings, keep-alive comments, "data:" without a space, and an
    # event split across two network chunks in the middle of a line.
    tool = [": OPENROUTER PROCESSING\r\n\r\n"] + lines(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [{"index": 0, "id": "c_crlf", "type": "function", "function": {"name": "read_file", "arguments": ""}}]}}]},
        crlf=True,
    ) + [
        "data:{\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"argu",
        "ments\":\"{\\\"path\\\":\\\"notes.txt\\\"}\"}}]}}]}\r\n\r\n",
        ": ping\r\n\r\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\r\n\r\n",
        "data: [DONE]\r\n\r\n",
    ]
    text = lines(
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        ": ping\r\n\r\n",
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        "data: [DONE]\r\n\r\n",
        crlf=True,
    )
    return tool, text, "c_crlf"


DIALECTS = {
    "openai": openai_streams,
    "vllm": vllm_streams,
    "llamacpp": llamacpp_streams,
    "ollama": lambda: ollama_streams(old=False),
    "ollama_old": lambda: ollama_streams(old=True),
    "crlf_pings": crlf_pings_streams,
}


@pytest.mark.component
@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_dialect(dialect: str, fake_llm: FakeLLM, tmp_path: Path) -> None:
    tool, text, call_id = DIALECTS[dialect]()
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "notes.txt").write_text("hello notes")
    fake_llm.script(Stream(tool, done=False), Stream(text, done=False))
    result, ctx = one_turn(fake_llm, tmp_path)
    assert result.reply == "Hello"
    assert ctx.notices_of("tool_call") == [
        {"id": call_id, "name": "read_file", "arguments": {"path": "notes.txt"}}
    ]
    second = fake_llm.requests[1].json["messages"]
    assert second[-2]["tool_calls"] == [
        {"id": call_id, "type": "function",
         "function": {"name": "read_file", "arguments": second[-2]["tool_calls"][0]["function"]["arguments"]}}
    ]
    assert json.loads(second[-2]["tool_calls"][0]["function"]["arguments"]) == {"path": "notes.txt"}
    assert second[-1] == {"role": "tool", "tool_call_id": call_id, "content": "hello notes"}


@pytest.mark.component
def test_non_streamed_json_answer_is_accepted(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(Reply(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "whole"}, "finish_reason": "stop"}]}))
    result, ctx = one_turn(fake_llm, tmp_path)
    assert result.reply == "whole" and ctx.emits == ["whole"]


# --- errors and retries -------------------------------------------------------


@pytest.mark.component
def test_429_then_success_honours_retry_after(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(
        Reply(429, {"error": {"message": "rate limited"}}, {"Retry-After": "0.3"}),
        text_stream("ok"),
    )
    result, ctx = one_turn(fake_llm, tmp_path, retry_backoff_initial_ms=1)
    assert result.reply == "ok"
    first, second = fake_llm.requests
    assert second.received_at - first.received_at >= 0.3
    (retry,) = ctx.notices_of("provider_retry")
    assert retry["attempt"] == 1 and retry["delay_secs"] == pytest.approx(0.3)
    assert "rate limited" in retry["error"]


@pytest.mark.component
def test_503_without_retry_after_uses_exponential_backoff(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(Reply(503, "busy"), Reply(502, "busy"), text_stream("ok"))
    result, ctx = one_turn(fake_llm, tmp_path, retry_backoff_initial_ms=50)
    assert result.reply == "ok"
    delays = [n["delay_secs"] for n in ctx.notices_of("provider_retry")]
    assert delays == [0.05, 0.1]
    t = [r.received_at for r in fake_llm.requests]
    assert t[1] - t[0] >= 0.05 and t[2] - t[1] >= 0.1


@pytest.mark.component
def test_500_retries_exhausted_fails_the_turn(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(*[Reply(500, {"error": {"message": "boom inside"}})] * 3, text_stream("never"))
    failure, _ = failing_turn(fake_llm, tmp_path, max_retries=2)
    assert len(fake_llm.requests) == 3 and fake_llm.pending == 1
    assert "HTTP 500" in failure.reason and "boom inside" in failure.reason
    assert "3 attempts" in failure.reason
    # The user's input is still committed.
    assert failure.record["ops"][0]["message"] == {"role": "user", "content": "hi"}


@pytest.mark.component
def test_retry_after_beyond_the_cap_fails_at_once(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(Reply(429, "slow down", {"Retry-After": "3600"}))
    start = time.monotonic()
    failure, _ = failing_turn(fake_llm, tmp_path, retry_backoff_max_ms=1000)
    assert time.monotonic() - start < 5
    assert "3600" in failure.reason and len(fake_llm.requests) == 1


@pytest.mark.component
@pytest.mark.parametrize(
    "body, message",
    [
        ({"error": {"message": "This model's maximum context length is 8192 tokens", "type": "invalid_request_error"}}, "maximum context length is 8192"),
        ({"error": "model \"llama9\" not found, try pulling it first"}, "not found, try pulling"),
        ({"detail": "bad field"}, "bad field"),
        ("plain text failure", "plain text failure"),
    ],
)
def test_400_fails_with_the_providers_message(fake_llm: FakeLLM, tmp_path: Path, body: Any, message: str) -> None:
    fake_llm.script(Reply(400, body), text_stream("never"))
    failure, _ = failing_turn(fake_llm, tmp_path)
    assert "HTTP 400" in failure.reason and message in failure.reason
    assert len(fake_llm.requests) == 1


@pytest.mark.component
def test_stream_cut_midway_is_a_clear_failure(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(Stream([chunk({"content": "partial "}), chunk({"content": "answer"})], cut=True))
    failure, ctx = failing_turn(fake_llm, tmp_path)
    assert "lost mid-response" in failure.reason
    assert ctx.text == "partial answer"
    ops = failure.record["ops"]
    assert ops[-1]["message"]["role"] == "assistant"
    assert ops[-1]["message"]["content"].startswith("partial answer")
    assert len(fake_llm.requests) == 1  # a started stream is never replayed


@pytest.mark.component
def test_stream_ending_without_finish_or_done_is_a_failure(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(Stream([chunk({"content": "x"})], done=False))
    failure, _ = failing_turn(fake_llm, tmp_path)
    assert "ended before the response was complete" in failure.reason


@pytest.mark.component
def test_stalled_stream_hits_the_read_timeout(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(Stream([chunk({"content": "x"}), Hang()]))
    start = time.monotonic()
    failure, _ = failing_turn(fake_llm, tmp_path, read_timeout_secs=0.3)
    assert time.monotonic() - start < 5
    assert "sent nothing for 0.3 s" in failure.reason


@pytest.mark.component
def test_error_event_mid_stream(fake_llm: FakeLLM, tmp_path: Path) -> None:
    fake_llm.script(Stream([chunk({"content": "x"}), {"error": {"message": "engine overloaded"}}]))
    failure, _ = failing_turn(fake_llm, tmp_path)
    assert "engine overloaded" in failure.reason


@pytest.mark.component
def test_unreachable_provider_fails_after_retries(tmp_path: Path) -> None:
    # A port that was just free: nothing listens there any more.
    with FakeLLM() as llm:
        url = llm.base_url

    class Gone:
        base_url = url

    failure, _ = failing_turn(Gone(), tmp_path)  # type: ignore[arg-type]
    assert "cannot connect" in failure.reason and "3 attempts" in failure.reason


@pytest.mark.component
def test_no_provider_configured(tmp_path: Path, fake_llm: FakeLLM) -> None:
    failure, _ = failing_turn(fake_llm, tmp_path, base_url=None)
    assert "no LLM provider is configured" in failure.reason


# --- the key ---------------------------------------------------------------------


@pytest.mark.process
def test_api_key_is_sent_but_never_leaks(
    fake_llm: FakeLLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    fake_llm.script(
        tool_call_stream(("c1", "bash", {"command": "env; echo done"})),
        Stream([chunk({"content": f"the key is {KEY}?"})], cut=True),
        Reply(401, {"error": {"message": f"Incorrect API key provided: {KEY}"}}),
    )
    settings = make_settings(fake_llm, api_key_env=KEY_ENV)
    ws = tmp_path / "ws"
    seen: list[Any] = []

    async def go() -> None:
        handler = make_handler(settings, ws)
        for text in ["one", "two"]:
            ctx = FakeCtx(settings, ws)
            with pytest.raises(TurnFailure) as info:
                await handler.handle(text, ctx)
            exc = info.value
            seen.append(exc.reason)
            seen.append("".join(traceback.format_exception(exc)))
            chain: BaseException | None = exc
            while chain is not None:
                seen.append(repr(chain.args))
                seen.append(repr(vars(chain)))
                chain = chain.__cause__ or chain.__context__
            seen.append(exc.record)
            seen.append(ctx.notices)
        seen.append(handler.snapshot())
        await handler.aclose()

    run(go())
    requests = fake_llm.requests
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in requests)
    tool_output = requests[1].json["messages"][-1]["content"]
    assert "HOME=" in tool_output and "done" in tool_output
    blob = msgspec.json.encode(seen).decode() + repr(seen)
    # The mid-stream echo of the key was streamed text from the model itself;
    # everything *we* produced must be clean.
    blob = blob.replace(f"the key is {KEY}?", "")
    assert KEY not in blob
    assert KEY not in tool_output
    assert "[redacted]" in blob  # the 401 message was redacted, not dropped


@pytest.mark.pure
def test_tls_context_only_for_https() -> None:
    def context(base_url: str) -> ssl.SSLContext:
        provider = Provider(ProviderSettings(base_url=base_url, model="m"))
        ctx = provider._client._transport._pool._ssl_context  # type: ignore[attr-defined]
        assert isinstance(ctx, ssl.SSLContext)
        return ctx

    plain = context("http://127.0.0.1:9/v1")
    assert plain.cert_store_stats()["x509_ca"] == 0  # no CA bundle loaded
    # Were it ever used for TLS, it would refuse the server, not trust it.
    assert plain.verify_mode == ssl.CERT_REQUIRED and plain.check_hostname
    verified = context("HTTPS://api.example.com/v1")
    assert verified.cert_store_stats()["x509_ca"] > 0
    assert verified.verify_mode == ssl.CERT_REQUIRED and verified.check_hostname


@pytest.mark.process
def test_first_request_needs_no_import() -> None:
    # The zygote imports session_worker.agent before forking workers: what
    # the first request imports would be paid again by every worker.
    code = (
        "import sys, session_worker.agent\n"
        "for name in ('httpcore', 'h11', 'anyio._backends._asyncio', 'sniffio'):\n"
        "    assert name in sys.modules, name\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).resolve().parent.parent
    )


@pytest.mark.component
def test_an_unset_key_variable_says_where_to_set_it(fake_llm: FakeLLM, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    settings = make_settings(fake_llm, api_key_env=KEY_ENV)
    with pytest.raises(TurnFailure) as info:
        run(make_handler(settings, tmp_path).handle("hi", FakeCtx(settings, tmp_path)))
    assert (f"{KEY_ENV} (provider.api_key_env) is not set in sessiond's environment: set it where sessiond is "
            f"started (under systemd: `systemctl edit sessiond`, Environment={KEY_ENV}=...) and restart "
            "sessiond") in info.value.reason
    assert fake_llm.requests == []
