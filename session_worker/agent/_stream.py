"""Assembling streamed chat-completion chunks into one completion.

Pure: JSON chunks in, text deltas and a `Completion` out.  The servers we
target agree on the shape but not on the details, and each detail is handled
here rather than spread over the provider:

* OpenAI / vLLM: a role-only first chunk, tool-call `id`/`name` only in the
  first delta of each call, arguments split anywhere, several calls
  interleaved by `index`, usage in a last chunk with `choices: []`.
* llama.cpp: `content: null` deltas, usage and `timings` in the final chunk.
* Ollama: `role` repeated in every chunk, a whole tool call in one chunk,
  older versions without `index` on tool calls, `finish_reason: "stop"` even
  when it called tools (so tool calls are run whatever the finish reason).
* DeepSeek (thinking mode) and Kimi: reasoning text in
  `delta.reasoning_content`; OpenRouter and vLLM: in `delta.reasoning`.  It
  is kept under the key it came in, to be sent back the way the server knows
  (see `_history.reasoning_for_request`).

Anthropic's Messages API has its own assembler (`_anthropic`); both meet the
`Assembler` protocol the provider reads a stream with.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

from session_worker.agent._errors import ProviderError
from ipc.contract import StopReason

__all__ = [
    "Assembler", "Completion", "Delta", "StreamAssembler", "ToolCall", "describe_error", "response_ids",
    "stop_reason_of", "usage_counts",
]

# Provider finish/stop reasons that mean the reply did not end by itself:
# OpenAI and the servers that copy it (`length`, `content_filter`), Anthropic
# (`max_tokens`, `refusal`, `model_context_window_exceeded`), Gemini's
# OpenAI endpoint (`SAFETY`, `RECITATION`, lowered here).
_STOPS = {
    "length": StopReason.TRUNCATED,
    "max_tokens": StopReason.TRUNCATED,
    "model_context_window_exceeded": StopReason.TRUNCATED,
    "content_filter": StopReason.FILTERED,
    "safety": StopReason.FILTERED,
    "recitation": StopReason.FILTERED,
    "refusal": StopReason.REFUSED,
}


def stop_reason_of(finish_reason: str | None) -> StopReason:
    """The provider-neutral reason for a finish reason (COMPLETE for `stop`,
    `tool_calls`, `end_turn`, unknown values and none at all)."""
    if not finish_reason:
        return StopReason.COMPLETE
    return _STOPS.get(finish_reason.lower(), StopReason.COMPLETE)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    # Raw JSON text exactly as the model produced it (may be invalid).
    arguments: str


@dataclass(slots=True)
class Completion:
    text: str
    tool_calls: list[ToolCall]
    finish_reason: str | None
    usage: dict[str, Any] | None
    # The model's reasoning text, as streamed to the client (not reply text).
    reasoning: str = ""
    # Keys the assistant message keeps in the history so that the dialect
    # can send the reasoning back (`reasoning_content`, `reasoning`, or
    # Anthropic's signed `thinking_blocks`); the loop only copies them.
    history_fields: dict[str, Any] = field(default_factory=dict)
    # What the provider says answered (the model may be a dated version of
    # the one asked for) and its id for this response; "" when not said.
    # For the call's span only: not journaled with the step.
    model: str = ""
    response_id: str = ""


def response_ids(source: dict[str, Any], model: str, response_id: str) -> tuple[str, str]:
    """The first `model` and `id` a stream says (text of a sane size), kept."""
    found = source.get("model")
    if not model and isinstance(found, str):
        model = found[:256]
    found = source.get("id")
    if not response_id and isinstance(found, str):
        response_id = found[:256]
    return model, response_id


# What one stream event adds: (reply text, reasoning text), "" for none.
Delta = tuple[str, str]


class Assembler(Protocol):
    """One completion being read from a stream, whatever the dialect."""

    def feed(self, chunk: Any, event: str = "") -> Delta:
        """Take one decoded event (`event`: the SSE event name, "" if none);
        raises ProviderError for an error the stream reports."""
        ...

    @property
    def ended(self) -> bool:
        """The stream said it is over (Anthropic `message_stop`); OpenAI's
        `[DONE]` is not JSON and is seen by the provider instead."""
        ...

    @property
    def complete(self) -> bool:
        """Enough was seen to accept a stream that ends without its end mark."""
        ...

    def finish(self) -> Completion: ...


@dataclass(slots=True)
class _PartialCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class StreamAssembler:
    def __init__(self) -> None:
        self._text: list[str] = []
        self._calls: dict[int, _PartialCall] = {}
        self._last_index: int | None = None
        # Server index -> our index, for a server reusing one index for
        # several calls.
        self._remap: dict[int, int] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self._reasoning: list[str] = []
        # `reasoning_content` or `reasoning`: whichever the server used.
        self._reasoning_key = "reasoning_content"
        self.model = self.response_id = ""

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def ended(self) -> bool:
        return False

    @property
    def complete(self) -> bool:
        return self.finish_reason is not None

    def feed(self, chunk: Any, event: str = "") -> Delta:
        """Take one decoded chunk; return the reply and reasoning text it adds."""
        if not isinstance(chunk, dict):
            raise ProviderError("provider sent a stream chunk that is not a JSON object")
        if chunk.get("error") is not None:
            raise ProviderError(f"provider reported an error mid-stream: {describe_error(chunk['error'])}")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        if not self.response_id:
            self.model, self.response_id = response_ids(chunk, self.model, self.response_id)
        added: list[str] = []
        thought: list[str] = []
        choices = chunk.get("choices") or []
        for choice in choices:
            # We never ask for n > 1; other choices would be alternatives.
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or choice.get("message") or {}
            if isinstance(delta, dict):
                content = delta.get("content")
                if isinstance(content, str) and content:
                    added.append(content)
                for key in ("reasoning_content", "reasoning"):
                    reasoning = delta.get(key)
                    if isinstance(reasoning, str) and reasoning:
                        thought.append(reasoning)
                        self._reasoning_key = key
                        break
                for raw in delta.get("tool_calls") or []:
                    if isinstance(raw, dict):
                        self._feed_tool_call(raw)
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                self.finish_reason = reason
        text = "".join(added)
        if text:
            self._text.append(text)
        reasoning_text = "".join(thought)
        if reasoning_text:
            self._reasoning.append(reasoning_text)
        return text, reasoning_text

    def _feed_tool_call(self, raw: dict[str, Any]) -> None:
        call_id = raw.get("id") if isinstance(raw.get("id"), str) else ""
        function = raw.get("function") or {}
        name = function.get("name") if isinstance(function, dict) else None
        index = raw.get("index")
        if not isinstance(index, int):
            index = self._index_without_position(call_id or "", name)
        else:
            last = self._calls.get(index)
            if last is not None and call_id and last.id and call_id != last.id:
                # Several calls under one index (every call `index: 0`, as
                # some OpenAI-compatible servers send them): a new id is a
                # new call, never arguments glued onto the last one.
                index = max(self._calls) + 1
                self._remap[raw["index"]] = index
            else:
                index = self._remap.get(index, index)
        part = self._calls.setdefault(index, _PartialCall())
        self._last_index = index
        if call_id and not part.id:
            part.id = call_id
        if not isinstance(function, dict):
            return
        # Names arrive whole in the first delta; a server repeating the
        # name in later deltas must not double it.
        if isinstance(name, str) and name and name != part.name:
            part.name = name if not part.name else part.name + name
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            part.arguments.append(arguments)
        elif isinstance(arguments, dict):
            part.arguments.append(json.dumps(arguments, ensure_ascii=False))

    def _index_without_position(self, call_id: str, name: Any) -> int:
        # Old Ollama and Mistral omit `index`: a new id starts a new call;
        # without an id, a name after a call that already has its name and
        # arguments starts one too (parallel calls, each whole); anything
        # else continues the last call (arguments in pieces).
        if call_id:
            for index, part in self._calls.items():
                if part.id == call_id:
                    return index
            return max(self._calls, default=-1) + 1
        if self._last_index is not None:
            last = self._calls[self._last_index]
            if isinstance(name, str) and name and last.name and "".join(last.arguments).strip():
                return max(self._calls) + 1
            return self._last_index
        return 0

    def finish(self) -> Completion:
        calls: list[ToolCall] = []
        seen: set[str] = set()
        for index in sorted(self._calls):
            part = self._calls[index]
            arguments = "".join(part.arguments)
            if not part.name and not part.id and not arguments.strip():
                continue  # an empty fragment, nothing the model asked for
            # A call without an id (or with one used twice) gets one of
            # ours: the tool message answering it must name it, and ids
            # must be unique across the history.  A call without a name is
            # kept: the loop answers it with an error the model can act on.
            call_id = part.id if part.id and part.id not in seen else f"call_{secrets.token_hex(8)}"
            seen.add(call_id)
            calls.append(ToolCall(id=call_id, name=part.name, arguments=arguments))
        reasoning = "".join(self._reasoning)
        fields = {self._reasoning_key: reasoning} if reasoning else {}
        return Completion(self.text, calls, self.finish_reason, self.usage, reasoning, fields, self.model,
                          self.response_id)


def usage_counts(usage: dict[str, Any] | None) -> dict[str, int]:
    """Token counts of one completion in our three names, from OpenAI's
    `prompt_tokens`/`completion_tokens`/`completion_tokens_details.
    reasoning_tokens` or Anthropic's `input_tokens`/`output_tokens`
    (cache reads and writes are input too).  Keys the server did not
    report are left out rather than guessed."""
    if not usage:
        return {}
    out: dict[str, int] = {}

    def count(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    prompt = count(usage.get("prompt_tokens"))
    if prompt is None and count(usage.get("input_tokens")) is not None:
        prompt = sum(
            count(usage.get(key)) or 0
            for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        )
    completion = count(usage.get("completion_tokens"))
    if completion is None:
        completion = count(usage.get("output_tokens"))
    details = usage.get("completion_tokens_details")
    reasoning = count(details.get("reasoning_tokens")) if isinstance(details, dict) else None
    if reasoning is None:
        reasoning = count(usage.get("reasoning_tokens"))
    for key, value in (("prompt_tokens", prompt), ("completion_tokens", completion),
                       ("reasoning_tokens", reasoning)):
        if value is not None:
            out[key] = value
    return out


def describe_error(error: Any) -> str:
    """A provider's error object in full, as one line: the message, then
    what else the provider said that helps (OpenAI's `code`, `type` and
    `param`, OpenRouter's `metadata.raw` from the upstream provider and its
    `provider_name`).  Capped, since an upstream body can be a whole page."""
    if not isinstance(error, dict):
        return str(error)[:_ERROR_CHARS]
    message = error.get("message")
    parts = [message if isinstance(message, str) and message else json.dumps(error)[:_ERROR_CHARS]]
    extra = [
        f"{key}={error[key]}"
        for key in ("code", "type", "param")
        if isinstance(error.get(key), (str, int)) and error.get(key) not in ("", None)
    ]
    if extra:
        parts.append(f"({', '.join(extra)})")
    metadata = error.get("metadata")
    if isinstance(metadata, dict):
        upstream = metadata.get("provider_name")
        raw = metadata.get("raw")
        if raw is not None:
            raw_text = raw if isinstance(raw, str) else json.dumps(raw)
            who = f"upstream {upstream}" if isinstance(upstream, str) else "upstream"
            parts.append(f"[{who} said: {raw_text}]")
        elif isinstance(upstream, str):
            parts.append(f"[upstream {upstream}]")
    return " ".join(parts)[:_ERROR_CHARS]


_ERROR_CHARS = 2000
