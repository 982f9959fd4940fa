"""`sessionctl`: the command-line client.

    sessionctl [--socket PATH] [--json] COMMAND ...

Exit codes: supervisor.ctl.render.EXIT_CODES (`--help` lists them).  With
--json a command prints one JSON object and a stream prints JSON lines, one
event each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from ipc import messages as m
from ipc.contract import INCOMPLETE_STOPS, StopReason
from ipc.loop import run as run_loop
from supervisor import __version__
from supervisor.ctl.client import AsyncClient
from supervisor.ctl.errors import DaemonUnavailable, RequestError
from supervisor.ctl.drain import drain_exit_code, drain_json, drain_text, timeout_secs
from supervisor.ctl.render import (
    EXIT_FAILED,
    EXIT_NO_SESSION,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_USAGE,
    SORT_KEYS,
    exit_code_for,
    exit_codes_text,
    failed,
    pong_text,
    print_stats,
    print_status,
    print_table,
)

__all__ = ["main"]



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


_EPILOG = """\
examples:
  sessionctl create                      create a session, print its id
  sessionctl create --handler echo --set agent.limits.max_memory_mb=256
  sessionctl send ID "list the files"    stream the reply; Ctrl-C interrupts
                                         the turn, a second Ctrl-C detaches
  sessionctl attach ID --from 0          replay retained events, then follow
  sessionctl approve ID REQUEST_ID       answer a permission request
  sessionctl --json status ID            one JSON object
  sessionctl top                         live view; sessionctl --json top --once
  sessionctl history ID --limit 5        the last five turns, tool calls included
  sessionctl logs ID -f                  state changes, limits, exits; then follow
  sessionctl export ID > s.json          and on another daemon:
  sessionctl import s.json               (same id; --id NEW renames)
  sessionctl drain 10.0.0.7              cluster: move a node's sessions off it
  sessionctl drain --undo 10.0.0.7       and take it back into use

