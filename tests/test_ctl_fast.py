"""sessionctl's one-shot path (supervisor/ctl/fast.py) says exactly what the
full command line (supervisor/ctl/cli.py) says: the same bytes on stdout and
stderr and the same exit code, for every command it answers and for the
errors (no daemon, no such session, refused, a reply it cannot vouch for);
it imports neither asyncio nor msgspec; and its copies of the schema, the
command line and json.dumps agree with the originals."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import Daemon, env_for_children, wait_for
from ipc import messages as m
from ipc.wirebase import Msg
from ipc.framing import encode_frame
from supervisor.ctl import cli as ctl, fast as ctl_fast

# ---------------------------------------------------------------- pure: the copies agree

_KINDS: dict[str, Any] = {
    "str": str, "int": int, "float": float, "str?": str | None, "int?": int | None, "float?": float | None,
    "list[str]": list[str], "dict[str,int]": dict[str, int], "dict[str,any]": dict[str, Any],
    "exit?": m.ExitInfo | None, "error_code": m.ErrorCode, "session": m.SessionInfo,
    "list[session]": list[m.SessionInfo], "list[waiting]": list[m.Waiting], "loading?": m.Loading | None,
}


def _fields(table: tuple[tuple[str, str, object], ...]) -> list[tuple[str, Any, object]]:
    out = []
    for name, kind, default in table:
        if default is ctl_fast._REQUIRED:
            default = msgspec.NODEFAULT
        elif default is list or default is dict:
            default = default()
        out.append((name, _KINDS[kind], default))
    return out


def _struct_fields(cls: type) -> list[tuple[str, Any, object]]:
    out = []
    for f in msgspec.structs.fields(cls):
        default = f.default if f.default is not msgspec.NODEFAULT else (
            f.default_factory() if f.default_factory is not msgspec.NODEFAULT else msgspec.NODEFAULT)
        out.append((f.name, f.type, default))
    return out


@pytest.mark.pure
@pytest.mark.parametrize("tag, cls", [
    ("welcome", m.Welcome), ("error", m.Error), ("sessions", m.SessionList),
    ("status", m.StatusReply), ("pong", m.Pong), ("stats", m.StatsReply),
    ("session", m.SessionInfo), ("exit", m.ExitInfo), ("waiting", m.Waiting), ("loading", m.Loading),
])
def test_the_schema_copy_matches_ipc_messages(tag: str, cls: type) -> None:
    table = ctl_fast.NESTED[tag] if tag in ctl_fast.NESTED else ctl_fast.REPLIES[tag]
    assert cls.__struct_config__.tag == tag  # type: ignore[attr-defined]
    assert _fields(table) == _struct_fields(cls)


@pytest.mark.pure
def test_the_checked_in_wire_table_is_what_ipc_messages_generates() -> None:
    # One description of the schema: the Structs.  A field added to one
    # reaches the one-shot path by `python -m ipc.wiregen`, and only so.
    from ipc import wiregen

    assert wiregen.TABLE_PATH.read_text() == wiregen.render(), \
        "ipc/_wire_table.py is out of date: run `python -m ipc.wiregen`"


class _Later(Msg, tag="later"):  # a reply as a later protocol might have it
    id: int
    infos: list[m.ExitInfo] = []
    by_name: dict[str, m.SessionInfo] = {}
    code: m.ErrorCode | None = None
    ok: bool = False


@pytest.mark.pure
def test_a_new_field_reaches_the_one_shot_path_from_its_struct_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import msgspec.inspect as mi

    from ipc import wiregen

    walk = wiregen._Walk()
    walk.struct(mi.type_info(_Later))  # type: ignore[arg-type]
    kinds = {name: kind for name, kind, _ in walk.structs["later"]}
    assert kinds == {"id": "int", "infos": "list[exit]", "by_name": "dict[str,session]",
                     "code": "error_code?", "ok": "bool"}
    structs = {tag: tuple((n, k, eval(d, {"REQUIRED": ctl_fast._REQUIRED}))  # noqa: S307 (our own text)
                          for n, k, d in fields) for tag, fields in walk.structs.items()}
    monkeypatch.setattr(ctl_fast._wire, "STRUCTS", structs)
    monkeypatch.setattr(ctl_fast, "_checkers", {})
    monkeypatch.setattr(ctl_fast, "_lanes", {})
    later = _Later(id=3, infos=[m.ExitInfo(reason="crashed", signal=9)],
                   by_name={"a": _SESSIONS[1]}, code=m.ErrorCode.NO_SPACE, ok=True)
    for value in (later, _Later(id=4)):
        raw = msgpack.unpackb(msgspec.msgpack.encode(value))
        assert ctl_fast._plain(raw, structs["later"], "later") == ctl.to_plain(value)
        assert ctl_fast._structs([raw, raw], "later") == ctl.to_plain([value, value])
    for bad in ({"ok": 1}, {"code": "no_such_code"}, {"infos": [{"type": "exit"}]},
                {"by_name": {"a": {"type": "session", "id": "x"}}}):
        raw = msgpack.unpackb(msgspec.msgpack.encode(later))
        raw.update(bad)
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgpack.packb(raw), type=_Later)
        with pytest.raises(ctl_fast._Unsure):
            ctl_fast._structs([raw], "later")


@pytest.mark.pure
def test_the_generator_refuses_a_field_the_one_shot_path_could_not_check() -> None:
    import msgspec.inspect as mi

    from ipc import wiregen

    class Bounded(Msg, tag="bounded"):
        n: Annotated[int, msgspec.Meta(ge=0)] = 0

    class Tupled(Msg, tag="tupled"):
        pair: tuple[int, int] = (0, 0)

    for cls, words in ((Bounded, "Bounded.n: a constraint (ge)"), (Tupled, "Tupled.pair: no kind")):
        with pytest.raises(wiregen.UnsupportedField, match=re.escape(words)):
            wiregen._Walk().struct(mi.type_info(cls))  # type: ignore[arg-type]


@pytest.mark.pure
def test_the_protocol_constants_match_ipc_messages() -> None:
    assert ctl_fast._PROTOCOL_VERSION == m.PROTOCOL_VERSION
    assert ctl_fast._NEW_ERROR_CODES == sorted(m.NEW_ERROR_CODES)
    assert set(ctl_fast._wire.ENUMS["error_code"]) == {c.value for c in m.ErrorCode}
    assert set(ctl_fast._EXPECT.values()) == {"sessions", "status", "pong", "stats"}


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@pytest.mark.pure
@settings(max_examples=120, deadline=None)
@given(_json_values)
def test_json_text_is_json_dumps(value: Any) -> None:
    assert ctl_fast.json_text(value) == json.dumps(value)
    assert ctl_fast.python_json_text(value) == json.dumps(value)


@pytest.mark.pure
@pytest.mark.parametrize("bad", [b"bytes", {"k": b"v"}, {"s": {1, 2}}, [msgpack.ExtType(1, b"")]])
def test_json_text_leaves_what_is_not_plain_data_to_the_full_path(bad: Any) -> None:
    for write in (ctl_fast.json_text, ctl_fast.python_json_text):
        with pytest.raises(ctl_fast._Unsure):
            write(bad)


_ACCEPTED = [
    ["ls"], ["--json", "ls"], ["ls", "--json"], ["ls", "-q"], ["ls", "--quiet", "--json"],
    ["--socket", "/x.sock", "ls"], ["--socket=/x.sock", "status", "abc"], ["status", "abc", "--json"],
    ["ping"], ["ping", "abc"], ["--json", "ping", "--socket", "/y", "abc"], ["stats"],
    ["--socket", "/a", "stats", "--socket", "/b"], ["status", ""],
    ["ls", "--state", "idle", "--owner", "1000", "--owner", "7", "--handler", "echo", "--json"],
    ["ls", "--limit", "2", "--after", "abc", "-q"], ["ls", "--limit", "10000"], ["ls", "--state", "damaged"],
    ["ls", "--handler", "pkg.mod:make"], ["ls", "--owner", "4294967295"],
]
_REJECTED = [
    [], ["--help"], ["ls", "--help"], ["--version"], ["--js", "ls"], ["-q", "ls"], ["ls", "x"],
    ["status"], ["status", "a", "b"], ["ping", "a", "b"], ["status", "-1"], ["status", "--", "x"],
    ["create"], ["send", "a", "b"], ["top", "--once"], ["--socket", "ls"], ["--socket", "-x", "ls"],
    ["stats", "-q"], ["ls", "-qq"], ["nosuchcommand"],
    ["ls", "--state", "bogus"], ["ls", "--limit", "0"], ["ls", "--limit", "10001"], ["ls", "--limit", "+3"],
    ["ls", "--limit", " 3"], ["ls", "--owner", "-1"], ["ls", "--owner", "4294967296"], ["ls", "--after", "-x"],
    ["ls", "--after", "bad/id"], ["ls", "--after", "_x"], ["status", "x", "--limit", "3"], ["ls", "--limit"],
    ["ls", "--state=idle"], ["ls", "--sort", "id"],
]


@pytest.mark.pure
@pytest.mark.parametrize("argv", _ACCEPTED)
def test_a_command_line_it_takes_reads_as_argparse_reads_it(argv: list[str]) -> None:
    fast = ctl_fast._parse(argv)
    assert fast is not None
    full = ctl._parser().parse_args(argv)
    assert (fast.command, fast.as_json, fast.socket, fast.quiet, fast.id) == (
        full.command, full.json, full.socket, getattr(full, "quiet", False), getattr(full, "id", None))
    # ls's selection and page, as the List request's fields.
    chosen = {"states": getattr(full, "states", []), "owners": getattr(full, "owners", []),
              "handlers": getattr(full, "handlers", []), "limit": getattr(full, "limit", None),
              "after": getattr(full, "after", None)}
    asked = {k: v for k, v in chosen.items() if v}
    assert fast.select == asked


@pytest.mark.pure
@pytest.mark.parametrize("argv", _REJECTED)
def test_any_other_command_line_goes_to_argparse(argv: list[str]) -> None:
    assert ctl_fast._parse(argv) is None


def _session(**kw: Any) -> m.SessionInfo:
    base: dict[str, Any] = {"id": "s1", "state": "idle", "handler": "echo"}
    base.update(kw)
    return m.SessionInfo(**base)


_SESSIONS = [
    _session(),
    _session(id="s2", pid=12, rss_bytes=3 << 20, restarts=2, turns=5, created_at=1.5, seq=9,
             parent="s1", children=["c1", "c2"], owner_uid=1000, error="bad\nline", usage={"a": 1},
             sandbox={"active": ["landlock"], "inactive": {"x": "why"}, "n": [1, 2.5, None, True]},
             node="10.0.0.7", last_exit=m.ExitInfo(reason="crashed", signal=9, at=2.0, detail="é"),
             budget={"spent": {"llm_calls": 3}, "turn": {}, "ceilings": [
                 {"ceiling": "agent.budget.turn_max_llm_calls", "used": 3, "limit": 4, "unit": "LLM calls"}]}),
    _session(id="s3", last_exit=m.ExitInfo(reason="exited", code=0)),
]


@pytest.mark.pure
@pytest.mark.parametrize("info", _SESSIONS, ids=["defaults", "every-field", "exit"])
def test_a_session_decodes_to_what_to_plain_shows(info: m.SessionInfo) -> None:
    wire = msgpack.unpackb(msgspec.msgpack.encode(m.SessionList(id=1, sessions=[info, info])))
    assert ctl_fast._plain(wire, ctl_fast.REPLIES["sessions"], "sessions")["sessions"] == \
        ctl.to_plain([info, info])
    # An unknown field (a newer daemon) is ignored, as msgspec ignores it.
    one = msgpack.unpackb(msgspec.msgpack.encode(info))
    one["later_field"] = [1]
    assert ctl_fast._structs([one], "session") == [ctl.to_plain(info)]


@pytest.mark.pure
@pytest.mark.parametrize("change", [
    {"pid": True}, {"pid": 1.0}, {"created_at": 1}, {"id": None}, {"children": [1]},
    {"usage": {"a": "1"}}, {"sandbox": {b"k": 1}}, {"last_exit": {"type": "exit"}},
    {"last_exit": {"type": "other", "reason": "x"}}, {"type": "other"}, {"state": b"idle"},
], ids=lambda c: repr(c))
def test_a_session_msgspec_would_refuse_is_not_vouched_for(change: dict[str, Any]) -> None:
    raw = msgpack.unpackb(msgspec.msgpack.encode(_SESSIONS[1]))
    raw.update(change)
    with pytest.raises(ctl_fast._Unsure):
        ctl_fast._structs([raw], "session")
    missing = msgpack.unpackb(msgspec.msgpack.encode(_SESSIONS[0]))
    del missing["handler"]
    with pytest.raises(ctl_fast._Unsure):
        ctl_fast._structs([missing], "session")


@pytest.mark.pure
def test_the_default_socket_path_is_the_full_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    from ipc.paths import default_socket_path

    for env in ("/run/x.sock", "rel/x.sock"):
        monkeypatch.setenv("SESSIOND_SOCKET", env)
        assert ctl_fast._socket_path(None) == str(default_socket_path())
    for odd in ("/run//x.sock", "/run/./x.sock", "./x.sock", "/run/x/"):
        monkeypatch.setenv("SESSIOND_SOCKET", odd)
        with pytest.raises(ctl_fast._Unsure):  # pathlib would print it otherwise
            ctl_fast._socket_path(None)
    assert ctl_fast._socket_path("/given//as.is") == "/given//as.is"


# ---------------------------------------------------------------- process: side by side

# Run the one-shot path in a process that then says, through its exit
# status, whether it stayed one-shot (99: it imported asyncio, i.e. it fell
# back): the comparison must be between the two paths, not the full path twice.
_FAST = """
import os, sys
from supervisor.ctl import fast as ctl_fast
code = ctl_fast.main(sys.argv[1:])
sys.stdout.flush(); sys.stderr.flush()
heavy = [n for n in ("asyncio", "msgspec", "argparse", "supervisor.ctl.cli") if n in sys.modules]
os._exit(99 if heavy and os.environ.get("CTL_FAST_MUST_STAY") else code)
"""


def _run(argv: list[str], fast: bool, must_stay: bool = True,
         **kw: Any) -> subprocess.CompletedProcess[str]:
    env = env_for_children()
    env.pop("SESSIOND_SOCKET", None)
    if must_stay:
        env["CTL_FAST_MUST_STAY"] = "1"
    cmd = [sys.executable, "-c", _FAST] if fast else [sys.executable, "-m", "supervisor.ctl"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, env=env, timeout=30, **kw)


_AGES = re.compile(r"(?<=\s)\d+[smhd](?=\s)")


def _same(argv: list[str], must_stay: bool = True, mask: str | None = None, **kw: Any) -> str:
    """Both paths' (exit code, stdout, stderr), equal; `mask`: what differs
    from run to run by nature (round-trip times).  The daemon's figures
    may also move between the two runs (a session's RSS from the memory
    sweep): a few tries, until a pair of runs saw the same state.  Ages
    (`ls`'s AGE column, `17s`) move by nature between two runs that take
    a second on a busy machine: they are masked."""
    for _ in range(5):
        fast, full = _run(argv, True, must_stay, **kw), _run(argv, False, **kw)
        seen = [(r.returncode, _AGES.sub("AGE", re.sub(mask, "X", r.stdout) if mask else r.stdout), r.stderr)
                for r in (fast, full)]
        if seen[0] == seen[1]:
            return fast.stdout
    assert seen[0] == seen[1], argv
    return fast.stdout


@pytest.mark.process
def test_each_command_prints_what_the_full_path_prints(daemon: Daemon) -> None:
    sock = ["--socket", str(daemon.socket)]
    assert _same([*sock, "ls"]) == "no sessions\n"
    assert _same([*sock, "--json", "ls"]) == '{"sessions": []}\n'
    with daemon.client() as c:
        parent = c.create(session="parent", handler="echo").id
        c.send_text(parent, "hello")
        c.create(session="stopped", handler="echo")
        c.stop("stopped")
    # Memory figures move between two asks (the sweep measures again, the
    # daemon's own RSS grows by a page): masked, nothing else.
    rss = r"\"(rss|disk)_bytes\": (\d+|null)|\d+(\.\d)?(B|KiB|MiB|GiB)|(?<=disk:      )-"
    for argv in (["ls"], ["--json", "ls"], ["ls", "-q"], ["ls", "--quiet", "--json"],
                 ["status", parent], ["status", parent, "--json"], ["--json", "status", "stopped"],
                 ["status", "stopped"]):
        assert _same([*sock, *argv], mask=rss), argv
    listed = json.loads(_same([*sock, "--json", "ls"], mask=rss))
    assert [s["id"] for s in listed["sessions"]] == ["parent", "stopped"]
    # Selected and paged by the daemon: the same words on both paths.
    for argv in (["ls", "--state", "stopped"], ["--json", "ls", "--handler", "echo", "--owner", "0"],
                 ["ls", "--limit", "1"], ["--json", "ls", "--limit", "1"], ["ls", "-q", "--limit", "1"],
                 ["ls", "--limit", "1", "--after", "parent"], ["--json", "ls", "--state", "deleted"]):
        assert _same([*sock, *argv], mask=rss), argv
    page = json.loads(_same([*sock, "--json", "ls", "--limit", "1"], mask=rss))
    assert [s["id"] for s in page["sessions"]] == ["parent"] and page["next"] == "parent"
    rest = json.loads(_same([*sock, "--json", "ls", "--limit", "1", "--after", "parent"], mask=rss))
    assert [s["id"] for s in rest["sessions"]] == ["stopped"] and "next" not in rest
    assert _run([*sock, "ls", "--limit", "1"], True).stderr == "(more: sessionctl ls --limit 1 --after parent)\n"
    assert _same([*sock, "--json", "ls", "--state", "stopped"], mask=rss).count('"id"') == 1
    assert listed["sessions"][1]["last_exit"]["reason"] == "stopped"
    # Round-trip times and the uptime differ from run to run, nothing else.
    rtt = r"\d+\.\d+ ms|\"rtt_ms\": [\d.e-]+"
    for argv in (["ping"], ["--json", "ping"], ["ping", parent], ["--json", "ping", parent]):
        assert _same([*sock, *argv], mask=rtt)
    uptime = r"up \d+s|\"uptime_secs\": [\d.e-]+|" + rss
    assert _same([*sock, "stats"], mask=uptime).startswith("sessiond ")
    assert json.loads(_same([*sock, "--json", "stats"], mask=uptime))["sessions"] == 2


@pytest.mark.process
def test_errors_and_exit_codes_are_the_full_paths(daemon: Daemon, tmp_path: Path) -> None:
    sock = ["--socket", str(daemon.socket)]
    for argv in (["status", "nosuch"], ["--json", "status", "nosuch"], ["ping", "nosuch"],
                 ["status", "../bad id"]):
        _same([*sock, *argv])
    assert _run([*sock, "status", "nosuch"], True).returncode == 4
    # No daemon there: exit 3, the same words.
    gone = ["--socket", str(tmp_path / "none.sock")]
    _same([*gone, "ls"])
    assert "cannot connect" in _run([*gone, "--json", "ls"], True).stderr
    # A socket nobody accepts on.
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / "dead.sock"))
    dead.close()
    _same(["--socket", str(tmp_path / "dead.sock"), "ping"])
    # Anything else is the full path's, whole: --help, other commands.
    _same([*sock, "ls", "--help"], must_stay=False)
    _same([*sock, "stats", "-q"], must_stay=False)


def _read_frames(conn: socket.socket, count: int) -> None:
    buf = b""
    while True:
        pos, seen = 0, 0
        while len(buf) - pos >= 4:
            end = pos + 4 + int.from_bytes(buf[pos:pos + 4], "big")
            if end > len(buf):
                break
            pos, seen = end, seen + 1
        if seen >= count:
            return
        chunk = conn.recv(1 << 16)
        if not chunk:
            return
        buf += chunk


class _OddDaemon:
    """A socket that says hello and then answers every request with
    `reply` (bytes of one frame, or several), for replies no real daemon
    sends."""

    def __init__(self, path: Path, reply: bytes, greeting: bytes | None = None) -> None:
        self.reply = reply
        self.greeting = greeting
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                if self.greeting is not None:  # as a refusal: before reading anything
                    conn.sendall(self.greeting)
                    continue
                try:
                    conn.sendall(encode_frame(m.Welcome(protocol=1, server_version="odd", pid=7)))
                    _read_frames(conn, 2)  # hello and the request: the reply answers it
                    conn.sendall(self.reply)
                    conn.shutdown(socket.SHUT_WR)
                    while conn.recv(1 << 16):
                        pass
                except OSError:
                    pass

    def close(self) -> None:
        # A close alone does not wake the thread's accept(); a shutdown does
        # (and the thread must be gone: later tests fork, and check that
        # this process has no thread).
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the odd daemon's thread did not end"


@pytest.mark.process
@pytest.mark.parametrize("reply", [
    encode_frame(m.Ok(id=1)),  # another kind of reply: "unexpected reply Ok"
    b"\x00\x00\x00\x03\xc1\xc1\xc1",  # undecodable
    encode_frame({"type": "sessions", "id": 1, "sessions": [{"type": "session", "id": 5}]}),
    encode_frame({"type": "error", "id": 1, "code": "some_new_code", "message": "?"}),
    encode_frame({"type": "error", "id": 1, "code": "permission_denied", "message": "no."}),
    encode_frame({"type": "error", "id": 1, "code": "not_found", "message": "no such"}),
    encode_frame(m.Ok(id=5)),  # a reply to no request: dropped, then the end
    b"",  # the daemon goes away
    b"\x00\x00\x01\x00partial",
], ids=["other-kind", "undecodable", "bad-field", "unknown-code", "refused", "not-found",
        "stray", "eof", "partial"])
def test_a_reply_it_cannot_vouch_for_is_the_full_paths(tmp_path: Path, reply: bytes) -> None:
    odd = _OddDaemon(tmp_path / "odd.sock", reply)
    try:
        for argv in (["ls"], ["--json", "ls"]):
            _same(["--socket", str(tmp_path / "odd.sock"), *argv], must_stay=False)
    finally:
        odd.close()


@pytest.mark.process
@pytest.mark.parametrize("code", ["permission_denied", "capacity", "protocol_mismatch"])
def test_a_refusal_before_hello_is_the_full_paths(tmp_path: Path, code: str) -> None:
    refusal = encode_frame(m.Error(code=m.ErrorCode(code), message=f"refused: {code}"))
    odd = _OddDaemon(tmp_path / "odd.sock", b"", greeting=refusal)
    try:
        for argv in (["ls"], ["--json", "status", "x"], ["ping"]):
            _same(["--socket", str(tmp_path / "odd.sock"), *argv])
        r = _run(["--socket", str(tmp_path / "odd.sock"), "ls"], True)
        assert (r.returncode, r.stderr) == (1, f"sessionctl: refused: {code}\n")
    finally:
        odd.close()


@pytest.mark.process
def test_the_one_shot_module_imports_no_asyncio_msgspec_or_argparse() -> None:
    code = ("import sys, supervisor.ctl.fast; print(' '.join(n for n in ('asyncio', 'msgspec', "
            "'argparse', 'curses', 'uvloop', 'json', 'supervisor.ctl.cli', 'supervisor.ctl.client') "
            "if n in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env_for_children(), timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr


@pytest.mark.process
def test_the_console_script_answers_and_exits_as_the_full_path(daemon: Daemon) -> None:
    # run(): the one-shot answer, then os._exit with its code, output flushed.
    with daemon.client() as c:
        c.create(session="one", handler="echo")
        # Its workspace's first walk (max_disk_mb), so that both asks see one figure.
        wait_for(lambda: c.status("one").disk_bytes is not None, 10, "the workspace's first walk")
    env = env_for_children()
    script = "from supervisor.ctl.fast import run; run()"
    for argv, code in ((["--json", "ls"], 0), (["status", "one"], 0), (["status", "nosuch"], 4)):
        argv = ["--socket", str(daemon.socket), *argv]
        for _ in range(5):  # as _same: the session's RSS may move between the two asks
            fast = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                                  env=env, timeout=30)
            full = _run(argv, False)
            if (fast.returncode, fast.stdout, fast.stderr) == (code, full.stdout, full.stderr):
                break
        assert (fast.returncode, fast.stdout, fast.stderr) == (code, full.stdout, full.stderr)
        assert ("one" in fast.stdout) == (code == 0)
    # And what it does not answer goes through the full path, exit code included.
    r = subprocess.run([sys.executable, "-c", script, "--socket", str(daemon.socket), "create",
                        "--id", "../x"], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 2 and "invalid session id" in r.stderr


@pytest.mark.process
def test_sessionctl_is_the_one_shot_entry_point() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "sessionctl"]
    assert ep.value == "supervisor.ctl.fast:run"


# ---------------------------------------------------------------- pure: one table of exit codes


@pytest.mark.pure
def test_every_exit_code_comes_from_the_one_table() -> None:
    # supervisor.ctl.render.EXIT_CODES is the contract: both paths and every
    # command return its names, never a number of their own, and --help
    # lists the table itself.
    import ast

    from supervisor.ctl import render

    literal = []
    for path in sorted(Path(render.__file__).parent.glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    isinstance(fn.returns, ast.Name) and fn.returns.id == "int":
                literal += [f"{path.name}:{node.lineno}" for node in ast.walk(fn)
                            if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant)]
    assert literal == []
    assert ctl._EPILOG.endswith("exit codes:\n" + render.exit_codes_text())
    assert [code for code, _ in render.EXIT_CODES] == [0, 1, 2, 3, 4]
    assert (ctl_fast.EXIT_OK, ctl_fast.EXIT_UNREACHABLE, ctl_fast.EXIT_SIGINT, ctl_fast.exit_code_for) == \
        (render.EXIT_OK, render.EXIT_UNREACHABLE, render.EXIT_SIGINT, render.exit_code_for)


@pytest.mark.pure
def test_every_command_of_the_parser_has_its_function() -> None:
    # The full path dispatches through one table: a command added to the
    # parser without its function would fail only when someone runs it.
    import argparse

    (sub,) = [a for a in ctl._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    # (completion and web: main() runs them without a daemon connection first.)
    assert set(sub.choices) == set(ctl._COMMANDS) | {"completion", "web"}
