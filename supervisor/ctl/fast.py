"""`sessionctl`'s entry point: the one-shot commands scripts run most
(`ls`, `status`, `ping`, `stats`, with or without `--json`) on a blocking
socket, and everything else through the full command line (supervisor.ctl.cli).

Why a second path: a one-shot command is mostly interpreter start-up.
The full path imports asyncio, uvloop, argparse, curses, msgspec and the
whole message schema before it says hello (`sessionctl --json ls` of 1,000
sessions took 200-260 ms, ~12 ms of it the listing; bench/README.md,
issue 12).  This path imports none of them: a blocking `_socket`, the
`msgpack` C decoder (msgspec alone costs ~40-60 ms to import, from its
typing machinery), and json.dumps's own C encoder taken from `_json`
without the `json` package (which imports `re`).

It must say exactly what the full path would, so it only answers what it
fully understands, and hands everything else to the full path, unchanged:
- a command line outside its small grammar (any other command or flag,
  `--help`, an abbreviation, `--`): supervisor.ctl.cli parses it;
- a reply it cannot vouch for (a tag, field type or value the schema
  does not allow, a frame it cannot decode, a reset): it asks again
  through the full path, whose output and exit code then are the full
  path's by construction.  Only read-only requests are answered here, so
  asking twice changes nothing.
What a reply holds is not written here: ipc/_wire_table.py, generated from
ipc.messages' Structs (`python -m ipc.wiregen`; tests/test_ctl_fast.py
fails when it is out of date), says it, and the checks are built from it.
"""

from __future__ import annotations

import _socket
import os
import sys
import time

import msgpack  # type: ignore[import-untyped]  # (no stubs; used for two calls)

