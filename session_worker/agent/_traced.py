"""The agent's spans, named and filled as OpenTelemetry's GenAI semantic
conventions say: a `chat {model}` span per LLM call, an `execute_tool
{name}` span per tool call (each also with OpenInference's span kind, LLM
or TOOL, which Phoenix reads).

Runs in the worker's event loop, through `session_worker.tracing` (which
says how spans get to the daemon).  One hook per LLM call (`Provider.
stream_chat`) and one per tool call (`Turn._run_calls`); the bash tool adds
its exit to the open tool span.  Prompts and completions go into a span
only when the operator asked ([tracing] capture_content), as JSON, cut at
`_CONTENT_CHARS`; so do a tool call's arguments and result
(`gen_ai.tool.call.arguments`, `gen_ai.tool.call.result`, and as
OpenInference's `input.value`, `output.value`).
"""

from __future__ import annotations

import functools
import json
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from session_worker import tracing
from session_worker.agent._stream import Completion, ToolCall, usage_counts
from ipc.settings import ProviderSettings

__all__ = ["bash_exit", "llm_done", "llm_span", "on_first", "on_retry", "tool_call"]

T = TypeVar("T")

_CONTENT_CHARS = 64 * 1024
# Signals whose cause is a limit of the tool's own (its rlimits).
_LIMIT_SIGNALS: dict[int, str] = {
    int(signal.SIGXCPU): "cpu_time", int(signal.SIGXFSZ): "file_size", int(signal.SIGKILL): "killed",
}


def llm_span(settings: ProviderSettings, messages: list[dict[str, Any]]) -> tracing.Span | Any:
    if not tracing.active():
        return tracing.span("")  # the shared no-op
    model = settings.model or ""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "openinference.span.kind": "LLM",
        "gen_ai.provider.name": settings.kind,
        "gen_ai.system": settings.kind,  # the older name, still read by many viewers
        "gen_ai.request.model": model,
    }
    if settings.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = settings.max_tokens
    attributes.update(_server(settings.base_url or ""))
    if tracing.capturing():
        attributes["gen_ai.input.messages"] = _content(_parts(messages))
    return tracing.span(f"chat {model}", tracing.CLIENT, attributes)


@functools.lru_cache(maxsize=8)
def _server(base_url: str) -> dict[str, Any]:
    """server.address and server.port of a base URL (parsed once)."""
    try:
        where = urlsplit(base_url)
        port = where.port or (443 if where.scheme == "https" else 80)
    except ValueError:
        return {}
    return {"server.address": where.hostname, "server.port": port} if where.hostname else {}


def on_first(span: tracing.Span, then: Callable[[], None] | None) -> Callable[[], None]:
    """`on_first` that also records when the first token came."""
    started = time.monotonic()

    def first() -> None:
        span.set("gen_ai.response.time_to_first_chunk", round(time.monotonic() - started, 6))
        span.event("gen_ai.first_token")
        if then is not None:
            then()

    return first


def on_retry(span: tracing.Span, then: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
    def retry(info: dict[str, Any]) -> None:
        span.event("sessiond.llm.retry", {k: v for k, v in info.items() if isinstance(v, (str, int, float))})
        if then is not None:
            then(info)

    return retry


def llm_done(span: tracing.Span, completion: Completion) -> None:
    counts = usage_counts(completion.usage)
    for ours, theirs in (("prompt_tokens", "gen_ai.usage.input_tokens"),
                         ("completion_tokens", "gen_ai.usage.output_tokens"),
                         ("reasoning_tokens", "gen_ai.usage.reasoning.output_tokens")):
        if ours in counts:
            span.set(theirs, counts[ours])
    if completion.finish_reason:
        span.set("gen_ai.response.finish_reasons", [completion.finish_reason])
    if completion.model:
        span.set("gen_ai.response.model", completion.model)
    if completion.response_id:
        span.set("gen_ai.response.id", completion.response_id)
    if completion.tool_calls:
        span.set("sessiond.llm.tool_calls", len(completion.tool_calls))
    if tracing.capturing():
        parts: list[dict[str, Any]] = [{"type": "text", "content": completion.text}] if completion.text else []
        parts += [{"type": "tool_call", "id": c.id, "name": c.name, "arguments": c.arguments}
                  for c in completion.tool_calls]
        span.set("gen_ai.output.messages", _content(
            [{"role": "assistant", "parts": parts, "finish_reason": completion.finish_reason or ""}]))


async def tool_call(call_id: str, name: str, run: Awaitable[tuple[bool, T]],
                    arguments: str | None = None) -> tuple[bool, T]:
    """Run one tool call (`run`: the whole of it: checks, permission, the
    tool) under its span (the agent's tools and the framework adapters');
    `arguments`: as the model wrote them (JSON, maybe broken), shown with
    content capture."""
    attributes = {"gen_ai.operation.name": "execute_tool", "openinference.span.kind": "TOOL",
                  "gen_ai.tool.name": name or "", "gen_ai.tool.call.id": call_id,
                  "gen_ai.tool.type": "function"}
    content = tracing.capturing()
    if content and arguments is not None:
        attributes["gen_ai.tool.call.arguments"] = attributes["input.value"] = _cut(arguments)
        attributes["input.mime_type"] = "application/json"
    with tracing.span(f"execute_tool {name}", attributes=attributes) as span:
        ok, output = await run
        if content:
            span.set("gen_ai.tool.call.result", _cut(str(output)))
            span.set("output.value", _cut(str(output)))
        if not ok:
            # (the loop's words: "error: permission denied: ...")
            text = str(output)
            span.fail(text[:300], "permission_denied" if text.startswith("error: permission denied")
                      else "tool_error")
        return ok, output


def bash_exit(returncode: int | None, timed_out: bool, lost: str, output_bytes: int, cut: bool) -> None:
    """The bash tool's end, on the open tool span: its exit code or signal,
    and which limit killed it, if one did."""
    attributes: dict[str, Any] = {"sessiond.tool.output_bytes": output_bytes}
    if cut:
        attributes["sessiond.tool.output_truncated"] = True
    if timed_out:
        attributes["sessiond.tool.killed_by"] = "timeout"
    elif lost:
        attributes["sessiond.tool.killed_by"] = "tool_host_lost"
    if returncode is not None and returncode < 0:
        attributes["sessiond.tool.signal"] = -returncode
        if "sessiond.tool.killed_by" not in attributes:
            attributes["sessiond.tool.killed_by"] = _LIMIT_SIGNALS.get(-returncode, "signal")
    elif returncode is not None:
        attributes["process.exit.code"] = returncode
    tracing.annotate(attributes)


def _parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style messages as GenAI `{role, parts}` messages."""
    out = []
    for message in messages:
        parts: list[dict[str, Any]] = []
        content = message.get("content")
        if message.get("role") == "tool":
            parts.append({"type": "tool_call_response", "id": message.get("tool_call_id", ""),
                          "response": content if isinstance(content, str) else json.dumps(content)})
        elif isinstance(content, str) and content:
            parts.append({"type": "text", "content": content})
        for call in message.get("tool_calls") or ():
            function = call.get("function", {})
            parts.append({"type": "tool_call", "id": call.get("id", ""), "name": function.get("name", ""),
                          "arguments": function.get("arguments", "")})
        out.append({"role": message.get("role", ""), "parts": parts})
    return out


def _content(value: Any) -> str:
    return _cut(json.dumps(value, ensure_ascii=False, default=str))


def _cut(text: str) -> str:
    return text if len(text) <= _CONTENT_CHARS else text[:_CONTENT_CHARS] + "…"
