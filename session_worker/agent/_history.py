"""The agent's durable state and the operations that change it.

State: the conversation as OpenAI-format message dicts (system prompt not
included: it comes from settings at request time) plus the summary of what
compaction removed.  Every change is an *op*, a plain msgpack-able dict:

* `{"op": "append", "message": {...}}`
* `{"op": "compact", "drop": N, "summary": str | None}`: the first N
  messages go; the summary replaces the old one (None: keep the old one,
  used when summarizing failed and the oldest turns were just dropped).

A turn's record is `{"v": 1, "ops": [...]}` with the ops in the order they
happened (a compaction can fall between two appends of one turn), so
`restore` replays exactly what `handle()` did.  Ops are applied to the live
state as they are journaled; `Journal.rollback` undoes a turn that failed in
a way that commits no record.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["History", "Journal", "RECORD_VERSION", "well_formed"]

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

    def append(self, message: dict[str, Any]) -> None:
        self._add({"op": "append", "message": message})

    def compact(self, drop: int, summary: str | None) -> None:
        self._add({"op": "compact", "drop": drop, "summary": summary})

    def _add(self, op: dict[str, Any]) -> None:
        self._history.apply(op)
        self.ops.append(op)

    def record(self, **extra: Any) -> dict[str, Any]:
        return {"v": RECORD_VERSION, "ops": copy.deepcopy(self.ops), **extra}

    def rollback(self) -> None:
        self._history.messages = self._saved_messages
        self._history.summary = self._saved_summary
        self.ops = []


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