from ipc import _wire_table as _wire
from ipc.paths import default_socket_text, socket_trust_problem
# The full path's own errors: an answer here fails as it would there.
from supervisor.ctl.errors import DaemonUnavailable as _Unavailable
from supervisor.ctl.errors import RequestError as _Refused
from supervisor.ctl.errors import Unsure as _Unsure
from supervisor.ctl.jsontext import json_text, python_json_text
from ipc.contract import LIST_PAGE_MAX, SESSION_STATES
from supervisor.ctl.link import CONNECT_TIMEOUT_SECS, MAX_REPLY_FRAME_BYTES, START_HINT
# (EXIT_UNREACHABLE and exit_code_for are render's, re-exported: both paths exit alike)
from supervisor.ctl.render import (
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_UNREACHABLE,
    exit_code_for,
    failed,
    loading_text,
    pong_text,
    print_stats,
    print_status,
    print_table,
    stdout_gone,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

__all__ = ["json_text", "main", "run"]


# The waits the full path allows, and its frame limit.
_CONNECT_TIMEOUT_SECS = CONNECT_TIMEOUT_SECS
_MAX_FRAME_BYTES = MAX_REPLY_FRAME_BYTES


# ---------------------------------------------------------------- command line

# command -> (fewest, most) positional arguments
_COMMANDS = {"ls": (0, 0), "status": (1, 1), "ping": (0, 1), "stats": (0, 0)}


class _Args:
    __slots__ = ("command", "as_json", "socket", "quiet", "id", "select")

    def __init__(self, command: str, as_json: bool, socket: str | None, quiet: bool,
                 id: str | None, select: dict[str, Any]) -> None:
        self.command = command
        self.as_json = as_json
        self.socket = socket
        self.quiet = quiet
        self.id = id
        # ls's selection and page, as the List request's fields.
        self.select = select


# ls's options with a value, as supervisor.ctl.cli defines them: the List
# field each fills, and whether it repeats.
_LS_OPTIONS = {"--state": ("states", True), "--owner": ("owners", True), "--handler": ("handlers", True),
               "--limit": ("limit", False), "--after": ("after", False)}
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


def _ls_value(option: str, text: str) -> object:
    """The value argparse would take for ls's `option`, or None where it
    would refuse it, or read it otherwise (left to the full path)."""
    if option == "--state":
        return text if text in SESSION_STATES else None
    if option == "--handler":
        return text
    if option == "--after":
        ok = 0 < len(text) <= 64 and text[0].isascii() and text[0].isalnum() and _ID_CHARS.issuperset(text)
        return text if ok else None
    if not (text.isascii() and text.isdigit()) or len(text) > 10:
        return None  # a sign, spaces, underscores: argparse's int() reads them; let it
    number = int(text)
    if option == "--owner":
        return number if number <= 2**32 - 1 else None
    return number if 1 <= number <= LIST_PAGE_MAX else None  # --limit


def _parse(argv: list[str]) -> _Args | None:
    """The command line, if it is one argparse would read the same way
    (supervisor.ctl.cli._parser); None for anything else."""
    command: str | None = None
    as_json = quiet = False
    socket: str | None = None
    positional: list[str] = []
    select: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--json":
            as_json = True
        elif arg == "--socket" and i < len(argv) and not argv[i].startswith("-"):
            socket = argv[i]
            i += 1
        elif arg.startswith("--socket="):
            socket = arg[len("--socket="):]
        elif arg in ("-q", "--quiet") and command == "ls":
            quiet = True
        elif arg in _LS_OPTIONS and command == "ls" and i < len(argv) and not argv[i].startswith("-"):
            field, repeats = _LS_OPTIONS[arg]
            value = _ls_value(arg, argv[i])
            i += 1
            if value is None:
                return None
            if repeats:
                select.setdefault(field, []).append(value)
            else:
                select[field] = value
        elif arg.startswith("-"):
            return None  # --help, --version, another flag, a negative number, "--"...
        elif command is None:
            if arg not in _COMMANDS:
                return None
            command = arg
        else:
            positional.append(arg)
    if command is None:
        return None
    fewest, most = _COMMANDS[command]
    if not fewest <= len(positional) <= most:
        return None
    return _Args(command, as_json, socket, quiet, positional[0] if positional else None, select)


def _socket_path(given: str | None) -> str:
    """As supervisor.ctl.client: `str(socket_path or default_socket_path())`.
    The default goes through pathlib there, which normalises it; a default
    that is not already in normal form is left to the full path."""
    if given:
        return given
    path = default_socket_text()
    if ("//" in path or "/./" in path or path.endswith(("/", "/.")) or path.startswith("./")
            or path == "."):
        raise _Unsure("a socket path pathlib would rewrite")
    return path


# ---------------------------------------------------------------- replies
#
# What each reply holds comes from ipc/_wire_table.py, generated from the
# msgspec Structs of ipc.messages (`python -m ipc.wiregen`): each Struct's
# fields in declared order (the order `--json` prints), with the kind of
# value and the default.  A field not on the wire takes its default, as
# msgspec decodes it (`list` and `dict` stand for a new empty one); an
# unknown field is ignored, as msgspec does.  The checks below are built
# from the kinds (their grammar: ipc/wiregen.py), once per kind.

_REQUIRED = _wire.REQUIRED
_PROTOCOL_VERSION = _wire.PROTOCOL_VERSION
_NEW_ERROR_CODES = _wire.NEW_ERROR_CODES
REPLIES = {tag: _wire.STRUCTS[tag] for tag in _wire.REPLIES}
NESTED = {tag: fields for tag, fields in _wire.STRUCTS.items() if tag not in REPLIES}
# The reply each command's request is answered with (besides an Error).
_EXPECT = {"ls": "sessions", "status": "status", "ping": "pong", "stats": "stats"}

_Fields = tuple[tuple[str, str, object], ...]


def _plain(raw: object, fields: _Fields, tag: str | None) -> dict[str, Any]:
    """A decoded map as `ctl.to_plain` shows the Struct msgspec would decode
    from it: every field, in order.  Raises _Unsure for whatever msgspec
    would reject (or might read differently)."""
    if type(raw) is not dict or (tag is not None and raw.get("type") != tag):
        raise _Unsure("not the struct expected")
    if any(type(k) is not str for k in raw):
        raise _Unsure("a field name that is not a str")
    out: dict[str, Any] = {}
    for name, kind, default in fields:
        value = raw.get(name, _REQUIRED)
        if value is _REQUIRED:
            if default is _REQUIRED:
                raise _Unsure(f"no {name}")
            out[name] = default() if default is list or default is dict else default
            continue
        out[name] = _checker(kind)(value)
    return out


_SCALARS: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}
_checkers: dict[str, Callable[[object], Any]] = {}


