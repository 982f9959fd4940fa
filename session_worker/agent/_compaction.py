"""Context compaction: deciding what to summarize.  Pure; the handler does
the provider call and journals the result.

Size is estimated as characters / 4 of the JSON the request would carry
(system prompt, summary, messages, tool schemas); `RequestSizes` remembers
each message's share, so the estimate costs no re-encoding of the history.  That is the usual rule of
thumb for English text with BPE tokenizers: crude, but monotonic, free, and
the same on restore, which matters more here than precision.

The cut is always just before a user message: everything before the
`keep_recent_turns`-th last user message is "older".  Cutting there can
never separate an assistant tool call from its tool results, because those
always follow their call before the next user message.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "RequestSizes",
    "cut_index",
    "estimate_tokens",
    "summary_request",
    "system_content",
]

CHARS_PER_TOKEN = 4
# Per message in the transcript sent for summarizing: the summary request
# itself must fit in the model's context, and the tail of a long tool output
# rarely matters for a summary.
_TRANSCRIPT_MESSAGE_CHARS = 4000

_SUMMARY_SYSTEM = (
    "You compress conversations between a user and an AI agent that uses tools "
    "in a workspace. Write a concise summary that lets the agent continue the "
    "work: the user's goals and instructions, decisions made, files and "
    "commands involved with their outcomes, and open questions. Plain text, no "
    "preamble."
)


def system_content(system_prompt: str, summary: str | None) -> str:
    # One system message, not two: several chat templates (llama.cpp, some
    # vLLM models) reject a second system message.
    if not summary:
        return system_prompt
    return f"{system_prompt}\n\n## Summary of the earlier conversation\n{summary}"


def estimate_tokens(
    system_prompt: str,
    summary: str | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    sizes: RequestSizes | None = None,
) -> int:
    """Characters / 4 of the JSON of the request (`json.dumps`, default
    separators).  With `sizes`, the JSON lengths it remembers are reused."""
    sizes = sizes if sizes is not None else RequestSizes()
    chars = len(system_content(system_prompt, summary))
    chars += sizes.messages_chars(messages)
    chars += sizes.tools_chars(tools) if tools else 0
    return chars // CHARS_PER_TOKEN


class RequestSizes:
    """JSON lengths for `estimate_tokens`, remembered across LLM calls.

    The estimate runs before every LLM call, over the whole history: a
    `json.dumps` of it each time grew with the session (~1 ms per 100 KiB,
    on the way to every first token).  Each message's length is kept by
    identity instead, which is sound because stored messages are never
    changed in place (`_history`: a turn only appends, compaction only
    drops); a call then costs a dict look-up per message.  The result is
    exactly `len(json.dumps(messages))`: the list's brackets and its ", "
    separators are added, not measured.  Only the messages of the last call
    are kept (holding them keeps their ids from being reused)."""

    def __init__(self) -> None:
        self._messages: dict[int, tuple[dict[str, Any], int]] = {}
        self._tools: tuple[list[dict[str, Any]], int] | None = None

    def messages_chars(self, messages: list[dict[str, Any]]) -> int:
        if not messages:
            return 2  # "[]"
        known = self._messages
        kept: dict[int, tuple[dict[str, Any], int]] = {}
        total = 0
        for message in messages:
            entry = known.get(id(message))
            if entry is None or entry[0] is not message:
                entry = (message, len(json.dumps(message, ensure_ascii=False)))
            kept[id(message)] = entry
            total += entry[1]
        self._messages = kept
        return total + 2 * len(messages)  # "[", "]" and n - 1 ", "

    def tools_chars(self, tools: list[dict[str, Any]]) -> int:
        # The registry hands out one list per settings change.
        if self._tools is None or self._tools[0] is not tools:
            self._tools = (tools, len(json.dumps(tools, ensure_ascii=False)))
        return self._tools[1]


def cut_index(messages: list[dict[str, Any]], keep_recent_turns: int) -> int:
    """How many leading messages are older than the kept turns (0: none)."""
    starts = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if len(starts) <= keep_recent_turns:
        return 0
    return starts[-keep_recent_turns]


def _render(message: dict[str, Any]) -> str:
    role = str(message.get("role", "?"))
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    if role == "assistant":
        for call in message.get("tool_calls") or []:
            function = call.get("function", {})
            text += f"\n[called {function.get('name')} with {function.get('arguments')}]"
    if len(text) > _TRANSCRIPT_MESSAGE_CHARS:
        cut = len(text) - _TRANSCRIPT_MESSAGE_CHARS
        text = text[: _TRANSCRIPT_MESSAGE_CHARS] + f" [... {cut} characters cut]"
    return f"{role.upper()}: {text.strip()}"


def summary_request(summary: str | None, older: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages of a tool-less request asking the model for a new summary
    of `summary` (what earlier compactions kept) plus `older`."""
    parts = []
    if summary:
        parts.append(f"Summary so far:\n{summary}\n")
    parts.append("Conversation to add to the summary:")
    parts.extend(_render(m) for m in older)
    parts.append("\nWrite the updated summary now.")
    return [
        {"role": "system", "content": _SUMMARY_SYSTEM},
        {"role": "user", "content": "\n".join(parts)},
    ]
