"""Damage the chaos run found: a flipped byte in the middle of a log, a
flipped byte in a snapshot, a session that does not load, two daemons on
one state dir.  Store-level tests first, then the real daemon."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from harness import Daemon, env_for_children, wait_for
from supervisor.store.state_store import RepairMode
from supervisor.errors import StoreDamaged, StoreFull
from supervisor.store.filestore import FileStateStore
from polling import until
from supervisor.store.files import (
    Commit,
    InputRecord,
    Meta,
    SessionStore,
    Snapshot,
)



def _log_with(tmp_path: Path, n: int) -> Path:
    st = SessionStore.create(tmp_path, Meta(id="s1", handler="echo"))
    for t in range(1, n + 1):
        st.append(InputRecord(turn=t, text=f"in{t}", seq=2 * t - 1), durable=False)
        st.append(Commit(turn=t, reply=f"out{t}", record=bytes([t]), seq=2 * t), durable=True)
    st.close()
    return tmp_path / "s1" / "log.0"


def _record_offsets(data: bytes) -> list[int]:
    offsets, pos = [], 0
    while pos < len(data):
        offsets.append(pos)
        pos += 8 + int.from_bytes(data[pos : pos + 4], "big")
    return offsets


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- the log


@pytest.mark.component
def test_flipped_byte_in_a_middle_record_keeps_the_file_and_says_so(tmp_path: Path) -> None:
    log = _log_with(tmp_path, 3)
    offsets = _record_offsets(log.read_bytes())
    _flip(log, offsets[3] + 12)  # inside turn 2's input record's body
    before = log.read_bytes()
    with pytest.raises(StoreDamaged) as exc:
        SessionStore.load(tmp_path / "s1")
    # Not cut, not rewritten: the intact records after the damage are there.
    assert log.read_bytes() == before
    assert exc.value.meta is not None and exc.value.meta.id == "s1"
    assert f"log.0 is corrupt at byte(s) {offsets[3]}-{offsets[4]}" in exc.value.reason
    assert "3 intact record(s) after" in exc.value.reason and "repair" in exc.value.reason


@pytest.mark.parametrize("mode, turns, records", [
    (RepairMode.SKIP_BAD, 3, [b"\x01", b"\x02", b"\x03"]),  # only the bad input record goes
    (RepairMode.TRUNCATE, 1, [b"\x01"]),  # what precedes the damage
])
@pytest.mark.component
def test_repair_rewrites_the_log_and_it_loads_again(
    tmp_path: Path, mode: RepairMode, turns: int, records: list[bytes]
) -> None:
    log = _log_with(tmp_path, 3)
    offsets = _record_offsets(log.read_bytes())
    _flip(log, offsets[3] + 12)
    store = FileStateStore(tmp_path)
    result = store.repair("s1", mode)
    assert result.dropped_bytes == offsets[4] - offsets[3]
    st, loaded = store.load("s1")
    assert st.read_for_boot()[1] == records
    assert loaded.turns == turns
    # Appends line up after the rewritten log.
    st.append(Commit(turn=9, reply="z", record=b"\x09", seq=99), durable=True)
    st.close()
    assert SessionStore.load(tmp_path / "s1")[0].read_for_boot()[1] == [*records, b"\x09"]


@pytest.mark.component
def test_torn_tail_after_mid_damage_is_not_mistaken_for_it(tmp_path: Path) -> None:
    # Damage whose only sequel is a torn record: nothing intact follows, so
    # it is a tail, cut as before.
    log = _log_with(tmp_path, 2)
    data = log.read_bytes()
    offsets = _record_offsets(data)
    log.write_bytes(data[: offsets[-1] + 5])
    _, loaded = SessionStore.load(tmp_path / "s1")
    assert loaded.turns == 2 and loaded.open_input is not None
    assert log.stat().st_size == offsets[-1]


# ---------------------------------------------------------------- snapshots


def _rotate(st: SessionStore, turns: int, state: bytes) -> None:
    st.write_snapshot(Snapshot(gen=0, meta=Meta(id="s1", handler="echo"), turns=turns, seq=turns,
                               handler_state=state))


@pytest.mark.component
def test_flipped_byte_in_the_snapshot_falls_back_to_the_previous_generation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    st = SessionStore.create(tmp_path, Meta(id="s1", handler="echo"))
    turn = 0
    for state in (b"A", b"B"):
        for _ in range(35):
            turn += 1
            st.append(Commit(turn=turn, reply="x", record=b"r", seq=turn), durable=True)
        _rotate(st, turn, state)
    turn += 1
    st.append(Commit(turn=turn, reply="x", record=b"r", seq=turn), durable=True)
    st.close()
    snap = tmp_path / "s1" / "snapshot"
    _flip(snap, snap.stat().st_size - 20)
    with caplog.at_level(logging.WARNING, logger="sessiond.store"):
        st2, loaded = SessionStore.load(tmp_path / "s1")
    assert "snapshot fails its checksum" in caplog.text and "s1" in caplog.text
    # The previous snapshot (after 35 turns) and both logs since: 71 turns, not 7.
    state, records, turns = st2.read_for_boot()
    assert (state, len(records), turns) == (b"A", 36, 71)
    assert loaded.seq == 71


@pytest.mark.component
def test_damaged_snapshot_without_a_fallback_is_damage_not_a_guess(tmp_path: Path) -> None:
    st = SessionStore.create(tmp_path, Meta(id="s1", handler="echo"))
    st.append(Commit(turn=1, reply="x", record=b"r", seq=1), durable=True)
    _rotate(st, 1, b"A")
    st.close()
    (tmp_path / "s1" / "log.0").unlink()  # as a session rotated before fallbacks were kept
    _flip(tmp_path / "s1" / "snapshot", 30)
    with pytest.raises(StoreDamaged) as exc:
        SessionStore.load(tmp_path / "s1")
    assert not exc.value.repairable and "fails its checksum" in exc.value.reason


@pytest.mark.component
def test_snapshot_written_before_checksums_still_loads(tmp_path: Path) -> None:
    st = SessionStore.create(tmp_path, Meta(id="s1", handler="echo"))
    st.close()
    old = Snapshot(gen=1, meta=Meta(id="s1", handler="echo"), turns=4, seq=9, handler_state=b"S")
    (tmp_path / "s1" / "snapshot").write_bytes(msgspec.msgpack.encode(old))
    st2, loaded = SessionStore.load(tmp_path / "s1")
    assert loaded.turns == 4 and st2.read_for_boot() == (b"S", [], 4)


# ---------------------------------------------------------------- full disk


@pytest.mark.component
def test_full_disk_is_store_full_with_the_real_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = SessionStore.create(tmp_path, Meta(id="s1", handler="echo"))
    real_write = os.write
    calls = []

    def short_then_enospc(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:3]))  # the disk filled up mid-record
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", short_then_enospc)
    with pytest.raises(StoreFull, match="No space left on device"):
        st.append(Commit(turn=1, reply="x" * 100, seq=1), durable=True)
    monkeypatch.setattr(os, "write", real_write)
    st.close()
    assert SessionStore.load(tmp_path / "s1")[1].seq == 0


# ---------------------------------------------------------------- the daemon


def _ctl_json(d: Daemon, *args: str) -> dict:
    r = d.ctl("--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.process
def test_damaged_session_is_visible_refused_repairable(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        sid = c.create("mid", handler="echo").id
        for i in range(3):
            c.send_text(sid, f"t{i}")
        other = c.create(handler="echo").id
    d.kill()
    log = d.state_dir / "sessions" / sid / "log.0"
    data = log.read_bytes()
    offsets = _record_offsets(data)
    # The second input's record: intact records follow it.
    inputs = [o for o in offsets if b"input" in data[o + 8 : o + 40]]
    _flip(log, inputs[1] + 12)
    damaged = log.read_bytes()
    d.start()
    listed = {s["id"]: s for s in _ctl_json(d, "ls")["sessions"]}
    assert listed[sid]["state"] == "damaged" and "corrupt" in listed[sid]["error"]
    assert listed[other]["state"] == "hibernated" and listed[other]["error"] is None
    assert any("ERROR" in line and f"session={sid} is damaged" in line for line in d.log.splitlines())
    r = d.ctl("status", sid)
    assert r.returncode == 0 and "damaged" in r.stdout and "error:" in r.stdout
    r = d.ctl("send", sid, "more")
    assert r.returncode == 1 and "damaged" in r.stderr and f"sessionctl repair {sid}" in r.stderr
    r = d.ctl("create", "--id", sid)
    assert r.returncode == 1 and "already exists and is damaged" in r.stderr
    assert log.read_bytes() == damaged  # untouched until the operator decides
    r = d.ctl("repair", sid)
    assert r.returncode == 2  # a mode is required
    r = d.ctl("repair", sid, "--skip-bad")
    assert r.returncode == 0 and "repaired" in r.stdout, r.stderr
    with d.client() as c:
        assert c.status(sid).state == "hibernated" and c.status(sid).error is None
        # Turn 2's input is gone, its commit kept: the count stays at 3.
        assert c.send_text(sid, "after") == "4: after"
    r = d.ctl("repair", sid, "--truncate")
    assert r.returncode == 1 and "not damaged" in r.stderr


@pytest.mark.process
def test_session_that_fails_to_load_is_no_ghost(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        sid = c.create("snap", handler="echo").id
    d.kill()
    sdir = d.state_dir / "sessions" / sid
    (sdir / "snapshot").write_bytes(b"\x00garbage")
    (sdir / "log.0").unlink()
    d.start()
    st = _ctl_json(d, "status", sid)
    assert st["state"] == "damaged" and "snapshot" in st["error"]
    r = d.ctl("repair", sid, "--skip-bad")
    assert r.returncode == 1 and "cannot be repaired" in r.stderr
    r = d.ctl("rm", sid)
    assert r.returncode == 0, r.stderr
    assert not sdir.exists()
    r = d.ctl("status", sid)
    assert r.returncode == 4
    with d.client() as c:
        assert c.create(sid, handler="echo").id == sid
        assert c.send_text(sid, "fresh") == "1: fresh"


@pytest.mark.process
def test_second_daemon_on_the_same_state_dir_is_refused(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        sid = c.create(handler="echo").id
    other_sock = d.sockdir / "other.sock"
    r = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "run", "--config", str(d.config_path),
         "--socket", str(other_sock), "--state-dir", str(d.state_dir)],
        capture_output=True, text=True, env=env_for_children(), timeout=30,
    )
    assert r.returncode == 1, r.stderr
    assert f"in use by another sessiond (pid {d.pid}" in r.stderr and "Traceback" not in r.stderr
    assert not other_sock.exists()
    with d.client() as c:
        assert c.send_text(sid, "still mine") == "1: still mine"
    # The lock dies with its holder: a restart after SIGKILL is not blocked.
    d.kill()
    d.start()
    with d.client() as c:
        assert c.status(sid).turns == 1


@pytest.mark.component
def test_failed_sync_after_a_deferred_create_keeps_the_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # create(durable=False) + make_durable(), then an input whose fsync
    # fails: the cut-back must stop at the metadata record, not at 0.
    st = SessionStore.create(tmp_path, Meta(id="s1", handler="echo"), durable=False)
    st.make_durable()
    st.append(InputRecord(turn=1, text="x", seq=1), durable=False)

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(Exception, match="Input/output error"):
        st.sync()
    monkeypatch.undo()
    st.close()
    _, loaded = SessionStore.load(tmp_path / "s1")
    assert loaded.meta.id == "s1" and loaded.turns == 0


# ---------------------------------------------------------------- the manager, no processes


class _NoSpawner:
    on_exit = None
    on_zygote_lost = None
    zygote_pid = 0


@pytest.mark.component
def test_manager_lists_removes_and_repairs_a_damaged_session_in_memory(tmp_path: Path) -> None:
    import asyncio

    from supervisor.config import parse_config
    from supervisor.core.manager import SessionManager
    from supervisor.store.memory import InMemoryStateStore

    mem = InMemoryStateStore()
    for sid in ("good", "bad", "gone"):
        h = mem.create(Meta(id=sid, handler="echo", owner_uid=1000))
        for t in (1, 2, 3):
            h.append(Commit(turn=t, reply="r", record=bytes([t]), seq=t), durable=True)
    for sid in ("bad", "gone"):
        log = mem.sessions[sid].log
        log[_record_offsets(bytes(log))[-2] + 10] ^= 0x40  # turn 2's record; turn 3 follows intact
    # uid 1000 may use this daemon: the owner is checked on load as on create.
    mgr = SessionManager(parse_config({"daemon": {"allowed_uids": [1000]}, "tools": {"disk_quota": "measured"}},
                                      "test"), tmp_path,
                         _NoSpawner(), store=mem)  # type: ignore[arg-type]
    mgr.load_all()
    infos = {s.id: mgr.info(s) for s in mgr.visible(1000)}
    assert infos["good"].state == "hibernated" and infos["good"].error is None
    assert infos["bad"].state == "damaged" and "corrupt" in (infos["bad"].error or "")

    async def run() -> None:
        from supervisor.errors import Conflict

        try:
            await mgr.send(mgr.get("bad", 1000), "hi", None)
        except Conflict as exc:
            assert "sessionctl repair bad" in exc.message
        else:
            raise AssertionError("a damaged session took input")
        session, result = await mgr.repair(mgr.get("bad", 1000), "truncate")
        # Truncate: turn 2 damaged, turn 3 dropped with it; turn 1 kept.
        assert result.dropped_records == 1 and session.state.value == "hibernated"
        assert session.seq == 1
        await mgr.remove(mgr.get("gone", 1000))

    asyncio.run(run())
    assert mem.ids() == ["bad", "good"]
    assert mgr.info(mgr.get("bad")).error is None


# ---------------------------------------------------------------- damage found while the daemon runs


def _flip_commit(log: bytearray, turn: int) -> None:
    """Flip a byte inside turn `turn`'s commit record (intact ones follow)."""
    data = bytes(log)
    offsets = _record_offsets(data)
    commits = [o for o in offsets if b"commit" in data[o + 8 : o + 40]]
    log[commits[turn - 1] + 12] ^= 0x40