def _checker(kind: str) -> Callable[[object], Any]:
    """The check of a value of `kind`: returns the value as to_plain shows
    it (a nested Struct: a new dict), or raises _Unsure."""
    check = _checkers.get(kind)
    if check is None:
        check = _checkers[kind] = _build(kind)
    return check


def _build(kind: str) -> Callable[[object], Any]:
    if kind.endswith("?"):
        return lambda value: None if value is None else _checker(kind[:-1])(value)
    if kind in _SCALARS:
        t = _SCALARS[kind]

        def exact(value: object) -> Any:
            if type(value) is not t:  # no bool for int, no int for float
                raise _Unsure(f"not a {kind}")
            return value
        return exact
    if kind == "any":
        # msgspec's Any: whatever msgpack holds, as msgpack decodes it here.
        # Printed as JSON, json_text refuses what is not plain data; printed
        # as text (stats), _json_native does.
        return lambda value: value
    container, _, item = kind.partition("[")
    item = item[:-1].removeprefix("str,")
    if container == "list" and item in _wire.STRUCTS:
        return lambda value: _structs(value, item)
    if container in ("list", "dict"):
        return _container(kind, container == "dict", item)
    if kind in _wire.ENUMS:
        values = frozenset(_wire.ENUMS[kind])

        def member(value: object) -> Any:
            if type(value) is not str or value not in values:
                raise _Unsure(f"a {kind} msgspec would refuse")
            return value
        return member
    if kind in _wire.STRUCTS:
        return lambda value: _plain(value, _wire.STRUCTS[kind], kind)

    def unknown(value: object) -> Any:  # a table newer than this code
        raise _Unsure(f"a kind this path does not know: {kind}")
    return unknown


def _container(kind: str, is_dict: bool, item: str) -> Callable[[object], Any]:
    """A list, or a dict with str keys: the same one back if its items are
    scalars (of one type) or anything, else a new one of the items' checks."""
    t, scalar = (dict if is_dict else list), _SCALARS.get(item)

    def refuse() -> NoReturn:
        raise _Unsure(f"not a {kind}")

    def scalar_dict(value: Any) -> Any:
        if type(value) is not dict or any(type(k) is not str or type(v) is not scalar for k, v in value.items()):
            refuse()
        return value

    def scalar_list(value: Any) -> Any:
        if type(value) is not list or any(type(x) is not scalar for x in value):
            refuse()
        return value

    def other(value: Any) -> Any:
        if type(value) is not t or (is_dict and any(type(k) is not str for k in value)):
            refuse()
        if item == "any":
            return value
        check = _checker(item)
        return {k: check(v) for k, v in value.items()} if type(value) is dict else [check(x) for x in value]
    return other if scalar is None else scalar_dict if is_dict else scalar_list


def _json_native(value: object) -> bool:
    if type(value) is dict:
        return all(type(k) is str and _json_native(v) for k, v in value.items())
    if type(value) is list:
        return all(_json_native(x) for x in value)
    return type(value) in (str, int, float, bool) or value is None


