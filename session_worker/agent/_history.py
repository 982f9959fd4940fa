"""The agent's durable state and the operations that change it.

State: the conversation as OpenAI-format message dicts (system prompt not
included: it comes from settings at request time) plus the summary of what
compaction removed.  An assistant message may also keep the model's
reasoning (`REASONING_KEYS`), for the dialect to send back or leave out
(`reasoning_for_request`).  Every change is an *op*, a plain msgpack-able dict:

* `{"op": "append", "message": {...}}`
* `{"op": "compact", "drop": N, "summary": str | None}`: the first N
  messages go; the summary replaces the old one (None: keep the old one,
  used when summarizing failed and the oldest turns were just dropped).

A stored message is never changed in place, only appended or dropped
(`_compaction.RequestSizes` relies on it: it remembers each message's size
by identity).

A turn's record is `{"v": 1, "ops": [...]}` with the ops in the order they
happened (a compaction can fall between two appends of one turn), so
`restore` replays exactly what `handle()` did; `"tool_ok": {call id: bool}`
says how each tool call of the turn went (for `history`, which shows it as
the live `tool_result` did; `restore` has no use for it, and a record
written before it has none: the outcome is then unknown).  Ops are applied to the live
state as they are journaled; `Journal.rollback` undoes a turn that failed in
a way that commits no record.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["History", "Journal", "REASONING_KEYS", "RECORD_VERSION", "reasoning_for_request", "well_formed"]

RECORD_VERSION = 1


class History:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.summary: str | None = None

    def apply(self, op: dict[str, Any]) -> None:
        kind = op.get("op")
        if kind == "append":
            self.messages.append(op["message"])
        elif kind == "compact":
            drop = int(op["drop"])
            del self.messages[:drop]
            if op.get("summary") is not None:
                self.summary = str(op["summary"])
        else:
            raise ValueError(f"unknown history op {kind!r}")

    def snapshot(self) -> dict[str, Any]:
        return {
            "v": RECORD_VERSION,
            "summary": self.summary,
            "messages": copy.deepcopy(self.messages),
        }

    @classmethod
    def restored(cls, state: Any, records: list[Any]) -> History:
        history = cls()
        if state is not None:
            history.summary = state.get("summary")
            history.messages = copy.deepcopy(list(state.get("messages", [])))
        for record in records:
            # None: a turn that committed nothing (e.g. the worker died mid-turn).
            if record is None:
                continue
            for op in record.get("ops", []):
                history.apply(op)
        return history


class Journal:
    """The ops of one turn, applied to `history` as they are added."""

    def __init__(self, history: History) -> None:
        self._history = history
        self._saved_messages = list(history.messages)
        self._saved_summary = history.summary
        self.ops: list[dict[str, Any]] = []
        self.tool_ok: dict[str, bool] = {}

    def append(self, message: dict[str, Any]) -> None:
        self._add({"op": "append", "message": message})

    def tool_result(self, call_id: str, content: str, ok: bool) -> None:
        self.append({"role": "tool", "tool_call_id": call_id, "content": content})
        self.tool_ok[call_id] = ok

    def compact(self, drop: int, summary: str | None) -> None:
        self._add({"op": "compact", "drop": drop, "summary": summary})

    def _add(self, op: dict[str, Any]) -> None:
        self._history.apply(op)
        self.ops.append(op)

    def record(self, **extra: Any) -> dict[str, Any]:
        outcomes = {"tool_ok": dict(self.tool_ok)} if self.tool_ok else {}
        return {"v": RECORD_VERSION, "ops": copy.deepcopy(self.ops), **outcomes, **extra}

    def rollback(self) -> None:
        self._history.messages = self._saved_messages
        self._history.summary = self._saved_summary
        self.ops = []
        self.tool_ok = {}


def well_formed(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as every provider accepts them: consecutive user messages
    merged into one.  A history written before failed turns were closed
    with an assistant note (see `Turn._close_failed_turn`) can hold them,
    and strict chat templates reject a user message after a user message.
    Pure; the stored history is left as it is."""
    out: list[dict[str, Any]] = []
    for message in messages:
        previous = out[-1] if out else None
        if (
            previous is not None
            and message.get("role") == "user"
            and previous.get("role") == "user"
            and isinstance(message.get("content"), str)
            and isinstance(previous.get("content"), str)
        ):
            out[-1] = {**previous, "content": f"{previous['content']}\n\n{message['content']}"}
        else:
            out.append(message)
    return out


# Keys of an assistant message that hold reasoning: `reasoning_content`
# (DeepSeek, Kimi), `reasoning` (OpenRouter, vLLM), `thinking_blocks`
# (Anthropic's signed thinking and redacted_thinking blocks).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking_blocks")


def reasoning_for_request(
    messages: list[dict[str, Any]], mode: str, keep: tuple[str, ...] = REASONING_KEYS
) -> list[dict[str, Any]]:
    """`messages` with the reasoning a request carries (`provider.
    reasoning_history`): "all", "none", or "tool_turns": only on the
    assistant messages after the last user message, i.e. the tool calls of
    the running turn, which DeepSeek and Anthropic need back (DeepSeek
    answers 400 without it) and nothing earlier (DeepSeek asks to leave it
    out).  Reasoning keys not in `keep` (another dialect's) always go.
    Pure; the stored history is left as it is."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if message.get("role") == "assistant" and any(k in message for k in REASONING_KEYS):
            sent = mode == "all" or (mode == "tool_turns" and i > last_user)
            drop = REASONING_KEYS if not sent else tuple(k for k in REASONING_KEYS if k not in keep)
            if any(k in message for k in drop):
                message = {k: v for k, v in message.items() if k not in drop}
        out.append(message)
    return out
