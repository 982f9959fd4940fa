"""Anthropic's Messages API: the request body and the stream.  Pure.

The history stays in one internal form (OpenAI-style message dicts, see
`_history`); this module renders it as a Messages API request and reads the
answer back into the same `Completion` the OpenAI dialect produces, so the
loop never knows which API it talks to.

Rendering (`request_body`):

* the system message becomes the top-level `system` field;
* an assistant message becomes content blocks: its signed thinking blocks
  (when sent back, see `_history.reasoning_for_request`) exactly as
  received, then its text, then one `tool_use` block per tool call;
* tool messages become `tool_result` blocks of one user message, and a
  user text that follows them joins that message: Anthropic wants user and
  assistant to alternate;
* tool schemas `{type: function, function: {name, description,
  parameters}}` become `{name, description, input_schema}`.

Streaming (`AnthropicAssembler`): `message_start` (usage: input tokens),
`content_block_start` / `content_block_delta` (`text_delta`,
`input_json_delta`, `thinking_delta`, `signature_delta`) /
`content_block_stop`, `message_delta` (`stop_reason`, output usage),
`message_stop`, `ping`, and `error` (mid-stream, e.g. `overloaded_error`).
Thinking blocks are kept whole with their signature (and
`redacted_thinking` blocks with their data), because Anthropic checks the
signature when they come back within a tool-use turn.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from session_worker.agent._errors import ProviderError
from session_worker.agent._stream import Completion, Delta, ToolCall, describe_error, response_ids

__all__ = ["ANTHROPIC_VERSION", "AnthropicAssembler", "DEFAULT_MAX_TOKENS", "request_body"]

# The API version we speak (sent as `anthropic-version`); the stream events
# read here are those of this version.
ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
# Anthropic refuses an assistant message with no content at all (e.g. a
# reply that was only a cut-off thinking block).
_EMPTY_TEXT = "(no text)"


def request_body(
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    max_tokens: int,
    thinking_budget_tokens: int = 0,
) -> dict[str, Any]:
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "system":
            content = message.get("content")
            if isinstance(content, str) and content:
                system.append(content)
        elif role == "assistant":
            out.append({"role": "assistant", "content": _assistant_blocks(message)})
        elif role == "tool":
            _add_user_blocks(out, [_tool_result(message)])
        else:
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            _add_user_blocks(out, [{"type": "text", "text": text}])
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    if system:
        body["system"] = "\n\n".join(system)
    body["messages"] = [_plain(m) for m in out]
    if tools:
        body["tools"] = [_tool_schema(t) for t in tools]
    if thinking_budget_tokens > 0:
        body["thinking"] = {"type": "enabled", "budget_tokens": thinking_budget_tokens}
    body["stream"] = True
    return body


def _assistant_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [dict(b) for b in message.get("thinking_blocks") or []]
    text = message.get("content")
    if isinstance(text, str) and text:
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = {}
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": arguments if isinstance(arguments, dict) else {},
            }
        )
    if not any(b.get("type") in ("text", "tool_use") for b in blocks):
        blocks.append({"type": "text", "text": _EMPTY_TEXT})
    return blocks


def _tool_result(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    return {
        "type": "tool_result",
        "tool_use_id": message.get("tool_call_id"),
        "content": content if isinstance(content, str) else json.dumps(content),
    }


def _add_user_blocks(out: list[dict[str, Any]], blocks: list[dict[str, Any]]) -> None:
    if out and out[-1]["role"] == "user":
        out[-1]["content"].extend(blocks)
    else:
        out.append({"role": "user", "content": list(blocks)})


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A user message of one text block as a plain string, the form of
    Anthropic's own examples (and the smaller body)."""
    content = message["content"]
    if message["role"] == "user" and len(content) == 1 and content[0]["type"] == "text":
        return {"role": "user", "content": content[0]["text"]}
    return message


def _tool_schema(schema: dict[str, Any]) -> dict[str, Any]:
    function = schema.get("function", schema)
    out: dict[str, Any] = {"name": function.get("name")}
    if function.get("description"):
        out["description"] = function["description"]
    out["input_schema"] = function.get("parameters") or {"type": "object", "properties": {}}
    return out


@dataclass(slots=True)
class _Block:
    type: str
    # text / thinking text / tool input JSON, in pieces.
    parts: list[str] = field(default_factory=list)
    id: str = ""
    name: str = ""
    signature: str = ""
    # The whole start block of a type we keep but do not read
    # (redacted_thinking: sent back as received).
    raw: dict[str, Any] | None = None