def _only_lifecycle_after(now: bytes, damaged: bytes) -> bool:
    """The log is as it was when damaged, but for the bookkeeping of the
    state change that led to the read (`hibernated -> starting` and its seq
    reservation, written before the read found the damage): no input, no turn."""
    from supervisor.store.files import scan_log
    from supervisor.store.state_store import LifeEvent, Mark

    tail = scan_log(now[len(damaged):])
    return (now.startswith(damaged) and not tail.bad
            and all(isinstance(r, (LifeEvent, Mark)) for _, _, r in tail.records))


@pytest.mark.component
def test_a_revival_that_finds_its_log_damaged_makes_the_session_damaged_at_once(tmp_path: Path) -> None:
    """The finding in the core: a hibernated session whose log was damaged
    meanwhile was revived past the damage (one turn short) and its next
    turn written after it.  Now its boot's read marks it damaged, the input
    is refused, nothing is written, and `repair` brings it back."""
    import asyncio

    from fakespawner import FakeSpawner
    from supervisor.config import parse_config
    from supervisor.core.manager import SessionManager
    from supervisor.errors import Conflict
    from supervisor.store.memory import InMemoryStateStore

    mem = InMemoryStateStore()
    mgr = SessionManager(parse_config({}, "test"), tmp_path, FakeSpawner(), store=mem)
    mgr.load_all()

    async def run() -> None:
        session = await mgr.create(0, "s", "echo", {})
        for n in range(1, 4):
            await mgr.send(session, f"t{n}", None)
            await until(lambda: session.state.value == "idle" and session.turns == n, "the turn")
        await mgr.slots.hibernate(session, "test")
        assert session.state.value == "hibernated"
        _flip_commit(mem.sessions["s"].log, 2)
        damaged = bytes(mem.sessions["s"].log)
        with pytest.raises(Conflict, match="is damaged .*sessionctl repair s"):
            await mgr.send(session, "more", None)
        assert session.state.value == "damaged" and "corrupt" in (session.error or "")
        assert session.worker is None and _only_lifecycle_after(bytes(mem.sessions["s"].log), damaged)
        with pytest.raises(Conflict, match="damaged"):  # and it stays so
            await mgr.send(session, "again", None)
        restored, result = await mgr.repair(session, "skip_bad")
        assert result.dropped_bytes > 0 and restored.state.value == "hibernated"
        await mgr.send(restored, "after", None)
        await until(lambda: restored.state.value == "idle" and restored.turns == 4, "the turn after repair")
        await mgr.shutdown(0.2)

    asyncio.run(asyncio.wait_for(run(), 20))


