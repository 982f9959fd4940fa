"""`sessionctl`: the command-line client.

    sessionctl [--socket PATH] [--json] COMMAND ...

Exit codes: supervisor.ctl.render.EXIT_CODES (`--help` lists them).  With
--json a command prints one JSON object and a stream prints JSON lines, one
event each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ipc import messages as m
from ipc.contract import LIST_PAGE_MAX, SESSION_STATES
from ipc.loop import run as run_loop
from ipc.traceparent import parse_traceparent
from supervisor import __version__
from supervisor.ctl.client import AsyncClient
from supervisor.ctl.errors import DaemonUnavailable, RequestError
from supervisor.ctl.link import RECONNECT_SECS, RECONNECT_SECS_ENV
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
    loading_text,
    pong_text,
    print_stats,
    print_status,
    print_table,
    stdout_gone,
)
from supervisor.ctl.stream import event_json, print_event, send_interruptibly, to_plain

__all__ = ["main"]

_EPILOG = """\
examples:
  sessionctl create                      create a session, print its id
  sessionctl create --handler echo --set agent.limits.max_memory_mb=256
  sessionctl send ID "list the files"    stream the reply; Ctrl-C interrupts
                                         the turn, a second Ctrl-C detaches
  sessionctl attach ID --from 0          replay retained events, then follow
  sessionctl approve ID [REQUEST_ID]     answer a permission request
  sessionctl --json status ID            one JSON object
  sessionctl ls --state idle --sort cpu  filter and order the listing
  sessionctl rm --state failed --dry-run what `rm --state failed` would remove
  sessionctl top                         live view; sessionctl --json top --once
  sessionctl history ID --limit 5        the last five turns, tool calls included
  sessionctl logs ID -f                  state changes, limits, exits; then follow
  sessionctl export ID > s.json          and on another daemon:
  sessionctl import s.json               (same id; --id NEW renames)
  sessionctl drain 10.0.0.7              cluster: move a node's sessions off it
  sessionctl drain --undo 10.0.0.7       and take it back into use