class AnthropicAssembler:
    def __init__(self) -> None:
        self._blocks: dict[int, _Block] = {}
        self.stop_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self._ended = False
        self.model = self.response_id = ""

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def complete(self) -> bool:
        return self.stop_reason is not None

    def feed(self, chunk: Any, event: str = "") -> Delta:
        if not isinstance(chunk, dict):
            raise ProviderError("provider sent a stream event that is not a JSON object")
        kind = chunk.get("type") or event
        if kind == "error" or chunk.get("error") is not None:
            raise ProviderError(
                f"provider reported an error mid-stream: {describe_error(chunk.get('error', chunk))}"
            )
        if kind == "message_start":
            message = chunk.get("message") or {}
            if isinstance(message, dict):
                self.model, self.response_id = response_ids(message, self.model, self.response_id)
            self._usage(message.get("usage"))
        elif kind == "message":
            # A whole answer (a server that ignored `stream: true`).
            return self._whole(chunk)
        elif kind == "content_block_start":
            return self._start(chunk)
        elif kind == "content_block_delta":
            return self._delta(chunk)
        elif kind == "message_delta":
            delta = chunk.get("delta") or {}
            reason = delta.get("stop_reason")
            if isinstance(reason, str) and reason:
                self.stop_reason = reason
            self._usage(chunk.get("usage"))
        elif kind == "message_stop":
            self._ended = True
        # ping, content_block_stop and event types added later: nothing to take.
        return "", ""

    def _whole(self, message: dict[str, Any]) -> Delta:
        self.model, self.response_id = response_ids(message, self.model, self.response_id)
        self._usage(message.get("usage"))
        text: list[str] = []
        reasoning: list[str] = []
        for index, block in enumerate(message.get("content") or []):
            added, thought = self._start({"index": index, "content_block": block})
            text.append(added)
            reasoning.append(thought)
        reason = message.get("stop_reason")
        if isinstance(reason, str) and reason:
            self.stop_reason = reason
        self._ended = True
        return "".join(text), "".join(reasoning)

    def _usage(self, usage: Any) -> None:
        # message_start has the input tokens; message_delta's counts are
        # cumulative, so a later value replaces an earlier one.
        if isinstance(usage, dict):
            self.usage.update({k: v for k, v in usage.items() if v is not None})

    def _start(self, chunk: dict[str, Any]) -> Delta:
        index = chunk.get("index")
        block = chunk.get("content_block") or {}
        if not isinstance(index, int) or not isinstance(block, dict):
            return "", ""
        kind = str(block.get("type", ""))
        part = _Block(kind)
        self._blocks[index] = part
        if kind == "tool_use":
            part.id = str(block.get("id") or "")
            part.name = str(block.get("name") or "")
            start_input = block.get("input")
            if isinstance(start_input, dict) and start_input:
                part.parts.append(json.dumps(start_input, ensure_ascii=False))
        elif kind == "redacted_thinking":
            part.raw = dict(block)
        elif kind == "text" and block.get("text"):
            part.parts.append(str(block["text"]))
            return str(block["text"]), ""
        elif kind == "thinking":
            part.signature = str(block.get("signature") or "")
            if block.get("thinking"):
                part.parts.append(str(block["thinking"]))
                return "", str(block["thinking"])
        return "", ""

    def _delta(self, chunk: dict[str, Any]) -> Delta:
        index = chunk.get("index")
        delta = chunk.get("delta") or {}
        part = self._blocks.get(index) if isinstance(index, int) else None
        if part is None or not isinstance(delta, dict):
            return "", ""
        kind = delta.get("type")
        if kind == "text_delta" and isinstance(delta.get("text"), str):
            part.parts.append(delta["text"])
            return delta["text"], ""
        if kind == "input_json_delta" and isinstance(delta.get("partial_json"), str):
            part.parts.append(delta["partial_json"])
        elif kind == "thinking_delta" and isinstance(delta.get("thinking"), str):
            part.parts.append(delta["thinking"])
            return "", delta["thinking"]
        elif kind == "signature_delta" and isinstance(delta.get("signature"), str):
            part.signature += delta["signature"]
        return "", ""

    def finish(self) -> Completion:
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        thinking: list[dict[str, Any]] = []
        for index in sorted(self._blocks):
            part = self._blocks[index]
            joined = "".join(part.parts)
            if part.type == "text":
                text.append(joined)
            elif part.type == "tool_use":
                call_id = part.id or f"toolu_{secrets.token_hex(8)}"
                calls.append(ToolCall(id=call_id, name=part.name, arguments=joined))
            elif part.type == "thinking":
                reasoning.append(joined)
                thinking.append({"type": "thinking", "thinking": joined, "signature": part.signature})
            elif part.raw is not None:
                thinking.append(part.raw)
        fields: dict[str, Any] = {"thinking_blocks": thinking} if thinking else {}
        return Completion(
            "".join(text),
            calls,
            self.stop_reason,
            self.usage or None,
            "".join(reasoning),
            fields,
            self.model,
            self.response_id,
        )
