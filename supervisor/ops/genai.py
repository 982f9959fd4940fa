"""What the daemon's spans say to a trace viewer: the attributes of a turn's
span and of a tool call its worker died in, named as OpenTelemetry's GenAI
semantic conventions say and as Phoenix and Langfuse read them.

Pure; runs in the daemon (supervisor.ops.otel).  A turn is an agent's
invocation: its span is `invoke_agent {handler}` with
`gen_ai.operation.name = invoke_agent`, and, for the viewers that read
OpenInference's names rather than (or before) GenAI's,
`openinference.span.kind = AGENT`; the session is `session.id` (Phoenix's
and Langfuse's sessions) and `gen_ai.conversation.id`; the user is
`user.id`, the uid that owns the session.  What a person typed and what the
agent answered (`input.value`, `output.value`, `gen_ai.input.messages`,
`gen_ai.output.messages`) go in only with content capture on
([tracing] capture_content): whoever reads the traces reads them.
"""

from __future__ import annotations

import json
from typing import Any

from ipc import messages as m
from supervisor.ops.labels import failure_kind, killed_by

__all__ = ["CONTENT_KEYS", "killed_tool", "turn_attributes", "turn_ended", "turn_name"]

# The attributes that carry what was said: their values may be up to 64 KiB
# (others 4 KiB), and they exist only with content capture on.
CONTENT_KEYS = frozenset({
    "gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.call.arguments", "gen_ai.tool.call.result",
    "input.value", "output.value",
})
_CONTENT_CHARS = 64 * 1024
_NAME_CHARS = 128
_USAGE = (("prompt_tokens", "gen_ai.usage.input_tokens"), ("completion_tokens", "gen_ai.usage.output_tokens"),
          ("reasoning_tokens", "gen_ai.usage.reasoning.output_tokens"))


def turn_name(handler: str) -> str:
    return f"invoke_agent {handler}"


def turn_attributes(session_id: str, turn: int, handler: str, owner_uid: int | None, text: str,
                    content: bool) -> dict[str, Any]:
    """A turn's span as it begins."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent", "openinference.span.kind": "AGENT",
        "gen_ai.agent.name": handler, "session.id": session_id, "gen_ai.conversation.id": session_id,
        "sessiond.session.id": session_id, "sessiond.turn": turn, "sessiond.handler": handler,
    }
    if owner_uid is not None:
        attributes["user.id"] = str(owner_uid)
    if content:
        attributes["input.value"] = _cut(text)
        attributes["input.mime_type"] = "text/plain"
        attributes["gen_ai.input.messages"] = _cut(json.dumps(
            [{"role": "user", "parts": [{"type": "text", "content": text}]}], ensure_ascii=False))
    return attributes


def turn_ended(attributes: dict[str, Any], done: m.Done | None, failed: str, content: bool) -> None:
    """What the turn's span says of how it ended: committed (`done`), or
    failed (`failed`, its reason: the span's status says it, and
    `error.type` its kind)."""
    if done is None:
        attributes["sessiond.turn.outcome"] = "failed"
        attributes["error.type"] = failure_kind(failed)
        return
    attributes["sessiond.turn.outcome"] = "interrupted" if done.interrupted else "done"
    if done.stop_reason:
        attributes["sessiond.turn.stop_reason"] = done.stop_reason
    for ours, theirs in _USAGE:
        if ours in done.usage:
            attributes[theirs] = done.usage[ours]
    if content:
        attributes["output.value"] = _cut(done.reply)
        attributes["output.mime_type"] = "text/plain"
        attributes["gen_ai.output.messages"] = _cut(json.dumps(
            [{"role": "assistant", "parts": [{"type": "text", "content": done.reply}],
              "finish_reason": done.stop_reason or "stop"}], ensure_ascii=False))


def killed_tool(key: str, failure: str) -> tuple[str, dict[str, Any]]:
    """The span of a tool call whose worker died while it ran (the daemon
    saw its step begin, never end): its name and attributes.  `key` is the
    agent's step key, `tool:NAME:CALL_ID` (a handler's own steps of kind
    "tool" may use other keys: the whole key is then the name)."""
    name, call_id = key, ""
    if key.startswith("tool:"):
        name, _, call_id = key[5:].partition(":")
    name, call_id = name[:_NAME_CHARS], call_id[:_NAME_CHARS]  # (the worker's words: cut)
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "execute_tool", "openinference.span.kind": "TOOL", "gen_ai.tool.name": name,
        "gen_ai.tool.type": "function", "error.type": failure_kind(failure),
    }
    if call_id:
        attributes["gen_ai.tool.call.id"] = call_id
    limit = killed_by(failure)
    if limit:
        attributes["sessiond.tool.killed_by"] = limit
    return f"execute_tool {name}", attributes


def _cut(text: str) -> str:
    return text if len(text) <= _CONTENT_CHARS else text[:_CONTENT_CHARS] + "…"