@pytest.mark.component
def test_history_that_finds_damage_stops_the_worker_and_fails_its_turn(tmp_path: Path) -> None:
    """A live session (its worker in a turn) whose `history` read meets
    damage: writes are refused at once, the worker is stopped, the turn
    fails saying why, the session is damaged, the log stays as it was."""
    import asyncio

    import msgspec

    from fakespawner import FakeSpawner
    from ipc import messages as m
    from supervisor.api import transfer
    from supervisor.config import parse_config
    from supervisor.core.manager import SessionManager
    from supervisor.errors import Conflict
    from supervisor.store.memory import InMemoryStateStore

    mem, spawner = InMemoryStateStore(), FakeSpawner()
    mgr = SessionManager(parse_config({"daemon": {"stop_grace_secs": 0.2}}, "test"), tmp_path, spawner,
                         store=mem)
    mgr.load_all()
    failed: list[m.TurnFailed] = []

    class Watcher:
        uid = 0
        event_tags: frozenset[str] = frozenset()

        def deliver(self, frame: bytes | bytearray) -> None:
            ev = msgspec.msgpack.decode(bytes(frame)[4:], type=m.Event)
            if isinstance(ev, m.TurnFailed):
                failed.append(ev)

    async def run() -> None:
        session = await mgr.create(0, "s", "echo", {})
        mgr.attach(session, Watcher(), None)
        for n in (1, 2):
            await mgr.send(session, f"t{n}", None)
            await until(lambda: session.state.value == "idle" and session.turns == n, "the turn")
        assert session.worker is not None
        worker = spawner.workers[session.worker.pid]
        worker.behaviour = lambda w, msg: isinstance(msg, m.Input)  # the turn runs on and on
        await mgr.send(session, "long", None)
        assert session.state.value == "running"
        _flip_commit(mem.sessions["s"].log, 1)
        damaged = bytes(mem.sessions["s"].log)
        with pytest.raises(Conflict, match="is damaged"):
            await transfer.history(session, None, mgr.damage)
        assert session.state.value == "damaged" and session.worker is None and not worker.alive
        await until(lambda: failed, "the turn's end")
        assert failed[0].turn == 3 and "damaged" in failed[0].reason
        assert bytes(mem.sessions["s"].log) == damaged
        with pytest.raises(Conflict, match="damaged"):
            await transfer.export_document(session, 1 << 20, mgr.damage)
        await mgr.shutdown(0.2)

    asyncio.run(asyncio.wait_for(run(), 20))




