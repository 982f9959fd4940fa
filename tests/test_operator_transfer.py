"""`sessionctl history`, `logs`, `export` and `import` against real daemons:
a conversation with tool calls and an aborted turn moves between two
daemons intact, an export is hostile input on import, and the lifecycle
log says what happened and why."""

from __future__ import annotations

import base64
import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fakellm import FakeLLM, Reply, text_stream, tool_call_stream
from harness import FAST_SWEEP, Daemon, env_for_children, wait_for
from ipc import messages as m
from ipc import operator as op
from test_agent_e2e import agent_config

pytestmark = pytest.mark.process


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test-secret-123")


def ctl_json(d: Daemon, *args: str) -> dict:
    done = d.ctl("--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def comparable(turns: list[dict]) -> list[dict]:
    return [{k: v for k, v in t.items() if k != "at"} for t in turns]


def test_history_export_import_round_trip_with_tool_calls_and_an_aborted_turn(
        make_daemon, llm: FakeLLM, tmp_path: Path) -> None:
    a = make_daemon(agent_config(llm))
    b = make_daemon(agent_config(llm))
    llm.script(
        tool_call_stream(("c1", "write_file", {"path": "notes.txt", "content": "forty-two"})),
        text_stream("Wrote ", "notes.txt."),
        Reply(401, {"error": {"message": "bad key"}}),  # not retried: turn 2 is aborted
    )
    with a.client() as c:
        sid = c.create(session="talk").id
        assert c.send_text(sid, "write the answer down") == "Wrote notes.txt."
        events = list(c.send(sid, "and again"))
        assert isinstance(events[-1], m.TurnFailed)

    history = ctl_json(a, "history", sid)
    first, second = history["turns"]
    assert first["input"] == "write the answer down" and first["outcome"] == "done"
    assert first["reply"] == "Wrote notes.txt."
    assert [call["name"] for call in first["tool_calls"]] == ["write_file"]
    assert "forty-two" in json.dumps(first["tool_calls"][0]["arguments"])
    assert [r["name"] for r in first["tool_results"]] == ["write_file"]
    assert second["outcome"] == "aborted" and "401" in second["reason"]
    assert ctl_json(a, "history", sid, "--limit", "1")["turns"] == [second]
    text = a.ctl("history", sid)
    assert text.returncode == 0
    assert "> write the answer down" in text.stdout and "[tool] write_file" in text.stdout
    assert "aborted: " in text.stdout

    export = a.ctl("export", sid)
    assert export.returncode == 0, export.stderr
    path = tmp_path / "talk.json"
    path.write_text(export.stdout)
    doc = json.loads(export.stdout)
    assert doc["format"] == "sessiond-session" and doc["handler"] == "agent"
    assert "workspace" not in export.stdout and str(a.state_dir) not in export.stdout

    imported = b.ctl("import", str(path))
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "talk"
    assert comparable(ctl_json(b, "history", "talk")["turns"]) == comparable(history["turns"])
    status = ctl_json(b, "status", "talk")
    assert status["state"] == "hibernated" and status["turns"] == 2

    # The imported agent goes on from the imported conversation.
    llm.script(text_stream("It said forty-two."))
    with b.client() as c:
        assert c.send_text("talk", "what did you write?") == "It said forty-two."
    sent = json.dumps(llm.requests[-1].json["messages"])
    assert "write the answer down" in sent and "Wrote notes.txt." in sent
    # ... and the same file imports again under another id, not over it.
    again = b.ctl("import", str(path))
    assert again.returncode == 1 and "already exists" in again.stderr
    assert b.ctl("import", "--id", "talk-2", input=path.read_text()).returncode == 0


def test_import_treats_the_document_as_hostile(make_daemon, tmp_path: Path) -> None:
    d = make_daemon()
    with d.client() as c:
        sid = c.create(session="src").id
        c.send_text(sid, "one")
        c.send_text(sid, "two")
    good = json.loads(d.ctl("export", sid).stdout)

    def variant(**changes: object) -> str:
        doc = json.loads(json.dumps(good))
        doc.update(changes)
        return json.dumps(doc)

    records = good["records"]
    not_msgpack = base64.b64encode(b"\xc1").decode()
    refused = {
        "not json": "{nope",
        "not an export": json.dumps({"hello": 1}),
        "a path smuggled in": variant(id="x1", workspace="/etc"),
        "a field in a record": variant(id="x2", records=[records[0] | {"path": "/etc/passwd"}]),
        "a turn skipped": variant(id="x3", records=[records[0] | {"turn": 2}]),
        "a commit of no input": variant(id="x4", records=[records[1]]),
        "a record not msgpack": variant(id="x5", records=[records[0], records[1] | {"record": not_msgpack}]),
        "a handler not allowed": variant(id="x6", handler="os:system"),
        "a handler that is a path": variant(id="x7", handler="../evil:make"),
        "an override not allowed": variant(id="x8", overrides={"daemon.state_dir": "/"}),
        "an override past the ceiling": variant(id="x9", overrides={"agent.limits.max_memory_mb": 1 << 30}),
        "a bad id": variant(id="../etc"),
        "an id that exists": variant(),
        "a negative turn count": variant(id="x10", snapshot={"turns": -1}),
        "a wrong type": variant(id="x11", created_at="yesterday"),
        "a future version": variant(id="x12", version=2),
    }
    for why, text in refused.items():
        done = d.ctl("import", input=text)
        assert done.returncode == 1, (why, done.returncode, done.stderr)
        assert done.stderr.startswith("sessionctl: "), why
    assert sorted(d.ctl("ls", "-q").stdout.split()) == ["src"]
    # Nothing left on disk but the one real session (and the daemon's journal).
    assert sorted(p.name for p in (d.state_dir / "sessions").iterdir() if not p.name.startswith(".")) == ["src"]

    assert d.ctl("import", "--id", "../etc", input=variant()).returncode == 2
    assert d.ctl("import", str(tmp_path / "missing.json")).returncode == 2
    ok = d.ctl("--json", "import", "--id", "copy", input=variant())
    assert ok.returncode == 0 and json.loads(ok.stdout) == {"id": "copy"}
    with d.client() as c:
        assert c.send_text("copy", "three") == "3: three"  # the echo's count came along


def test_logs_tell_the_lifecycle_with_exit_reasons_and_follow(make_daemon) -> None:
    d = make_daemon(FAST_SWEEP)
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:leaky", settings={"agent.limits.max_memory_mb": 96}).id
        events = list(c.send(sid, "400"))
        assert isinstance(events[-1], m.TurnFailed)
        wait_for(lambda: c.status(sid).state == "idle" and c.status(sid).restarts == 1, 10, "the restart")

    logs = ctl_json(d, "logs", sid)
    kinds = [(e["type"], e.get("new") or e.get("kind") or "") for e in logs["entries"]]
    assert ("state", "crashed") in kinds and ("limit", "memory") in kinds and ("turn_failed", "") in kinds
    crashed = next(e for e in logs["entries"] if e.get("new") == "crashed")
    assert crashed["reason"] == "killed_memory" and crashed["at"] > 0
    assert logs["last_exit"]["reason"] == "killed_memory"
    assert all(a["at"] <= b["at"] for a, b in zip(logs["entries"], logs["entries"][1:]))
    text = d.ctl("logs", sid).stdout
    assert "state running -> crashed: killed_memory" in text and "last exit: " in text
    assert len(ctl_json(d, "logs", sid, "--limit", "2")["entries"]) == 2

    follower = subprocess.Popen(
        [sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket), "--json", "logs", sid, "-f"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for_children(),
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in follower.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        seen: list[dict] = []

        def saw(new: str) -> bool:
            while not lines.empty():
                seen.append(json.loads(lines.get()))
            return any(e.get("new") == new for e in seen)

        wait_for(lambda: saw("crashed"), 10, "the kept entries")
        assert d.ctl("stop", sid).returncode == 0
        wait_for(lambda: saw("stopped"), 10, "the stop, followed")
        assert d.ctl("rm", sid).returncode == 0
        wait_for(lambda: saw("deleted"), 10, "the removal, followed")
        assert follower.wait(10) == 0
    finally:
        follower.kill()
        follower.wait()


def test_missing_sessions_and_bad_arguments_exit_per_the_contract(make_daemon) -> None:
    d = make_daemon()
    for args in (("history", "nope"), ("logs", "nope"), ("export", "nope"), ("logs", "nope", "-f")):
        assert d.ctl(*args).returncode == 4, args
    for args in (("history", "x", "--limit", "-1"), ("history", "x", "--limit", "many"),
                 ("top", "--sort", "bogus"), ("top", "--interval", "0"), ("completion", "fish")):
        done = d.ctl(*args)
        assert done.returncode == 2, (args, done.stderr)


def test_top_once_json_has_the_fields_scripts_use(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        busy = c.create(session="busy").id
        for word in ("a", "b", "c"):
            c.send_text(busy, word)
        quiet = c.create(session="quiet").id
        c.stop(quiet)
    got = ctl_json(d, "top", "--once", "--sort", "turns", "--sample-secs", "0.1")
    assert [s["id"] for s in got["sessions"]] == ["busy", "quiet"]
    fields = {"id", "state", "handler", "pid", "rss_bytes", "cpu_percent", "cpu_secs", "restarts", "turns",
              "last_exit", "age_secs", "waiting"}
    for s in got["sessions"]:
        assert set(s) == fields
    live, stopped = got["sessions"]
    assert live["state"] == "idle" and live["pid"] > 0 and live["rss_bytes"] > 0 and live["turns"] == 3
    assert live["cpu_percent"] is not None and live["cpu_secs"] >= 0
    assert stopped["state"] == "stopped" and stopped["pid"] is None and stopped["last_exit"]["reason"] == "stopped"
    totals = got["totals"]
    assert totals["sessions"] == 2 and totals["live"] == 1 and totals["turns"] == 3
    assert totals["by_state"] == {"idle": 1, "stopped": 1}
    assert totals["daemon"]["clients"] >= 1
    text = d.ctl("top", "--once")
    assert text.returncode == 0 and "busy" in text.stdout
    assert all(len(line) <= 80 for line in text.stdout.splitlines())


def test_top_runs_live_in_an_80x24_terminal_and_quits_on_q(make_daemon) -> None:
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios

    d = make_daemon()
    with d.client() as c:
        c.create(session="watched")
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket), "top", "--interval", "0.2"],
        stdin=follower, stdout=follower, stderr=follower, env=env_for_children() | {"TERM": "xterm"},
        start_new_session=True,
    )
    os.close(follower)
    screen = b""
    try:
        def painted(text: bytes) -> bool:
            nonlocal screen
            while select.select([leader], [], [], 0.05)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                screen += chunk
            return text in screen

        wait_for(lambda: painted(b"watched") and painted(b"sessiond up"), 15, "the first screen")
        before = len(screen)
        os.write(leader, b"m")  # sort by memory: curses repaints just the changed word
        wait_for(lambda: painted(b"") and b"rss" in screen[before:], 10, "the sort key to change")
        os.write(leader, b"q")
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()
        os.close(leader)


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="acting as another user needs root")
def test_another_user_sees_none_of_it_and_owns_what_it_imports(make_daemon) -> None:
    import os
    import socket
    import struct

    import msgspec

    from harness import run_as
    from ipc.framing import encode_frame

    nobody = 65534
    d = make_daemon(f'[daemon]\nsocket_mode = "0666"\nallowed_uids = [{nobody}]\n')
    os.chmod(d.sockdir, 0o755)
    with d.client() as c:
        mine = c.create(session="roots").id
        c.send_text(mine, "secret")
    document = d.ctl("export", mine).stdout.encode()
    decoder = msgspec.msgpack.Decoder(op.AnyReply)
    requests = [op.History(id=1, session=mine), op.Logs(id=2, session=mine), op.Export(id=3, session=mine),
                op.Top(id=4), op.Import(id=5, document=document, session="theirs"), op.Top(id=6),
                op.History(id=7, session="theirs", limit=-1)]

    def talk() -> list[bytes]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(d.socket))
        out = []
        for req in [m.Hello(protocol=m.PROTOCOL_VERSION, client="other-user"), *requests]:
            s.sendall(encode_frame(req))
            (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
            out.append(s.recv(n, socket.MSG_WAITALL))
        return out

    welcome, history, logs, export, top, imported, top_after, bad_limit = (
        decoder.decode(f) for f in run_as(nobody, talk))
    assert isinstance(welcome, m.Welcome)
    for reply in (history, logs, export):
        assert isinstance(reply, m.Error) and reply.code == "not_found"
    assert isinstance(top, op.TopReply) and top.entries == []
    assert isinstance(imported, m.Created) and imported.session.owner_uid == nobody
    assert isinstance(top_after, op.TopReply) and [e.session.id for e in top_after.entries] == ["theirs"]
    assert isinstance(bad_limit, m.Error) and bad_limit.code == "bad_request"
    with d.client() as c:
        assert c.status("theirs").owner_uid == nobody


def test_top_without_a_terminal_streams_json_lines_or_says_what_to_use(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        c.create(session="one")
    plain = d.ctl("top")
    assert plain.returncode == 2 and "--once" in plain.stderr
    stream = subprocess.Popen(
        [sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket), "--json", "top", "--interval", "0.1"],
        stdout=subprocess.PIPE, text=True, env=env_for_children(),
    )
    try:
        first, second = stream.stdout.readline(), stream.stdout.readline()  # type: ignore[union-attr]
        for line in (first, second):
            assert [s["id"] for s in json.loads(line)["sessions"]] == ["one"]
    finally:
        stream.kill()
        stream.wait()