# A list of Structs' fast lane (a listing of 1,000 sessions: the generic
# _plain took ~6 ms here, this ~2): defaults and wire fields merged by
# dict.update (which keeps the defaults' order), then the fields' types
# checked as one tuple against the combinations already seen to be allowed
# (None: any type), then what a type alone does not settle, field by field:
# `verify`, a list or dict of scalars (or of anything), which an empty one
# passes and whose check returns it as it is; `replace`, the rest (a nested
# Struct becomes a new dict; an enum is checked even when empty).  None the
# types settle, so each of those checks is its kind's without the "?".


def _shallow(kind: str) -> tuple[type, ...] | None:
    if kind.endswith("?"):
        inner = _shallow(kind[:-1])
        return None if inner is None else (*inner, type(None))
    if kind in _SCALARS or kind in _wire.ENUMS:
        return (_SCALARS.get(kind, str),)
    if kind.startswith(("list[", "dict[")) or kind in _wire.STRUCTS:
        return (list,) if kind.startswith("list[") else (dict,)
    return None  # any (an unknown kind: its check in `replace` refuses it)


class _Lane:
    __slots__ = ("defaults", "count", "shallow", "verify", "replace", "seen")

    def __init__(self, fields: _Fields) -> None:
        # Read only: the empty containers are shared by every item that omits them.
        self.defaults = {name: default() if default is list or default is dict else default
                         for name, _, default in fields}
        self.count = len(self.defaults)
        self.shallow = [_shallow(kind) for _, kind, _ in fields]
        self.verify: list[tuple[str, Callable[[object], Any]]] = []
        self.replace: list[tuple[str, Callable[[object], Any]]] = []
        self.seen: set[tuple[type, ...]] = set()
        for name, kind, _ in fields:
            kind = kind.rstrip("?")
            inner = kind[kind.find("[") + 1:-1].removeprefix("str,")
            if kind not in _SCALARS and kind != "any":
                same = kind.startswith(("list[", "dict[")) and (inner in _SCALARS or inner == "any")
                (self.verify if same else self.replace).append((name, _checker(kind)))


_lanes: dict[str, _Lane] = {}


def _structs(raws: object, tag: str) -> list[dict[str, Any]]:
    if type(raws) is not list:
        raise _Unsure("not a list")
    fields = _wire.STRUCTS[tag]
    lane = _lanes.get(tag) or _lanes.setdefault(tag, _Lane(fields))
    out = []
    defaults, count, seen, verify, replace = lane.defaults, lane.count, lane.seen, lane.verify, lane.replace
    for raw in raws:
        if type(raw) is not dict:
            raise _Unsure(f"not a {tag}")
        s = defaults.copy()
        s.update(raw)
        if s.pop("type", None) != tag or len(s) != count:
            out.append(_plain(raw, fields, tag))  # an unknown field: the long way
            continue
        signature = tuple(map(type, s.values()))
        if signature not in seen:
            if not all(allowed is None or t in allowed for t, allowed in zip(signature, lane.shallow)):
                raise _Unsure(f"a {tag} field of another type")
            seen.add(signature)
        for name, check in verify:
            value = s[name]
            if value:
                check(value)
        for name, check in replace:
            value = s[name]
            if value is not None:
                s[name] = check(value)
        out.append(s)
    return out


# ---------------------------------------------------------------- the exchange


