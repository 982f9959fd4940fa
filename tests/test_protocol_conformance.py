"""docs/protocol.md, held against a real daemon by a client written from
it alone (tests/wire_client.py: plain msgpack, none of the project's
code), every frame it receives checked against the published schema
(docs/protocol.schema.json): the handshake and its refusals, a turn
streamed after its `accepted`, errors that keep the connection, attach
with a replay.  One daemon serves the module's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness import Daemon
from wire_client import Closed, WireClient
from wire_schema import conforms

pytestmark = pytest.mark.process

@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("conformance"), "[daemon]\nstop_grace_secs = 1.0\n")
    try:
        d.start()
        yield d
    finally:
        d.cleanup()
    d.assert_no_leftovers()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[WireClient]:
    c = WireClient(str(daemon.socket))
    try:
        welcome = c.hello()
        assert welcome["type"] == "welcome" and welcome["protocol"] == 1 and welcome["pid"] == daemon.pid
        yield c
        for frame in c.frames:
            conforms(frame, "Reply")
    finally:
        c.close()


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("first", [
    {"type": "hello", "protocol": 99, "client": "future"},
    {"type": "ls", "id": 1},
    {"type": "hello", "protocol": "one"},  # a hello that does not decode is no hello (it stayed open)
    {"type": "hello"},
])
def test_the_handshake_refuses_another_version_and_a_request_before_hello(daemon: Daemon, first: dict) -> None:
    c = WireClient(str(daemon.socket))
    try:
        c.send(first)
        error = c.recv()
        conforms(error, "Reply")
        assert error["type"] == "error"
        assert error["code"] == ("protocol_mismatch" if first.get("protocol") == 99 else "bad_request")
        with pytest.raises(Closed):
            c.recv()  # and the connection is closed
    finally:
        c.close()


def test_a_turn_streams_after_its_accepted_in_seq_order(client: WireClient) -> None:
    created = client.call("create", handler="echo")
    assert created["type"] == "created" and created["session"]["type"] == "session"
    sid = created["session"]["id"]
    assert created["session"]["state"] == "idle"
    for n, text in enumerate(["hello", "a longer second input", "3"], start=1):
        rid = client.request("send", session=sid, text=text)
        # (through the `state` back to idle, which follows `turn_done`)
        frames = client.until(lambda f: f["type"] == "state" and f["old"] == "running")
        # The first frame that answers or belongs to this turn is `accepted`:
        # no event of the turn (its `state` running, its text) before it.
        turn_frames = [f for f in frames if f.get("id") == rid or f.get("seq", 0) > 0]
        accepted = turn_frames[0]
        assert accepted["type"] == "accepted", [f["type"] for f in turn_frames]
        assert accepted["id"] == rid and accepted["session"] == sid and accepted["turn"] == n
        events = turn_frames[1:]
        assert events and all(e["session"] == sid and e["seq"] > accepted["seq"] for e in events)
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(set(seqs)), seqs
        assert events[0]["type"] == "state" and events[0]["new"] == "running"
        text_out = "".join(e["text"] for e in events if e["type"] == "text")
        done = events[-2]
        assert done["type"] == "turn_done" and done["turn"] == n and done["reply"] == f"{n}: {text}"
        assert text_out == done["reply"]


def test_errors_answer_their_request_and_keep_the_connection(client: WireClient) -> None:
    missing = client.call("status", session="no-such-session")
    assert missing["type"] == "error" and missing["code"] == "not_found" and missing["message"]

    bad_value = client.call("repair", session="no-such-session", mode="sideways")
    assert bad_value["type"] == "error" and bad_value["code"] in ("bad_request", "not_found")

    client.send_raw(b"\xc1 not msgpack")  # a frame that is no message at all
    garbage = client.recv()
    assert garbage["type"] == "error" and garbage["code"] == "bad_request" and garbage.get("id", 0) == 0

    client.send({"type": "frobnicate", "id": 77})  # an unknown request
    unknown = client.recv()
    assert unknown["type"] == "error" and unknown["code"] == "bad_request"

    client.send({"type": "hello", "protocol": 1})  # hello again
    again = client.recv()
    assert again["type"] == "error" and again["code"] == "bad_request"

    pong = client.call("ping")
    assert pong["type"] == "pong" and pong["pid"] > 0  # still served


def test_replies_have_the_documented_shapes(client: WireClient, daemon: Daemon) -> None:
    sid = client.call("create", session="shapes", handler="echo")["session"]["id"]
    assert sid == "shapes"
    status = client.call("status", session=sid)
    assert status["type"] == "status" and status["session"]["id"] == sid
    listed = client.call("ls")
    assert listed["type"] == "sessions" and sid in [s["id"] for s in listed["sessions"]]
    stats = client.call("stats")
    assert stats["type"] == "stats" and stats["sessions"] >= 1
    assert client.call("ping", session=sid)["type"] == "pong"
    assert client.call("top")["type"] == "top"
    logs = client.call("logs", session=sid)
    assert logs["type"] == "logs" and any(e["event"]["type"] == "state" for e in logs["entries"])
    history = client.call("history", session=sid)
    assert history["type"] == "history"
    exported = client.call("export", session=sid)
    assert exported["type"] == "exported" and isinstance(exported["document"], bytes)
    busy = client.call("interrupt", session=sid)
    assert busy["type"] == "error" and busy["code"] == "conflict"
    assert client.call("stop", session=sid)["type"] == "ok"
    assert client.call("rm", session=sid)["type"] == "ok"


def test_attach_answers_then_replays_from_seq(client: WireClient, daemon: Daemon) -> None:
    sid = client.call("create", handler="echo")["session"]["id"]
    client.request("send", session=sid, text="kept")
    client.until(lambda f: f["type"] == "turn_done")

    watcher = WireClient(str(daemon.socket))
    try:
        watcher.hello()
        rid = watcher.request("attach", session=sid, from_seq=1)
        first = watcher.recv()
        assert first["type"] == "attached" and first["id"] == rid and first["next_seq"] > 1
        replay = watcher.until(lambda f: f["type"] == "turn_done")
        assert [f["seq"] for f in replay] == sorted(f["seq"] for f in replay)
        assert replay[-1]["reply"] == "1: kept"
        for frame in watcher.frames:
            conforms(frame, "Reply")
    finally:
        watcher.close()
