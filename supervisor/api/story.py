"""A stored turn told as its clients saw it live: `HistoryTurn.events`.

Runs in the daemon, in `history`'s thread (pure: it reads only its
arguments).  The console and `sessionctl history` render a stored turn with
the code that renders live events, so a reload or a daemon restart tells
the same story as the live stream did: each piece of reply text, each tool
call and its result with its outcome, each permission request with its
answer (who, when), and the crash, restart and resume markers where they
happened in the turn, not after it.

What the log keeps of an ended turn, in order: its `InputRecord`, the
`Step`s it journaled (their keys say which LLM call or tool each was), the
kept lifecycle events (`LifeEvent`: a crash, a restart, a limit hit), a
`Resume` each time it went on on a new worker, the permission requests and
their answers (`Asked`, `Answered`), and its `Commit` or `Abort`, whose
handler record holds the agent's messages (the text of each LLM response,
the calls, the results) and how each call went (`tool_ok`).  The messages
give the events' order; the steps place the markers among them: a marker
logged between steps K and K+1 goes before what step K+1 produced (an LLM
response's text, a tool's call), one after the last step before the text
that closes the turn, and one whose worker died in a tool between that
tool's call and its result, as it came live.  A permission request
goes after the call it asked about (the first with its tool and
arguments), its answer right after it.

A record from before `tool_ok` says nothing of outcomes: its results carry
no `ok` (clients show the outcome as unknown, never as a success).  Other
handlers' records are not read: their turn is its reply, with its markers.
Events carry the session and the turn; `seq` is the stored one where the
record kept it (lifecycle events), else 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import msgspec

from ipc import messages as m
from ipc.contract import PERMISSION_ANSWERED
from supervisor.store.state_store import Abort, Answered, Asked, Commit, LifeEvent, Record, Resume, Step

__all__ = ["OUTPUT_CHARS", "decoded", "tell"]

# As much of a tool's output as its live `tool_result` notice carries.
OUTPUT_CHARS = 2000

_lifecycle = msgspec.msgpack.Decoder(m.StateChanged | m.LimitExceeded | m.TurnFailed)
_msgpack = msgspec.msgpack.Decoder()


def tell(session: str, turn: int, between: Iterable[Record], end: Commit | Abort) -> list[m.Event]:
    """The turn's events: `between` are its records after its input, in log order."""
    story = _Story(session, turn)
    story.read_record(end.record, end.reply if isinstance(end, Commit) else "")
    died_in = ""  # the call a worker died in, since the last step: what is logged goes before its result
    group: list[m.Event] = []
    asks: dict[str, Asked] = {}
    answers: dict[str, Answered] = {}
    for rec in between:
        match rec:
            case Step(key=key):
                story.place(("call", died_in) if died_in else ("before", key), group)
                group, died_in = [], ""
            case LifeEvent():
                try:
                    event = _lifecycle.decode(rec.event)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                if not isinstance(event, m.TurnFailed):  # (the turn's end says it)
                    group.append(event)
            case Resume():
                group.append(m.Notice(session=session, seq=0, turn=turn, kind="turn_resumed", data={
                    "reason": rec.reason, "cause": rec.cause, "step": rec.step, "running": rec.running}))
                if rec.running.startswith("tool:"):
                    died_in = rec.running.split(":", 2)[2]
            case Asked():
                asks[rec.request_id] = rec
            case Answered():
                answers[rec.request_id] = rec
    story.place(("call", died_in) if died_in else ("end", ""), group)
    for rid, ask in asks.items():
        story.ask(ask, answers.get(rid))
    return story.events()


