"""A session's events as sessionctl prints them: `send`'s reply streamed
as it comes (Ctrl-C, permission prompts, tool lines, the exit code of a
turn), `attach`'s events, and the JSON form of both.

Runs in the sessionctl process (supervisor.ctl.cli calls it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

import msgspec

from ipc import messages as m
from ipc.contract import INCOMPLETE_STOPS, LimitKind, StopReason, limit_text
from supervisor.ctl.client import AsyncClient
from supervisor.ctl.errors import DaemonUnavailable, RequestError
from supervisor.ctl.render import EXIT_FAILED, EXIT_OK, EXIT_SIGINT

__all__ = ["answered_text", "event_json", "event_line", "print_event", "send_interruptibly", "to_plain"]


def to_plain(obj: Any) -> Any:
    """A Struct as a dict with every field (the wire omits defaults; JSON
    output must not: `status --json` always has pid, rss_bytes, last_exit)."""
    if isinstance(obj, msgspec.Struct):
        return {f: to_plain(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, list):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def event_json(ev: Any) -> str:
    data = {"type": type(ev).__struct_config__.tag}
    data.update(to_plain(ev))
    return json.dumps(data)


_TOOL_LINE_CHARS = 200


def _clip(text: str, limit: int = _TOOL_LINE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _tool_line(kind: str, data: dict[str, Any]) -> str | None:
    """One compact line for a `tool_call` or `tool_result` notice, or an
    MCP server's (None for other notices): what the agent runs, how it
    went, and a server whose tools it cannot use (said once, with why)."""
    if data.get("replayed"):
        return ""  # a resumed turn's result of a run shown before its worker died: not a new run
    if kind == "mcp_server_unavailable":
        retry = data.get("retry_in_secs")
        again = f" (tried again in {retry:g} s)" if isinstance(retry, (int, float)) else ""
        return _clip(f"[mcp] server {data.get('server', '?')} is unavailable: {data.get('error', '')}{again}", 2000)
    if kind == "mcp_tools_refused":
        tools = data.get("tools") or []
        shown = "; ".join(f"{t.get('tool')}: {t.get('reason')}" for t in tools[:5] if isinstance(t, dict))
        return _clip(f"[mcp] server {data.get('server', '?')}: {len(tools)} tool(s) not offered: {shown}", 2000)
    name = str(data.get("name", "?"))
    if kind == "tool_call":
        args = data.get("arguments", {})
        shown = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return _clip(f"[tool] {name} {shown}")
    if kind == "tool_result":
        lines = str(data.get("output", "")).strip().splitlines() or [""]
        more = len(lines) - 1
        tail = f" (+{more} line{'s' if more > 1 else ''})" if more else ""
        if data.get("truncated"):
            tail += " (cut)"
        # No "ok": a turn stored before outcomes were (history), never shown as a success.
        ok = data.get("ok")
        status = "ok" if ok is True else "failed" if ok is False else "(outcome unknown)"
        return _clip(f"[tool] {name} {status}: {lines[0]}", _TOOL_LINE_CHARS - len(tail)) + tail
    return None


def _permission_text(ev: m.PermissionRequest) -> str:
    """The whole request, arguments uncut: the user decides on exactly this."""
    return f"{ev.tool} {json.dumps(ev.arguments, ensure_ascii=False)}"


def answered_text(data: dict[str, Any]) -> str:
    """A `permission_answered` notice: what, which way, who and when."""
    how = "allowed" if data.get("allowed") else "denied"
    who = f"uid {data.get('uid')}" + (f" ({data['client']})" if data.get("client") else "")
    at = data.get("at")
    when = time.strftime(" at %H:%M:%S", time.localtime(at)) if isinstance(at, (int, float)) and at else ""
    return f"permission request {data.get('request_id')} ({data.get('tool')}) {how} by {who}{when}"


def _print_reasoning(text: str) -> None:
    # stderr, so that stdout stays the reply alone; dimmed on a terminal.
    if sys.stderr.isatty():
        text = f"\x1b[2m{text}\x1b[0m"
    sys.stderr.write(text)
    sys.stderr.flush()


def event_line(ev: Any) -> str | None:
    """One line for an event that is not reply text, as `attach` prints it
    live and `history` prints a stored turn's (None: nothing to print)."""
    match ev:
        case m.TurnDone(turn=turn, interrupted=interrupted, stop_reason=stop):
            how = " (interrupted)" if interrupted else f" ({stop})" if stop else ""
            return f"[turn {turn} done{how}]"
        case m.TurnFailed(turn=turn, reason=reason):
            return f"[turn {turn} failed: {reason}]"
        case m.StateChanged(old=old, new=new, reason=reason):
            return f"[{old} -> {new}{': ' + reason if reason else ''}]"
        case m.LimitExceeded(kind=kind, value=value, limit=limit, ceiling=ceiling, unit=unit):
            return f"[limit {kind}: {limit_text(kind, value, limit, ceiling, unit)}]"
        case m.Notice(kind="permission_answered", data=data):
            return f"[{answered_text(data)}]"
        case m.Notice(kind="turn_resumed", data=data):
            return f"[turn resumed at step {data.get('step')} after {data.get('reason')}: {data.get('cause')}]"
        case m.Notice(kind=kind, data=data):
            line = _tool_line(kind, data)
            return None if line == "" else line or f"[{kind}: {json.dumps(data)}]"
        case m.PermissionRequest(request_id=rid):
            return f"[permission request {rid}: {_permission_text(ev)}]"
        case m.Gap(seq=seq, from_seq=from_seq):
            return f"[events {from_seq}..{seq - 1} are no longer retained]"
    return None