class _Link:
    """One blocking connection, used as supervisor.ctl.client.AsyncClient uses
    one for a single request: hello (answered within 5 s), the request
    (answered when it is), replies matched by id, others dropped.

    Hello and the request go out in one write: the daemon handles a
    connection's frames in order and answers the request only after its
    Welcome, or refuses the hello and closes without reading further, which
    is what the full path sees too.  One round trip instead of two."""

    def __init__(self, path: str) -> None:
        self.path = path
        if len(os.fsencode(path)) >= 108:  # sun_path: the full path's error text differs
            raise _Unsure("socket path too long")
        if problem := socket_trust_problem(path):
            raise _Unavailable(f"refusing to connect to sessiond at {path}: {problem}")
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.settimeout(_CONNECT_TIMEOUT_SECS)
        try:
            sock.connect(path)
        except ValueError:  # a NUL in the path: the full path's words for it
            sock.close()
            raise _Unsure("an unusable socket path") from None
        except OSError as exc:
            sock.close()
            if isinstance(exc, BlockingIOError):
                raise _Unsure("connect would block") from None
            reason = exc.strerror if exc.strerror else "timed out"
            hint = START_HINT if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)) else ""
            raise _Unavailable(f"cannot connect to sessiond at {path}: {reason}{hint}") from None
        self.sock = sock
        self.buf = bytearray()

    def close(self) -> None:
        self.sock.close()

    def ask(self, request: dict[str, Any], expect: str) -> tuple[dict[str, Any], float]:
        """The reply to `request` and the milliseconds from sending it."""
        hello = _encode({"type": "hello", "protocol": _PROTOCOL_VERSION, "client": "sessionctl",
                         "error_codes": _NEW_ERROR_CODES})
        t0 = time.perf_counter()
        try:
            self.sock.sendall(hello + _encode(request))
        except OSError:
            pass  # a refusal may be waiting to be read: the full path reads it too
        deadline = time.monotonic() + _CONNECT_TIMEOUT_SECS
        try:
            self._answer(0, "welcome", deadline)
        except TimeoutError:
            raise _Unavailable(f"sessiond at {self.path} did not answer hello") from None
        self.sock.settimeout(None)  # as the full path: a request waits as long as it takes
        reply = self._answer(request["id"], expect, None)
        return reply, (time.perf_counter() - t0) * 1000

    def _answer(self, req_id: int, expect: str, deadline: float | None) -> dict[str, Any]:
        """The reply to `req_id`; as AsyncClient._dispatch, replies to other
        ids are dropped.  Raises _Refused for an Error, _Unavailable at EOF."""
        while True:
            raw = self._frame(deadline)
            tag = raw.get("type") if type(raw) is dict else None
            if tag not in ("welcome", "error", expect):
                raise _Unsure(f"a {tag!r} frame")
            reply = _plain(raw, REPLIES[tag], None)
            rid = 0 if tag == "welcome" else reply["id"]
            if rid != req_id:
                continue
            if tag == "error":
                raise _Refused(reply["code"], reply["message"])
            if tag != expect:
                raise _Unsure("a reply of another kind")  # the full path's "unexpected reply"
            return reply

    def _frame(self, deadline: float | None) -> Any:
        length = int.from_bytes(self._read(4, deadline), "big")
        if length > _MAX_FRAME_BYTES:
            raise _Unsure("frame too large")
        try:
            return msgpack.unpackb(self._read(length, deadline), raw=False)
        except Exception as exc:
            raise _Unsure(f"undecodable frame: {exc}") from None

    def _read(self, n: int, deadline: float | None) -> bytearray:
        """n bytes: those left over from the last recv first, the rest read
        straight into place (a listing is ~200 KB)."""
        buf, self.buf = self.buf, bytearray()
        if len(buf) >= n:
            self.buf = buf[n:]
            del buf[n:]
            return buf
        have = len(buf)
        buf.extend(bytes(n - have))
        with memoryview(buf) as view:
            while have < n:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    self.sock.settimeout(left)
                try:
                    got = self.sock.recv_into(view[have:])
                except TimeoutError:
                    raise
                except OSError as exc:
                    raise _Unsure(f"recv: {exc}") from None
                if not got:
                    raise _Unavailable("connection to sessiond lost")
                have += got
        return buf