class _Story:
    def __init__(self, session: str, turn: int) -> None:
        self.session, self.turn = session, turn
        self.items: list[m.Event] = []
        # Where a marker goes: where an LLM response's items start (its
        # text), where a call is, after a call (an index into items, taken
        # before any insert).
        self.llm_at: list[int] = []
        self.compact_at: list[int] = []
        self.call_at: dict[str, int] = {}
        self.result_at: dict[str, int] = {}
        self.calls: list[tuple[str, str, Any]] = []  # (id, name, arguments) in order, for the asks
        self.inserts: list[tuple[int, int, list[m.Event]]] = []  # (at, order, events)
        self._llm_steps = 0
        self._compact_steps = 0
        self._asked: set[str] = set()

    def _notice(self, kind: str, data: dict[str, Any]) -> m.Notice:
        return m.Notice(session=self.session, seq=0, turn=self.turn, kind=kind, data=data)

    def _text(self, text: str) -> None:
        said = "".join(e.text for e in self.items if isinstance(e, m.TextDelta))
        if said and not said.endswith("\n"):
            text = "\n\n" + text  # as the agent parts the text of two responses
        self.items.append(m.TextDelta(session=self.session, seq=0, turn=self.turn, text=text))

    def read_record(self, record: bytes, reply: str) -> None:
        """The items, from the agent's record; else the reply alone."""
        data = decoded(record)
        ops = data.get("ops") if isinstance(data, dict) else None
        if not isinstance(ops, list):
            if reply:
                self._text(reply)
            return
        raw_ok = data.get("tool_ok")
        tool_ok = raw_ok if isinstance(raw_ok, dict) else {}
        calls: dict[str, tuple[str, Any]] = {}
        for op in ops:
            if not isinstance(op, dict):
                continue
            if op.get("op") == "compact":
                self.compact_at.append(len(self.items))
                self.items.append(self._notice("compaction", {
                    "dropped_messages": op.get("drop"), "method": "summarized" if op.get("summary") else "dropped"}))
                continue
            msg = op.get("message")
            if op.get("op") != "append" or not isinstance(msg, dict):
                continue
            if msg.get("role") == "assistant":
                self.llm_at.append(len(self.items))
                if isinstance(msg.get("content"), str) and msg["content"]:
                    self._text(msg["content"])
                for call in msg.get("tool_calls") or []:
                    fn = call.get("function") if isinstance(call, dict) else None
                    if isinstance(fn, dict):
                        args = fn.get("arguments", "")
                        parsed = _arguments(args)
                        calls[str(call.get("id", ""))] = (str(fn.get("name", "?")), parsed if parsed is not None else args)
            elif msg.get("role") == "tool":
                cid = str(msg.get("tool_call_id", ""))
                name, args = calls.pop(cid, ("?", ""))
                self.items.append(self._notice("tool_call", {"id": cid, "name": name, "arguments": args}))
                self.call_at[cid] = len(self.items)
                self.calls.append((cid, name, args))
                output = str(msg.get("content", ""))
                result: dict[str, Any] = {"id": cid, "name": name, "output": output[:OUTPUT_CHARS],
                                          "truncated": len(output) > OUTPUT_CHARS}
                if isinstance(tool_ok.get(cid), bool):
                    result["ok"] = tool_ok[cid]
                self.items.append(self._notice("tool_result", result))
                self.result_at[cid] = len(self.items)

    def place(self, anchor: tuple[str, str], events: list[m.Event]) -> None:
        """`events`, logged between two steps, where that is among the
        items: before what the next step produced (("before", its key)),
        or, after the last step, before the text that closes the turn
        (("end", "")); between a call and its result when its worker died
        in that tool (("call", its id)).  Called once for every step, in
        order: the LLM steps are told apart by their order."""
        how, key = anchor
        if how == "call":
            at = self.call_at.get(key, len(self.items))
        elif how == "end":
            at = self._before_closing_text()
        elif key.startswith("tool:"):
            after_call = self.call_at.get(key.split(":", 2)[2])
            at = after_call - 1 if after_call is not None else len(self.items)
        elif key.startswith("llm:"):
            self._llm_steps += 1
            at = self._nth(self.llm_at, self._llm_steps)
        elif key.startswith("compact:"):
            self._compact_steps += 1
            at = self._nth(self.compact_at, self._compact_steps)
        else:
            at = self._before_closing_text()  # another handler's step: its turn is its reply
        if events:
            self.inserts.append((at, len(self.inserts), events))

    def _before_closing_text(self) -> int:
        at = len(self.items)
        while at and isinstance(self.items[at - 1], m.TextDelta):
            at -= 1
        return at

    def _nth(self, positions: list[int], n: int) -> int:
        return positions[n - 1] if n <= len(positions) else len(self.items)

    def ask(self, ask: Asked, answer: Answered | None) -> None:
        """The request after the call it asked about, its answer after it."""
        events: list[m.Event] = [m.PermissionRequest(session=self.session, seq=0, turn=self.turn,
                                                     request_id=ask.request_id, tool=ask.tool,
                                                     arguments=ask.arguments)]
        if answer is not None:
            events.append(self._notice(PERMISSION_ANSWERED, {
                "request_id": answer.request_id, "tool": ask.tool, "allowed": answer.allowed, "uid": answer.uid,
                "client": answer.client, "at": answer.at}))
        wanted = {k: v for k, v in ask.arguments.items() if v is not None}
        match = next((cid for cid, name, args in self.calls if cid not in self._asked and name == ask.tool
                      and isinstance(args, dict) and {k: v for k, v in args.items() if v is not None} == wanted),
                     None) or next((cid for cid, name, _ in self.calls if cid not in self._asked and name == ask.tool),
                                   None)
        if match is not None:
            self._asked.add(match)
        # Asked after the markers of the same place: before them in the stream.
        self.inserts.append((self.call_at.get(match or "", len(self.items)), -1, events))

    def events(self) -> list[m.Event]:
        out: list[m.Event] = []
        inserts = sorted(self.inserts, key=lambda x: (x[0], x[1]))
        i = 0
        for at, _, events in inserts:
            out.extend(self.items[i:at])
            out.extend(events)
            i = max(i, at)
        out.extend(self.items[i:])
        return out


def decoded(data: bytes) -> Any:
    """A handler record (msgpack), or None."""
    if not data:
        return None
    try:
        return _msgpack.decode(data)
    except msgspec.DecodeError:
        return None


def _arguments(raw: Any) -> dict[str, Any] | None:
    """A call's arguments as its live `tool_call` showed them: the object,
    when they are one."""
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