@pytest.mark.process
def test_a_log_damaged_while_the_daemon_runs_is_not_read_past(make_daemon) -> None:
    """The issue's scenario: seven turns, a restart, one byte flipped in the
    middle of log.0, then `send`: the reply said turn 7 (a commit skipped
    silently) and turn 8 was written after the damage.  Now the send is
    refused, the session is damaged at once, the log kept as it was."""
    d = make_daemon()
    with d.client() as c:
        sid = c.create("seven", handler="echo").id
        for i in range(1, 8):
            assert c.send_text(sid, f"t{i}") == f"{i}: t{i}"
    d.stop()
    d.start()
    log = d.state_dir / "sessions" / sid / "log.0"
    data = bytearray(log.read_bytes())
    _flip_commit(data, 4)
    log.write_bytes(bytes(data))
    r = d.ctl("send", sid, "more")
    assert r.returncode == 1 and "damaged" in r.stderr and f"sessionctl repair {sid}" in r.stderr, r
    assert "8: more" not in r.stdout and "7: more" not in r.stdout
    st = _ctl_json(d, "status", sid)
    assert st["state"] == "damaged" and "corrupt" in st["error"]
    assert _only_lifecycle_after(log.read_bytes(), bytes(data))  # no input, no turn after the damage
    r = d.ctl("history", sid)
    assert r.returncode == 1 and "damaged" in r.stderr