def _encode(msg: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(msg)
    return len(body).to_bytes(4, "big") + body


# ---------------------------------------------------------------- commands


def _run(args: _Args) -> int:
    """Print what supervisor.ctl.cli would print, and return its exit code."""
    request: dict[str, Any] = {"type": args.command, "id": 1, **args.select}
    if args.id is not None:
        request["session"] = args.id
    link = _Link(_socket_path(args.socket))
    try:
        reply, rtt_ms = link.ask(request, _EXPECT[args.command])
    finally:
        link.close()
    as_json = args.as_json
    # Everything below is decided before anything is printed: _Unsure
    # after a line has gone out would make the full path print it twice.
    match args.command:
        case "ls":
            sessions = reply["sessions"]
            after = reply["next"]
            if any(not _selected(s, args.select) for s in sessions):
                raise _Unsure("a daemon that does not select: the full path selects again")
            more = f"(more: sessionctl ls --limit {args.select['limit']} --after {after})\n" if after else ""
            loading = reply["loading"]
            if loading is not None:
                loading.pop("type", None)
                more += loading_text(loading) + "\n"
            if args.quiet:
                text = "".join(f"{s['id']}\n" for s in sessions)
            elif as_json:
                text = json_text({"sessions": sessions, **({"next": after} if after else {}),
                                  **({"loading": loading} if loading is not None else {})}) + "\n"
                more = ""
            elif sessions:
                print_table(sessions)
                sys.stderr.write(more)
                return EXIT_OK
            else:
                text = "no sessions loaded yet\n" if loading is not None else "no sessions\n"
            sys.stdout.write(text)
            sys.stderr.write(more)
            return EXIT_OK
        case "status":
            if not as_json:
                print_status(reply["session"])
                return EXIT_OK
            text = json_text(reply["session"]) + "\n"
        case "stats":
            if not as_json:
                if not _json_native(reply["sandbox"]) or not _json_native(reply.get("tracing", {})):
                    raise _Unsure("sandbox or tracing: not plain data")
                print_stats(reply)
                return EXIT_OK
            del reply["id"]  # the request's number on the wire, not a figure (as the full path)
            text = json_text(reply) + "\n"
        case _:  # ping
            if as_json:
                text = json_text({"pid": reply["pid"], "session": reply["session"],
                                  "rtt_ms": round(rtt_ms, 3)}) + "\n"
            else:
                text = pong_text(reply["session"], reply["pid"], rtt_ms) + "\n"
    sys.stdout.write(text)
    return EXIT_OK


def _selected(session: dict[str, Any], select: dict[str, Any]) -> bool:
    """Whether `session` is one the selection asked for (as ctl.bulk.Selector)."""
    return ((not select.get("states") or session["state"] in select["states"])
            and (not select.get("owners") or session["owner_uid"] in select["owners"])
            and (not select.get("handlers") or session["handler"] in select["handlers"]))


def main(argv: list[str] | None = None) -> int:
    """sessionctl: the one-shot path if it answers, else the full one."""
    if argv is None:
        argv = sys.argv[1:]
    code = _one_shot(argv)
    if code is not None:
        return code
    from supervisor.ctl import cli as ctl

    return ctl.main(argv)


def run() -> NoReturn:
    """The `sessionctl` console script.  After a one-shot answer the
    process ends without the interpreter's tear-down (freeing the ~100,000
    objects of a listing of 1,000 one by one: 3-10 ms here); there is
    nothing else to finish: no threads, no atexit work, the socket closed."""
    argv = sys.argv[1:]
    code = _one_shot(argv)
    if code is None:
        from supervisor.ctl import cli as ctl

        sys.exit(ctl.main(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _one_shot(argv: list[str]) -> int | None:
    """The exit code, once the answer is printed; None: not answered here
    (and nothing printed)."""
    args = _parse(argv)
    if args is None:
        return None
    try:
        return _run(args)
    except (_Unavailable, _Refused) as exc:
        return failed(exc)
    except _Unsure:
        return None
    except KeyboardInterrupt:
        return EXIT_SIGINT
    except BrokenPipeError:  # `sessionctl ls | head`
        return stdout_gone()


if __name__ == "__main__":
    run()