exit codes:
""" + exit_codes_text()


_N = TypeVar("_N", int, float)


def _number(convert: Callable[[str], _N], low: _N, high: _N, expected: str,
            out_of_range: str) -> Callable[[str], _N]:
    """An argparse type: `convert(text)` within [low, high]; `out_of_range`
    may name {value} (as converted) and {text} (as typed)."""
    def parse(text: str) -> _N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(out_of_range.format(value=value, text=text))
        return value

    return parse


# (`web --port`'s here: the console's module is imported only to serve.)
_port_number = _number(int, 0, 65535, "a port number", "must be a port number (0-65535), got {value}")
_uid = _number(int, 0, 2**32 - 1, "a numeric uid", "not a uid: {value}")
_count = _number(int, 0, 2**63 - 1, "a whole number", "must be 0 or more, got {value}")
_positive_secs = _number(float, 0.05, 3600.0, "seconds", "must be between 0.05 and 3600, got {text}")
_page_size = _number(int, 1, LIST_PAGE_MAX, "a whole number", f"must be 1 to {LIST_PAGE_MAX}, got {{value}}")


def _session_id(text: str) -> str:
    from ipc.inputs import valid_session_id

    if not valid_session_id(text):
        raise argparse.ArgumentTypeError(f"not a session id: {text!r}")
    return text


_reconnect_secs = _number(float, 0.0, 86400.0, "seconds", "must be between 0 and 86400, got {text}")
_RECONNECT_HELP = (f"if the daemon goes away, reconnect for up to SECS and go on from the last event seen "
                   f"(default: ${RECONNECT_SECS_ENV}, else {RECONNECT_SECS:g}; 0: do not)")


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
    p.add_argument("--traceparent", metavar="TRACEPARENT",
                   help="continue this W3C trace in the turn's trace (default: $TRACEPARENT)")
    p.add_argument("--reconnect-secs", type=_reconnect_secs, metavar="SECS", help=_RECONNECT_HELP)
    p = add("attach", "stream a session's events")
    p.add_argument("id")
    p.add_argument("--reasoning", action="store_true", help=_REASONING_HELP)
    p.add_argument("--from", dest="from_seq", type=int, help="replay retained events from this seq")
    p.add_argument("--reconnect-secs", type=_reconnect_secs, metavar="SECS", help=_RECONNECT_HELP)
    p = add("ls", "list sessions")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the ids, one a line")
    _add_selection(p)
    p.add_argument("--sort", choices=SORT_KEYS, metavar="KEY",
                   help=f"order by KEY: {', '.join(SORT_KEYS)} (figures largest first)")
    p.add_argument("--limit", type=_page_size, metavar="N",
                   help=f"one page: at most N sessions (1-{LIST_PAGE_MAX}), ordered by id; the next page's "
                        "--after is printed on stderr (with --json: as \"next\")")
    p.add_argument("--after", type=_session_id, metavar="ID",
                   help="only sessions whose id sorts after ID (the page after the one that ended there)")
    add("status", "show one session").add_argument("id")
    for name, help_text in (
        ("interrupt", "interrupt the running turn"), ("stop", "stop a session's worker"),
        ("restart", "(re)start a session's worker"), ("rm", "delete a session and its state"),
    ):
        p = add(name, help_text)
        p.add_argument("id", nargs="?", help="the session; or select sessions with the options below")
        p.add_argument("--all", dest="every", action="store_true", help="every session you can see (`ls`)")
        _add_selection(p)
        p.add_argument("--dry-run", action="store_true", help="print what would be done, and do nothing")
    add("reload", "re-read the daemon's config file, as SIGHUP does (admins only): what changed, or why not")
    for name in ("approve", "deny"):
        p = add(name, f"{name} a pending permission request")
        p.add_argument("id")
        p.add_argument("request_id", nargs="?",
                       help="the request (`status ID` lists them); may be left out when exactly one waits")
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
    p = add("web", "serve the web console on 127.0.0.1 (prints its URL, with its token)")
    p.add_argument("--port", type=_port_number, default=0, help="the port (default: a free one)")
    p = add("completion", "print a shell completion script")
    p.add_argument("shell", choices=("bash", "zsh"))
    return parser


def _add_selection(p: argparse.ArgumentParser) -> None:
    """--state, --owner, --handler: each repeatable (any of the values), all
    together (every one must match)."""
    p.add_argument("--state", dest="states", action="append", default=[], choices=SESSION_STATES,
                   metavar="S", help=f"sessions in state S: {', '.join(SESSION_STATES)}")
    p.add_argument("--owner", dest="owners", action="append", default=[], type=_uid, metavar="UID",
                   help="sessions created by this uid (others' sessions are an admin's to see)")
    p.add_argument("--handler", dest="handlers", action="append", default=[], metavar="H",
                   help="sessions running handler H (agent, echo, package.module:factory)")


_REASONING_HELP = "also show the model's reasoning (dimmed, on stderr; with --json, as events)"


def _said(line: str) -> None:
    print(f"sessionctl: {line}", file=sys.stderr, flush=True)


def _reconnect_wait(args: argparse.Namespace) -> float:
    """--reconnect-secs, else $SESSIOND_RECONNECT_SECS, else the default;
    a bad value of the variable is said and the default used."""
    if getattr(args, "reconnect_secs", None) is not None:
        return float(args.reconnect_secs)
    text = os.environ.get(RECONNECT_SECS_ENV, "").strip()
    if not text:
        return RECONNECT_SECS
    try:
        return _reconnect_secs(text)
    except argparse.ArgumentTypeError as exc:
        print(f"sessionctl: ignoring ${RECONNECT_SECS_ENV}: {exc}", file=sys.stderr)
        return RECONNECT_SECS


async def _run(args: argparse.Namespace) -> int:
    client = await AsyncClient.connect(
        args.socket, client_name="sessionctl", reasoning=getattr(args, "reasoning", False),
        reconnect_secs=_reconnect_wait(args), on_reconnect=_said,
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
    traceparent = args.traceparent
    if traceparent is None:
        # As OpenTelemetry passes a trace to a child process: $TRACEPARENT.
        # One that is not valid is ignored (W3C Trace Context says so), and said.
        traceparent = os.environ.get("TRACEPARENT", "").strip()
        try:
            if traceparent:
                parse_traceparent(traceparent)
        except ValueError as exc:
            print(f"sessionctl: ignoring $TRACEPARENT: {exc}", file=sys.stderr)
            traceparent = ""
    else:
        try:
            parse_traceparent(traceparent)
        except ValueError as exc:
            print(f"sessionctl: --traceparent: {exc}", file=sys.stderr)
            return EXIT_USAGE
    return await send_interruptibly(client, args.id, args.text, as_json, traceparent)


async def _attach(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    # Ends when the session is deleted (0), the daemon is gone past the
    # reconnect wait (3) or comes back without the session (4).
    async for ev in client.attach(args.id, args.from_seq):
        if as_json:
            print(event_json(ev), flush=True)
        else:
            print_event(ev)
    return EXIT_OK


async def _ls(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    from supervisor.ctl.bulk import Selector, select, sort_sessions

    selector = Selector(args.states, args.owners, args.handlers)
    # The daemon selects; selecting again here keeps the answer right from
    # a daemon older than server-side selection.
    reply = await client.list_reply(states=selector.states, owners=selector.owners, handlers=selector.handlers,
                                    limit=args.limit or 0, after=args.after or "")
    sessions, after = select(reply.sessions, selector), reply.next
    loading = to_plain(reply.loading) if reply.loading is not None else None
    if args.sort:
        sessions = sort_sessions(sessions, args.sort, time.time())
    if args.quiet:
        for s in sessions:
            print(s.id)
    elif as_json:
        print(json.dumps({"sessions": to_plain(sessions), **({"next": after} if after else {}),
                          **({"loading": loading} if loading is not None else {})}))
    elif sessions:
        print_table(to_plain(sessions))
    else:
        print("no sessions loaded yet" if loading is not None else "no sessions")
    if after and not as_json:
        print(f"(more: sessionctl ls --limit {args.limit} --after {after})", file=sys.stderr)
    if loading is not None and not as_json:
        print(loading_text(loading), file=sys.stderr)
    return EXIT_OK


async def _status(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    info = await client.status(args.id)
    print(json.dumps(to_plain(info))) if as_json else print_status(to_plain(info))
    return EXIT_OK


async def _stats(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    stats = to_plain(await client.stats())
    del stats["id"]  # the request's number on the wire, not a figure
    print(json.dumps(stats)) if as_json else print_stats(stats)
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
    """interrupt, stop, restart, rm: of one session, one request, nothing to
    print but --json's ok; of a selection, supervisor.ctl.bulk."""
    from supervisor.ctl.bulk import Selector, run_bulk, usage_problem

    selector = Selector(args.states, args.owners, args.handlers)
    if problem := usage_problem(args.id is not None, args.every, selector):
        print(f"sessionctl {args.command}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.id is None:
        return await run_bulk(client, args.command, selector, args.dry_run, as_json)
    if args.dry_run:
        await client.status(args.id)  # exit 4 if there is no such session
        print(json.dumps({"dry_run": True, "would": [args.id]}) if as_json else f"would {args.command} {args.id}")
        return EXIT_OK
    action = {"interrupt": client.interrupt, "stop": client.stop,
              "restart": client.restart, "rm": client.remove}[args.command]
    await action(args.id)
    if as_json:
        print(json.dumps({"ok": True, "id": args.id}))
    return EXIT_OK


async def _reload(client: AsyncClient, args: argparse.Namespace, as_json: bool) -> int:
    reply = await client.reload()
    if as_json:
        data = to_plain(reply)
        del data["id"]
        print(json.dumps(data))
    elif reply.taken:
        print(f"reloaded {reply.source}: " + (f"{len(reply.changed)} change(s)" if reply.changed
                                              else "nothing changed"))
        for line in [*reply.changed, *reply.notes]:
            print(f"  {line}")
    else:
        print(f"sessionctl: reload refused, the running config kept: {reply.error}", file=sys.stderr)
    return EXIT_OK if reply.taken else EXIT_FAILED


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
    """approve, deny; without REQUEST_ID, the one request that waits."""
    if args.request_id is None:
        waiting = (await client.status(args.id)).waiting
        if len(waiting) != 1:
            listed = "".join(f"\n  {w.request_id}  {w.tool}" for w in waiting)
            print(f"sessionctl: session {args.id} has "
                  + (f"{len(waiting)} permission requests waiting: name one ({args.command} {args.id} "
                     f"REQUEST_ID):{listed}" if waiting else "no permission request waiting"), file=sys.stderr)
            return EXIT_USAGE if waiting else EXIT_FAILED
        args.request_id = waiting[0].request_id
        how = "allowing" if args.command == "approve" else "denying"
        print(f"sessionctl: {how} {waiting[0].tool} (request {args.request_id})", file=sys.stderr)
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
    "deny": _answer, "reload": _reload,
}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "web":  # serves until Ctrl-C, reconnecting to the daemon
        from supervisor.ctl.web.serve import run_web

        return run_web(args.socket, args.port, args.json)
    try:
        if args.command == "completion":  # no daemon needed
            from supervisor.ctl.completion import bash_script, this_program, zsh_script

            sys.stdout.write((bash_script if args.shell == "bash" else zsh_script)(parser, this_program()))
            sys.stdout.flush()
            return EXIT_OK
        return run_loop(_run(args))
    except (DaemonUnavailable, RequestError) as exc:
        return failed(exc)
    except KeyboardInterrupt:
        return EXIT_SIGINT
    except BrokenPipeError:  # `sessionctl send ... | head`: the turn goes on in the daemon
        return stdout_gone()


if __name__ == "__main__":
    sys.exit(main())