def print_event(ev: Any) -> None:
    match ev:
        case m.TextDelta(text=text):
            sys.stdout.write(text)
        case m.ReasoningDelta(text=text):
            _print_reasoning(text)
        case m.TurnDone() | m.TurnFailed():
            print(f"\n{event_line(ev)}")
        case m.PermissionRequest(request_id=rid, session=sid):
            print(f"{event_line(ev)} (sessionctl approve|deny {sid} {rid})")
        case _:
            if (line := event_line(ev)) is not None:
                print(line)
    sys.stdout.flush()


async def _ask_on_terminal(client: AsyncClient, session: str, ev: m.PermissionRequest) -> None:
    prompt = f"\nallow {_permission_text(ev)}? [y/N] "
    answer = await asyncio.get_running_loop().run_in_executor(None, _read_answer, prompt)
    await client.answer(session, ev.request_id, answer)


def _read_answer(prompt: str) -> bool:
    """Ask on the controlling terminal (stdout may be a pipe); no terminal,
    or anything but y/yes, is a no."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return False
    try:
        os.write(fd, prompt.encode())
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(fd, 256)
            if not chunk:
                break
            line += chunk
        return line.strip().lower() in (b"y", b"yes")
    except OSError:
        return False
    finally:
        os.close(fd)


# Limits that end a turn before the handler would have (its TurnDone then
# comes, interrupted or with a note): `send` exits 1, as for a failed turn.
_CUTTING_LIMITS: dict[str, str] = {
    LimitKind.TURN_TIMEOUT: "agent.turn_timeout_secs",
    LimitKind.TURNS: "agent.max_turns (model calls for one input)",
    LimitKind.BUDGET: "a ceiling of [agent.budget]",
}

_STOP_TEXT: dict[str, str] = {
    StopReason.TRUNCATED: "the reply was truncated: the model hit its output token limit",
    StopReason.FILTERED: "the reply was filtered by the provider's content filter",
    StopReason.REFUSED: "the model refused to answer",
}




async def send_interruptibly(client: AsyncClient, session: str, text: str, as_json: bool,
                             traceparent: str = "") -> int:
    """`send`, where Ctrl-C means what a user expects: the first interrupts
    the turn (its LLM calls and tools stop; the partial reply is kept and
    printed), a second one detaches and leaves the turn to the daemon.

    Either way the exit code is 130, as for any command stopped by Ctrl-C.
    The signal callback only enqueues (it runs on the loop, but the rule
    holds); this coroutine does the talking."""
    loop = asyncio.get_running_loop()
    sigints: asyncio.Queue[None] = asyncio.Queue()
    try:
        loop.add_signal_handler(signal.SIGINT, sigints.put_nowait, None)
    except (NotImplementedError, RuntimeError, ValueError):
        return await _send(client, session, text, as_json, traceparent)  # not the main thread: plain Ctrl-C
    stream = asyncio.ensure_future(_send(client, session, text, as_json, traceparent))
    interrupted = False
    try:
        while True:
            sigint = asyncio.ensure_future(sigints.get())
            await asyncio.wait({stream, sigint}, return_when=asyncio.FIRST_COMPLETED)
            if stream.done():
                sigint.cancel()
                code = stream.result()
                return EXIT_SIGINT if interrupted and code == EXIT_OK else code
            if not interrupted and client.connected:
                interrupted = True
                print(f"\nsessionctl: interrupting the turn of {session} (Ctrl-C again to detach)",
                      file=sys.stderr, flush=True)
                try:
                    await client.interrupt(session)
                except RequestError as exc:
                    # Typically: the turn ended meanwhile; its end is on its way.
                    print(f"sessionctl: {exc.message}", file=sys.stderr, flush=True)
                    continue
                except DaemonUnavailable:
                    pass  # lost meanwhile: nothing to interrupt through; stop waiting
                else:
                    continue
            if not client.connected:
                # Waiting for a daemon that went away: nothing can be
                # interrupted, so Ctrl-C stops the wait.
                print(f"\nsessionctl: stopped waiting for sessiond; the turn of {session} goes on if it comes "
                      f"back (`sessionctl history {session}` tells how it ended)", file=sys.stderr, flush=True)
                return EXIT_SIGINT
            print(f"sessionctl: detached; the turn of {session} goes on in the daemon "
                  f"(`sessionctl interrupt {session}` stops it)", file=sys.stderr, flush=True)
            return EXIT_SIGINT
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if not stream.done():
            stream.cancel()
            with contextlib.suppress(BaseException):
                await stream


async def _send(client: AsyncClient, session: str, text: str, as_json: bool, traceparent: str = "") -> int:
    interactive = sys.stdin.isatty() and not as_json
    same_terminal = sys.stdout.isatty() and sys.stderr.isatty()
    asks: set[asyncio.Task[None]] = set()
    ended_with_newline = True
    streamed: list[str] = []
    cut_by: str | None = None
    async for ev in client.send(session, text, traceparent):
        if as_json:
            print(event_json(ev), flush=True)
        match ev:
            case m.TextDelta(text=delta) if not as_json:
                sys.stdout.write(delta)
                sys.stdout.flush()
                streamed.append(delta)
                ended_with_newline = delta.endswith("\n")
            case m.ReasoningDelta(text=thought) if not as_json:
                _print_reasoning(thought)
            case m.PermissionRequest() if interactive:
                asks.add(asyncio.create_task(_ask_on_terminal(client, session, ev)))
            case m.Notice(kind="permission_answered", data=data) if not as_json:
                print(f"sessionctl: {answered_text(data)}", file=sys.stderr, flush=True)
            case m.Notice(kind="turn_resumed", data=data) if not as_json:
                # The worker died; the turn goes on on a new one (docs/agent.md, "Durable steps").
                print(f"\nsessionctl: the turn resumed at step {data.get('step')} after "
                      f"{data.get('reason')}: {data.get('cause')}", file=sys.stderr, flush=True)
            case m.Notice(kind=kind, data=data) if not as_json:
                line = _tool_line(kind, data)
                if line:
                    # Tool calls go to stderr: stdout stays the reply alone.
                    if not ended_with_newline and same_terminal:
                        sys.stdout.write("\n")
                        sys.stdout.flush()
                        ended_with_newline = True
                    print(line, file=sys.stderr, flush=True)
            case m.Gap(seq=seq, from_seq=from_seq) if not as_json:
                # After a reconnect: the daemon restarted, or cut this client off for lagging.
                print(f"\nsessionctl: events {from_seq}..{seq - 1} of {session} were not kept: what the turn "
                      "streamed then, if anything, is not shown (its reply is, when it ends)",
                      file=sys.stderr, flush=True)
            case m.PermissionRequest() if not as_json:
                print(f"\nsessionctl: permission request {ev.request_id}: {_permission_text(ev)}\n"
                      f"sessionctl: answer with `sessionctl approve|deny {session} {ev.request_id}`",
                      file=sys.stderr, flush=True)
            case m.LimitExceeded(kind=kind, value=value, limit=limit, ceiling=ceiling, unit=unit):
                if kind in _CUTTING_LIMITS:
                    cut_by = ceiling or _CUTTING_LIMITS[kind]
                if not as_json:
                    print(f"\nsessionctl: limit {kind}: {limit_text(kind, value, limit, ceiling, unit)}",
                          file=sys.stderr)
            case m.TurnDone(interrupted=interrupted, stop_reason=stop):
                if ev.seq == 0 and not as_json:  # (AsyncClient.send: read back after a reconnect)
                    print(f"\nsessionctl: turn {ev.turn} ended while sessiond was away; as its history keeps it:",
                          file=sys.stderr, flush=True)
                if not as_json:
                    rest = _unstreamed(ev.reply, "".join(streamed), ended_with_newline)
                    if rest:
                        sys.stdout.write(rest)
                        ended_with_newline = rest.endswith("\n")
                    if not ended_with_newline:
                        sys.stdout.write("\n")
                    if interrupted:
                        print("sessionctl: the turn was interrupted", file=sys.stderr)
                if stop in INCOMPLETE_STOPS:
                    # Also with --json: a script must not take a cut reply
                    # for an answer because it only checked the exit code.
                    print(f"sessionctl: turn {ev.turn}: {_STOP_TEXT.get(stop, stop)} "
                          f"(provider said {ev.stop_detail or stop!r})", file=sys.stderr)
                    return EXIT_FAILED
                if cut_by is not None:  # the same: a limit cut the turn short
                    print(f"sessionctl: turn {ev.turn} was cut short by a limit: {cut_by}",
                          file=sys.stderr)
                    return EXIT_FAILED
                return EXIT_OK
            case m.TurnFailed(reason=reason):
                if not as_json and not ended_with_newline:
                    sys.stdout.write("\n")
                print(f"sessionctl: turn {ev.turn} failed: {reason}", file=sys.stderr)
                return EXIT_FAILED
    return EXIT_FAILED


def _unstreamed(reply: str, streamed: str, ended_with_newline: bool) -> str:
    """What of the turn's reply the user has not seen yet.

    A handler may stream its whole reply, part of it, or only a progress
    word ("counting… ") and return the reply without streaming it; the user
    must see the reply in every case, and never twice."""
    if not reply or reply == streamed:
        return ""
    if reply.startswith(streamed):
        return reply[len(streamed):]
    # Something else was streamed: the reply goes on a line of its own.
    return reply if ended_with_newline else "\n" + reply
