"""sessionctl's `history`, `logs`, `export` and `import` (the sessionctl
process).  Output: text for people; with --json, one JSON object (history,
logs) or JSON lines (logs -f, one entry each)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from ipc import messages as m
from ipc.contract import limit_text
from ipc import operator as op
from supervisor.ctl.client import AsyncClient
from supervisor.ctl.errors import DaemonUnavailable, ImportFileError
from supervisor.ctl.render import EXIT_OK
from supervisor.ctl.stream import event_line

__all__ = ["follow_logs", "print_history", "print_logs", "read_document"]

_TOOL_CHARS = 200


def _when(at: float) -> str:
    if not at:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f".{int(at * 1000) % 1000:03d}"


def _clip(text: str, limit: int = _TOOL_CHARS) -> str:
    text = text.replace("\n", "⏎ ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plain(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_plain(x) for x in obj]
    if hasattr(obj, "__struct_fields__"):
        data = {f: _plain(getattr(obj, f)) for f in obj.__struct_fields__}
        if isinstance(obj, m.EVENT_TYPES):  # (a turn's events, a log entry's event)
            data = {"type": type(obj).__struct_config__.tag, **data}
        return data
    return obj


def print_history(reply: op.HistoryReply, as_json: bool) -> None:
    if as_json:
        print(json.dumps({
            "session": reply.session, "earlier_turns": reply.earlier_turns,
            "earlier_messages": reply.earlier_messages, "omitted_turns": reply.omitted_turns,
            "turns": _plain(reply.turns)}, default=str))
        return
    out = sys.stdout
    if reply.earlier_turns:
        print(f"({reply.earlier_turns} earlier turn(s) are folded into the session's snapshot"
              f"{'; its conversation then:' if reply.earlier_messages else ')'}", file=out)
        for msg in reply.earlier_messages:
            print(f"  {msg.get('role', '?')}: {_clip(str(msg.get('content') or ''))}", file=out)
        if reply.earlier_messages:
            print(")", file=out)
    if reply.omitted_turns:
        print(f"({reply.omitted_turns} older turn(s) left out: too large for one reply; "
              "`sessionctl export` has them)", file=out)
    if not reply.turns and not reply.earlier_turns:
        print("no turns yet", file=out)
    for t in reply.turns:
        how = {"done": "done" + (" (interrupted)" if t.interrupted else ""),
               "aborted": f"aborted: {t.reason}", "open": "running"}.get(t.outcome, t.outcome)
        print(f"--- turn {t.turn}  {_when(t.at)}  {how}", file=out)
        print(f"> {t.input}", file=out)
        _print_story(t, out)


def _print_story(t: op.HistoryTurn, out: Any) -> None:
    """The turn as `attach` showed it live (its stored events, in order:
    supervisor/api/story.py); a turn without them (the open one) as what
    the log holds so far."""
    said = False
    for ev in t.events:
        if isinstance(ev, m.TextDelta):
            text = ev.text.lstrip("\n") if not said else ev.text  # (parts text from text before it only)
            out.write(text if text.endswith("\n") else text + "\n")
            said = True
        elif (line := event_line(ev)) is not None:
            print(line, file=out)
    if t.events:
        if not said and t.reply:
            print(t.reply, file=out)
        return
    for r in t.resumed:
        print(f"[turn resumed at step {r.get('step')} after {r.get('reason')}: {r.get('cause')}]", file=out)
    if t.reply:
        print(t.reply, file=out)


def _entry_text(at: float, ev: Any) -> str:
    match ev:
        case m.StateChanged(old=old, new=new, reason=reason):
            what = f"state {old} -> {new}{': ' + reason if reason else ''}"
        case m.LimitExceeded(kind=kind, value=value, limit=limit, ceiling=ceiling, unit=unit):
            what = f"limit {kind}: {limit_text(kind, value, limit, ceiling, unit)}"
        case m.TurnFailed(turn=turn, reason=reason):
            what = f"turn {turn} failed: {reason}"
        case _:
            what = type(ev).__name__
    return f"{_when(at)}  {what}"


def _entry_json(at: float, ev: Any) -> str:
    return json.dumps({"at": at, **_plain(ev)})


def print_logs(reply: op.LogsReply, as_json: bool) -> None:
    if as_json:
        e = reply.last_exit
        print(json.dumps({
            "session": reply.session,
            "entries": [{"at": x.at, **_plain(x.event)} for x in reply.entries],
            "last_exit": None if e is None else _plain(e),
        }))
        return
    if not reply.entries:
        print("(no lifecycle events kept)")
    for x in reply.entries:
        print(_entry_text(x.at, x.event))
    if reply.last_exit is not None:
        e = reply.last_exit
        how = f"signal {e.signal}" if e.signal else f"code {e.code}"
        print(f"last exit: {_when(e.at)}  {e.reason} ({how}){': ' + e.detail if e.detail else ''}")


async def follow_logs(client: AsyncClient, reply: op.LogsReply, as_json: bool) -> int:
    """`logs -f`: the kept entries, then lifecycle events as they happen
    (timed on arrival), until the session is deleted."""
    if as_json:
        for x in reply.entries:
            print(_entry_json(x.at, x.event), flush=True)
    else:
        for x in reply.entries:
            print(_entry_text(x.at, x.event), flush=True)
    async for ev in client.attach(reply.session, reply.next_seq):
        if isinstance(ev, (m.StateChanged, m.LimitExceeded, m.TurnFailed)):
            now = time.time()
            print(_entry_json(now, ev) if as_json else _entry_text(now, ev), flush=True)
            if isinstance(ev, m.StateChanged) and ev.new == "deleted":
                return EXIT_OK
    raise DaemonUnavailable("connection to sessiond lost")


def read_document(path: str, limit: int) -> bytes:
    """The export file's bytes ("-": stdin), at most `limit` of them."""
    try:
        if path == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                with os.fdopen(fd, "rb", closefd=False) as f:
                    data = f.read(limit + 1)
            finally:
                os.close(fd)
    except OSError as exc:
        raise ImportFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ImportFileError(f"{path} is larger than {limit} bytes: not an export sessiond can take")
    return data