exit codes:
""" + exit_codes_text()


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="machine-readable output")
    common.add_argument("--socket", default=argparse.SUPPRESS, help="daemon socket path")
    parser = argparse.ArgumentParser(
        prog="sessionctl", description="Talk to sessiond.", epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sessionctl {__version__}")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--socket", help="daemon socket path (default: $SESSIOND_SOCKET, "
                        "/run/sessiond/sessiond.sock as root, else $XDG_RUNTIME_DIR/sessiond/sessiond.sock)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[common])

    p = add("create", "create a session; prints its id")
    p.add_argument("--id", dest="session_id", help="choose the session id")
    p.add_argument("--handler", help="agent, echo or package.module:factory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="per-session config override, e.g. agent.limits.max_memory_mb=64")
    p = add("send", "send an input; streams the reply")
    p.add_argument("id")
    p.add_argument("text")
    p.add_argument("--reasoning", action="store_true", help=_REASONING_HELP)
    p = add("attach", "stream a session's events")
    p.add_argument("id")
    p.add_argument("--reasoning", action="store_true", help=_REASONING_HELP)
    p.add_argument("--from", dest="from_seq", type=int, help="replay retained events from this seq")
    p = add("ls", "list sessions")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the ids, one a line")
    for name, help_text in (
        ("status", "show one session"), ("interrupt", "interrupt the running turn"),
        ("stop", "stop a session's worker"), ("restart", "(re)start a session's worker"),
        ("rm", "delete a session and its state"),
    ):
        add(name, help_text).add_argument("id")
    for name in ("approve", "deny"):
        p = add(name, f"{name} a pending permission request")
        p.add_argument("id")
        p.add_argument("request_id")
    p = add("repair", "rewrite a damaged session's log so that it loads again")
    p.add_argument("id")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--skip-bad", dest="mode", action="store_const", const="skip_bad",
                     help="keep every intact record; drop only the damaged bytes")
    how.add_argument("--truncate", dest="mode", action="store_const", const="truncate",
                     help="keep only what precedes the first damaged record")
    add("stats", "daemon statistics")
    p = add("ping", "check the daemon (or a session's worker) answers")
    p.add_argument("id", nargs="?")
    p = add("top", "live view of the sessions (q quits); --once prints one sample")
    p.add_argument("--once", action="store_true", help="print one sample and exit (with --json: one object)")
    p.add_argument("--sort", choices=SORT_KEYS, default="cpu", help="sort key (default: cpu)")
    p.add_argument("--interval", type=_positive_secs, default=2.0, metavar="SECS",
                   help="seconds between refreshes (default: 2)")
    p.add_argument("--sample-secs", type=_positive_secs, default=0.5, metavar="SECS",
                   help="with --once: seconds between the two samples CPU %% is measured over (default: 0.5)")
    p = add("history", "the conversation as stored: inputs, replies, tool calls, aborted turns")
    p.add_argument("id")
    p.add_argument("--limit", type=_count, metavar="N", help="only the last N turns")
    p = add("logs", "a session's lifecycle events (state changes, limits, failures) with times")
    p.add_argument("id")
    p.add_argument("-f", "--follow", action="store_true", help="then follow new events as they happen")
    p.add_argument("--limit", type=_count, metavar="N", help="only the last N kept events")
    p = add("export", "write a session as a JSON document to stdout (for import elsewhere)")
    p.add_argument("id")
    p = add("import", "create a session from an export document; prints its id")
    p.add_argument("file", nargs="?", default="-", help="the export (default: - for stdin)")
    p.add_argument("--id", dest="session_id", help="import under this id instead of the exported one")
    p = add("drain", "cluster mode: keep new sessions off a node and move its sessions elsewhere, "
                     "each once idle (running turns finish first)")
    p.add_argument("node", help="its IP address (the `node` of `ls --json`) or its Ray node id")
    p.add_argument("--timeout", type=timeout_secs, metavar="SECS",
                   help="give up waiting for running turns after SECS (default: the daemon's "
                        "agent.turn_timeout_secs plus 60: every turn running now has ended by then)")
    p.add_argument("--undo", action="store_true", help="take the node back into use")
    p = add("completion", "print a shell completion script")
    p.add_argument("shell", choices=("bash", "zsh"))
    return parser


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def _positive_secs(text: str) -> float:
    try:
        secs = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0.05 <= secs <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0.05 and 3600, got {text}")
    return secs


_TOOL_LINE_CHARS = 200


def _clip(text: str, limit: int = _TOOL_LINE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _tool_line(kind: str, data: dict[str, Any]) -> str | None:
    """One compact line for a `tool_call` or `tool_result` notice (None for
    other notices): what the agent runs, and how it went."""
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
        status = "ok" if data.get("ok") else "failed"
        return _clip(f"[tool] {name} {status}: {lines[0]}", _TOOL_LINE_CHARS - len(tail)) + tail
    return None


def _permission_text(ev: m.PermissionRequest) -> str:
    """The whole request, arguments uncut: the user decides on exactly this."""
    return f"{ev.tool} {json.dumps(ev.arguments, ensure_ascii=False)}"


_REASONING_HELP = "also show the model's reasoning (dimmed, on stderr; with --json, as events)"


def _print_reasoning(text: str) -> None:
    # stderr, so that stdout stays the reply alone; dimmed on a terminal.
    if sys.stderr.isatty():
        text = f"\x1b[2m{text}\x1b[0m"
    sys.stderr.write(text)
    sys.stderr.flush()


def _print_event(ev: Any) -> None:
    match ev:
        case m.TextDelta(text=text):
            sys.stdout.write(text)
        case m.ReasoningDelta(text=text):
            _print_reasoning(text)
        case m.TurnDone(turn=turn, interrupted=interrupted, stop_reason=stop):
            how = " (interrupted)" if interrupted else f" ({stop})" if stop else ""
            print(f"\n[turn {turn} done{how}]")
        case m.TurnFailed(turn=turn, reason=reason):
            print(f"\n[turn {turn} failed: {reason}]")
        case m.StateChanged(old=old, new=new, reason=reason):
            print(f"[{old} -> {new}{': ' + reason if reason else ''}]")
        case m.LimitExceeded():
            print(f"[limit {ev.kind}: {_limit_text(ev)}]")
        case m.Notice(kind=kind, data=data):
            print(_tool_line(kind, data) or f"[{kind}: {json.dumps(data)}]")
        case m.PermissionRequest(request_id=rid):
            print(f"[permission request {rid}: {_permission_text(ev)}]")
        case m.Gap(seq=seq, from_seq=from_seq):
            print(f"[events {from_seq}..{seq - 1} are no longer retained]")
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


async def _run(args: argparse.Namespace) -> int:
    client = await AsyncClient.connect(
        args.socket, client_name="sessionctl", reasoning=getattr(args, "reasoning", False)
    )
    try:
        return await _COMMANDS[args.command](client, args, args.json)
    finally:
        await client.close()


# Each command: (the client, the parsed command line, --json) -> its exit
# code.  A RequestError or DaemonUnavailable it does not handle itself ends
# in main(), which maps it to the exit code (render.exit_code_for).


async def _create(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    from ipc.errors import BadOverride
    from ipc.inputs import parse_override

    overrides: dict[str, Any] = {}
    for item in args.overrides:
        try:
            key, value = parse_override(item)
        except BadOverride as exc:
            print(f"sessionctl: {exc}", file=sys.stderr)
            return EXIT_USAGE
        overrides[key] = value
    try:
        info = await client.create(args.session_id, args.handler, overrides)
    except RequestError as exc:
        if exc.code != "bad_request":
            raise
        # A bad --id, --handler or --set: the command line's fault.
        print(f"sessionctl: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(to_plain(info)) if as_json else info.id)
    return EXIT_OK


async def _send_command(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    return await _send_interruptibly(client, args.id, args.text, as_json)


async def _attach(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    deleted = False
    async for ev in client.attach(args.id, args.from_seq):
        if as_json:
            print(event_json(ev), flush=True)
        else:
            _print_event(ev)
        deleted = isinstance(ev, m.StateChanged) and ev.new == "deleted"
    if not deleted:
        # The stream ends by itself only when the session is deleted;
        # anything else is the daemon going away.
        raise DaemonUnavailable("connection to sessiond lost")
    return EXIT_OK


async def _ls(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    sessions = await client.list()
    if args.quiet:
        for s in sessions:
            print(s.id)
    elif as_json:
        print(json.dumps({"sessions": to_plain(sessions)}))
    elif sessions:
        print_table(to_plain(sessions))
    else:
        print("no sessions")
    return EXIT_OK


async def _status(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    info = await client.status(args.id)
    print(json.dumps(to_plain(info))) if as_json else print_status(to_plain(info))
    return EXIT_OK


async def _stats(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    stats = await client.stats()
    print(json.dumps(to_plain(stats))) if as_json else print_stats(to_plain(stats))
    return EXIT_OK


async def _ping(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    t0 = time.perf_counter()
    pong = await client.ping(args.id)
    rtt_ms = (time.perf_counter() - t0) * 1000
    if as_json:
        print(json.dumps({"pid": pong.pid, "session": pong.session, "rtt_ms": round(rtt_ms, 3)}))
    else:
        print(pong_text(pong.session, pong.pid, rtt_ms))
    return EXIT_OK


async def _lifecycle(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    """interrupt, stop, restart, rm: one request, nothing to print but --json's ok."""
    action = {"interrupt": client.interrupt, "stop": client.stop,
              "restart": client.restart, "rm": client.remove}[args.command]
    await action(args.id)
    if as_json:
        print(json.dumps({"ok": True, "id": args.id}))
    return EXIT_OK


async def _repair(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    repaired = await client.repair(args.id, args.mode)
    if as_json:
        print(json.dumps(to_plain(repaired)))
    else:
        print(f"repaired {args.id}: {repaired.kept_records} record(s) kept, "
              f"{repaired.dropped_records} intact record(s) and "
              f"{repaired.dropped_bytes} damaged byte(s) dropped; now {repaired.session.state}")
    return EXIT_OK


# top, history and logs import their modules when run, not at the top:
# curses and the history renderers cost every other command's start-up.


async def _top(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    from supervisor.ctl.top import run_top

    return await run_top(client, once=args.once, as_json=as_json, sort=args.sort,
                         interval=args.interval, sample_secs=args.sample_secs)


async def _history(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    from supervisor.ctl.history import print_history

    print_history(await client.history(args.id, args.limit), as_json)
    return EXIT_OK


async def _logs(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    from supervisor.ctl.history import follow_logs, print_logs

    logs = await client.logs(args.id, args.limit)
    if args.follow:
        return await follow_logs(client, logs, as_json)
    print_logs(logs, as_json)
    return EXIT_OK


async def _export(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    document = await client.export(args.id)
    sys.stdout.buffer.write(document + b"\n")
    sys.stdout.flush()
    return EXIT_OK


async def _drain(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    try:
        drained = await client.drain(args.node, args.timeout, args.undo)
    except RequestError as exc:
        if exc.code not in ("not_found", "bad_request"):
            raise
        print(f"sessionctl: {exc.message}", file=sys.stderr)  # a node, not a session
        return EXIT_USAGE if exc.code == "bad_request" else EXIT_FAILED
    print(drain_json(drained)) if as_json else sys.stdout.write(drain_text(drained, args.undo))
    return drain_exit_code(drained)


async def _answer(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    """approve, deny."""
    try:
        await client.answer(args.id, args.request_id, args.command == "approve")
    except RequestError as exc:
        if exc.code != "not_found":
            raise
        # not_found covers the request and the session; exit 4 is for
        # "no such session" alone.
        await client.status(args.id)  # raises not_found (4) if that is it
        print(f"sessionctl: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    if as_json:
        print(json.dumps({"ok": True, "id": args.id, "request_id": args.request_id}))
    return EXIT_OK


async def _import(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    from supervisor.ctl.errors import ImportFileError
    from supervisor.ctl.history import read_document
    from ipc.inputs import valid_session_id

    if args.session_id is not None and not valid_session_id(args.session_id):
        print(f"sessionctl: invalid session id {args.session_id!r}: 1-64 characters of "
              "A-Z a-z 0-9 . _ -, starting with a letter or digit", file=sys.stderr)
        return EXIT_USAGE
    try:
        # Well under a frame: the request carries it whole.
        document = read_document(args.file, 15 * 1024 * 1024)
    except ImportFileError as exc:
        print(f"sessionctl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        info = await client.import_session(document, args.session_id)
    except RequestError as exc:
        if exc.code == "not_found":  # not "no such session": nothing was named
            print(f"sessionctl: {exc.message}", file=sys.stderr)
            return EXIT_FAILED
        raise
    print(json.dumps({"id": info.id}) if as_json else info.id)
    return EXIT_OK


# Every command but `completion` (main() answers it without a daemon).
_COMMANDS: dict[str, Callable[[AsyncClient, argparse.Namespace, bool], Awaitable[int]]] = {
    "create": _create, "send": _send_command, "attach": _attach, "ls": _ls, "status": _status,
    "stats": _stats, "ping": _ping, "interrupt": _lifecycle, "stop": _lifecycle,
    "restart": _lifecycle, "rm": _lifecycle, "repair": _repair, "top": _top, "history": _history,
    "logs": _logs, "export": _export, "import": _import, "drain": _drain, "approve": _answer,
    "deny": _answer,
}


_STOP_TEXT: dict[str, str] = {
    StopReason.TRUNCATED: "the reply was truncated: the model hit its output token limit",
    StopReason.FILTERED: "the reply was filtered by the provider's content filter",
    StopReason.REFUSED: "the model refused to answer",
}




async def _send_interruptibly(client: AsyncClient, session: str, text: str, as_json: bool) -> int:
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
        return await _send(client, session, text, as_json)  # not the main thread: plain Ctrl-C
    stream = asyncio.ensure_future(_send(client, session, text, as_json))
    interrupted = False
    try:
        while True:
            sigint = asyncio.ensure_future(sigints.get())
            await asyncio.wait({stream, sigint}, return_when=asyncio.FIRST_COMPLETED)
            if stream.done():
                sigint.cancel()
                code = stream.result()
                return EXIT_SIGINT if interrupted and code == EXIT_OK else code
            if not interrupted:
                interrupted = True
                print(f"\nsessionctl: interrupting the turn of {session} (Ctrl-C again to detach)",
                      file=sys.stderr, flush=True)
                try:
                    await client.interrupt(session)
                except RequestError as exc:
                    # Typically: the turn ended meanwhile; its end is on its way.
                    print(f"sessionctl: {exc.message}", file=sys.stderr, flush=True)
                continue
            print(f"sessionctl: detached; the turn of {session} goes on in the daemon "
                  f"(`sessionctl interrupt {session}` stops it)", file=sys.stderr, flush=True)
            return EXIT_SIGINT
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if not stream.done():
            stream.cancel()
            with contextlib.suppress(BaseException):
                await stream


async def _send(client: AsyncClient, session: str, text: str, as_json: bool) -> int:
    interactive = sys.stdin.isatty() and not as_json
    same_terminal = sys.stdout.isatty() and sys.stderr.isatty()
    asks: set[asyncio.Task[None]] = set()
    ended_with_newline = True
    streamed: list[str] = []
    async for ev in client.send(session, text):
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
            case m.Notice(kind=kind, data=data) if not as_json:
                line = _tool_line(kind, data)
                if line is not None:
                    # Tool calls go to stderr: stdout stays the reply alone.
                    if not ended_with_newline and same_terminal:
                        sys.stdout.write("\n")
                        sys.stdout.flush()
                        ended_with_newline = True
                    print(line, file=sys.stderr, flush=True)
            case m.PermissionRequest() if not as_json:
                print(f"\nsessionctl: permission request {ev.request_id}: {_permission_text(ev)}\n"
                      f"sessionctl: answer with `sessionctl approve|deny {session} {ev.request_id}`",
                      file=sys.stderr, flush=True)
            case m.LimitExceeded() if not as_json:
                print(f"\nsessionctl: limit {ev.kind} exceeded: {_limit_text(ev)}", file=sys.stderr)
            case m.TurnDone(interrupted=interrupted, stop_reason=stop):
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
                return EXIT_OK
            case m.TurnFailed(reason=reason):
                if not as_json and not ended_with_newline:
                    sys.stdout.write("\n")
                print(f"sessionctl: turn {ev.turn} failed: {reason}", file=sys.stderr)
                return EXIT_FAILED
    return EXIT_FAILED


def _limit_text(ev: m.LimitExceeded) -> str:
    if ev.ceiling:  # a budget: reached at its ceiling, not only past it
        return f"{ev.ceiling} = {ev.limit:g} {ev.unit}, {ev.value:g} {ev.unit} spent"
    return f"{ev.value:g} > {ev.limit:g}"


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


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "completion":  # no daemon needed
        from supervisor.ctl.completion import bash_script, zsh_script

        sys.stdout.write((bash_script if args.shell == "bash" else zsh_script)(parser))
        return EXIT_OK
    try:
        return run_loop(_run(args))
    except (DaemonUnavailable, RequestError) as exc:
        return failed(exc)
    except KeyboardInterrupt:
        return EXIT_SIGINT


if __name__ == "__main__":
    sys.exit(main())
