"""A daemon with many sessions on disk serves before it has loaded them
(supervisor.core.loading): the sessions are listed, the daemon listens, and
they are loaded in the background; a request naming one not loaded yet
loads it at once; what needs every session waits for the load or says it
is partial.  And the start-up load itself: nothing written for a session
whose files need nothing, a child linked to its parent whatever the order
they are loaded in.

The component tests run the core in-process (FakeSpawner) over a real file
store whose start-up reads, which run in the loader's thread, wait until the
test lets them go (`HeldStore`): what is served before the load reaches a
session is shown by order, not by timing.  The process test blocks a real
daemon's background load on a session whose log is a FIFO (a read that
waits for a writer, as on a stalled disk)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fakespawner import FakeSpawner
from harness import Daemon, wait_for
from polling import until
from test_core_component import Recorder, _run
from ipc import messages as m
from stored import echo_sessions
from supervisor.config import parse_config
from supervisor.core.manager import SessionManager
from supervisor.core.states import State
from supervisor.core.subagents import child_prefix
from supervisor.errors import Capacity, Conflict, Fenced
from supervisor.store.files import LoadedSession, Mark, SessionStore
from supervisor.store.filestore import FileStateStore
from supervisor.store.sessiondir import read_fence

CONFIG: dict[str, Any] = {
    "agent": {"worker": {"restart_backoff_initial_ms": 1, "restart_backoff_max_ms": 2}},
    "daemon": {"stop_grace_secs": 0.2, "session_uid_range": "", "max_sessions_per_uid": 4, "allowed_uids": [1000]},
    "tools": {"disk_quota": "measured"},
}
UID = 1000


class HeldStore(FileStateStore):
    """A file store whose start-up reads in the loader's thread wait for
    `gate` (a session opened on the loop, at a request, does not)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()

    def read_stored(self, session_id: str) -> Callable[[], tuple[SessionStore, LoadedSession]]:
        assert threading.current_thread() is not threading.main_thread(), "a read on the loop"
        self.gate.wait(30)
        return super().read_stored(session_id)

    def open_stored(self, session_id: str) -> tuple[SessionStore, LoadedSession]:
        return FileStateStore.read_stored(self, session_id)()


def _held(tmp_path: Path, config: dict[str, Any] = CONFIG) -> tuple[SessionManager, HeldStore, FakeSpawner]:
    store, spawner = HeldStore(tmp_path / "sessions"), FakeSpawner()
    return SessionManager(parse_config(config, "test"), tmp_path, spawner, store=store), store, spawner


async def _turn(mgr: SessionManager, sid: str, text: str) -> str:
    session = mgr.get(sid, UID)
    watcher = Recorder()
    mgr.attach(session, watcher, None)
    await mgr.send(session, text, None)
    await until(lambda: watcher.of(m.TurnDone), f"{sid}'s turn")
    reply: str = watcher.of(m.TurnDone)[0].reply
    return reply


@pytest.mark.component
def test_a_session_is_served_before_the_background_load_reaches_it(tmp_path: Path) -> None:
    echo_sessions(tmp_path, ["a", "b", "c"], UID)
    mgr, store, _ = _held(tmp_path)

    async def body() -> None:
        try:
            assert mgr.start_loading() == 3
            await asyncio.sleep(0.05)  # (the loader's thread is held at its first read)
            assert mgr.loading == (0, 3) and not mgr.sessions
            # A request names "b": loaded at once, on the loop, and its turn served.
            assert await _turn(mgr, "b", "again") == "2: again"
            assert mgr.loading == (1, 3) and set(mgr.sessions) == {"b"}
            # Ids not loaded yet are taken all the same; a new one waits for
            # the load (the quota counts every session).
            with pytest.raises(Conflict, match="already exists"):
                await mgr.create(UID, "a", "echo", {})
            creating = asyncio.ensure_future(mgr.create(UID, "d", "echo", {}))
            await asyncio.sleep(0.05)
            assert not creating.done() and "d" not in mgr.sessions
        finally:
            store.gate.set()
        await mgr.loaded()
        assert mgr.loading is None and set(mgr.sessions) >= {"a", "b", "c"}
        assert (await creating).id == "d"
        assert mgr.sessions["a"].state is State.HIBERNATED and mgr.sessions["a"].turns == 1
        await mgr.shutdown(1.0)

    _run(body)


@pytest.mark.component
def test_ls_waits_a_moment_for_the_load_then_answers_with_what_it_has(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The finding (`make test`, 4 workers): `ls` a moment after a restart
    listed none of the daemon's two sessions (the load had not reached
    them), which reads as every session lost.  `ls` waits for the load a
    moment (loading.SETTLE_SECS); a load that takes longer is listed in
    part, with its `loading` note, as before."""
    from supervisor.core import loading

    monkeypatch.setattr(loading, "SETTLE_SECS", 0.3)
    echo_sessions(tmp_path, ["a", "b"], UID)
    mgr, store, _ = _held(tmp_path)

    async def body() -> None:
        mgr.start_loading()
        waited = asyncio.get_running_loop().time()
        await mgr.settled()  # held: the moment passes
        assert asyncio.get_running_loop().time() - waited >= 0.3 and mgr.loading == (0, 2)
        settling = asyncio.ensure_future(mgr.settled())
        await asyncio.sleep(0.05)
        assert not settling.done()
        store.gate.set()  # the load goes through: the wait ends with it
        await settling
        assert mgr.loading is None and set(mgr.sessions) == {"a", "b"}
        await mgr.settled()  # loaded: no wait
        await mgr.shutdown(1.0)

    _run(body)


@pytest.mark.component
def test_a_create_during_the_load_counts_the_sessions_not_loaded_yet(tmp_path: Path) -> None:
    """max_sessions_per_uid = 4: the uid has 4 on disk, of which the load
    has reached none when the create comes; it is refused once they are."""
    echo_sessions(tmp_path, ["a", "b", "c", "d"], UID)
    mgr, store, _ = _held(tmp_path)

    async def body() -> None:
        mgr.start_loading()
        creating = asyncio.ensure_future(mgr.create(UID, "e", "echo", {}))
        await asyncio.sleep(0.05)
        assert not creating.done()
        store.gate.set()
        with pytest.raises(Capacity, match=r"already has 4 sessions \(max_sessions_per_uid = 4\)"):
            await creating
        assert "e" not in mgr.sessions
        await mgr.shutdown(1.0)

    _run(body)


@pytest.mark.component
def test_a_load_that_does_not_end_in_time_refuses_a_create_with_capacity(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from supervisor.core import loading

    monkeypatch.setattr(loading, "WAIT_SECS", 0.05)
    echo_sessions(tmp_path, ["a"], UID)
    mgr, store, _ = _held(tmp_path)

    async def body() -> None:
        try:
            mgr.start_loading()
            with pytest.raises(Capacity, match="loaded 0 of 1 in 0.05s; try again shortly"):
                await mgr.create(UID, "e", "echo", {})
        finally:
            store.gate.set()
        await mgr.loaded()
        await mgr.shutdown(1.0)

    _run(body)


def _long_family() -> tuple[str, str]:
    """A parent whose child's id sorts before its own: ids are cut at 57
    characters (subagents.child_prefix), so a deep enough child's id is its
    parent's prefix and 6 hex digits, and those can sort either way."""
    parent = "p" * 57 + ".ffffff"
    return parent, f"{child_prefix(parent)}000000"


@pytest.mark.component
def test_a_child_whose_id_sorts_first_is_its_parents_after_a_restart(tmp_path: Path) -> None:
    """The eager load (every session before listening) links a child loaded
    before its parent too: `rm` of the parent removes it."""
    parent, child = _long_family()
    assert child < parent
    echo_sessions(tmp_path, [parent], UID)
    echo_sessions(tmp_path, [child], UID, parent=parent)
    mgr = SessionManager(parse_config(CONFIG, "test"), tmp_path, FakeSpawner())

    async def body() -> None:
        mgr.load_all()
        assert mgr.sessions[parent].children == (child,)
        await mgr.remove(mgr.get(parent))
        assert not mgr.sessions
        await mgr.shutdown(1.0)

    _run(body)
    assert not FileStateStore(tmp_path / "sessions").ids()


@pytest.mark.component
def test_a_stop_of_a_parent_during_the_load_reaches_children_not_loaded_yet(tmp_path: Path) -> None:
    parent, child = _long_family()
    echo_sessions(tmp_path, [parent, "other"], UID)
    echo_sessions(tmp_path, [child], UID, parent=parent)
    mgr, store, _ = _held(tmp_path)

    async def body() -> None:
        try:
            mgr.start_loading()
            await mgr.stop(mgr.get(parent, UID))
            assert mgr.sessions[child].state is State.STOPPED
            assert set(mgr.sessions) == {parent, child}  # ("other" waits for the load)
            await mgr.remove(mgr.get(parent, UID))
            assert child not in mgr.sessions
        finally:
            store.gate.set()
        await mgr.loaded()
        assert set(mgr.sessions) == {"other"}
        await mgr.shutdown(1.0)

    _run(body)


@pytest.mark.component
def test_a_session_mid_turn_when_the_daemon_died_is_taken_up_when_loaded(tmp_path: Path) -> None:
    """The daemon died during a turn (its state dir copied as it was then):
    the next one's background load holds the turn open and starts a worker
    for it unasked, as the eager load did (the echo worker uses no steps:
    the turn then fails, saying the daemon stopped)."""
    import shutil

    first = tmp_path / "first"
    spawner = FakeSpawner()
    mgr = SessionManager(parse_config(CONFIG, "test"), first, spawner)

    async def crash() -> None:
        mgr.load_all()
        await mgr.create(UID, "quiet", "echo", {})
        busy = await mgr.create(UID, "busy", "echo", {})
        assert busy.worker is not None
        spawner.workers[busy.worker.pid].behaviour = lambda w, msg: isinstance(msg, m.Input)  # never answers
        await mgr.send(busy, "never done", None)  # the input is durable
        shutil.copytree(first / "sessions", tmp_path / "sessions")  # what a SIGKILL now leaves
        await mgr.shutdown(0.0)

    _run(crash)
    again, store, spawner = _held(tmp_path)

    async def body() -> None:
        again.start_loading()
        store.gate.set()
        await again.loaded()
        busy = again.sessions["busy"]
        await until(lambda: busy.state is State.IDLE and busy.current_turn is None, "the held turn to end")
        assert [w.got[0].session for w in spawner.workers.values()] == ["busy"]  # (quiet stays hibernated)
        assert again.sessions["quiet"].state is State.HIBERNATED
        _, loaded = again.store.load("busy")
        assert loaded.open_input is None and loaded.turns == 1
        await again.shutdown(1.0)

    _run(body)


@pytest.mark.component
def test_a_damaged_session_found_by_the_background_load_is_damaged(tmp_path: Path) -> None:
    echo_sessions(tmp_path, ["good", "bad"], UID)
    log = tmp_path / "sessions" / "bad" / "log.0"
    data = bytearray(log.read_bytes())
    data[20] ^= 0x40  # inside the Meta record, with intact records after it
    log.write_bytes(bytes(data))
    mgr, store, _ = _held(tmp_path)

    async def body() -> None:
        mgr.start_loading()
        store.gate.set()
        await mgr.loaded()
        assert mgr.sessions["bad"].state is State.DAMAGED and "corrupt" in (mgr.sessions["bad"].error or "")
        assert mgr.sessions["good"].state is State.HIBERNATED
        await mgr.shutdown(1.0)

    _run(body)
    assert log.read_bytes() == bytes(data)  # kept as it is, for repair


@pytest.mark.component
def test_loading_a_session_whose_files_need_nothing_writes_nothing(tmp_path: Path) -> None:
    """No fence taken, no file written or fsync'd at start-up: its first
    write takes the session's next generation (durably), and a writer that
    loaded it since is the one that writes."""
    echo_sessions(tmp_path, ["s"], UID)
    sdir = tmp_path / "sessions" / "s"
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sdir.iterdir()}
    store = FileStateStore(tmp_path / "sessions")
    try:
        log, loaded = store.open_stored("s")
        assert loaded.turns == 1
        assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sdir.iterdir()} == before
        # Its first write takes the next generation first.
        log.append(Mark(seq=2), durable=True)
        assert read_fence(sdir) == 2
        # A load since (a repair's, fenced at once) wins over this one.
        newer, _ = store.load("s")
        with pytest.raises(Fenced):
            log.append(Mark(seq=3), durable=True)
        newer.append(Mark(seq=4), durable=True)
        assert store.load("s")[1].seq == 4 and read_fence(sdir) == 4
    finally:
        store.close()


@pytest.mark.component
def test_the_metrics_count_the_sessions_not_loaded_yet() -> None:
    from supervisor.ops.metrics import PrometheusRecorder

    def gauge(loading: tuple[int, int] | None) -> str:
        text = PrometheusRecorder(lambda: [], lambda: 0, loading=lambda: loading).exposition()[0].decode()
        return next(line for line in text.splitlines() if line.startswith("sessiond_sessions_loading "))

    assert gauge((40, 100)) == "sessiond_sessions_loading 60.0"
    assert gauge(None) == "sessiond_sessions_loading 0.0"


# ---------------------------------------------------------------- a real daemon


@pytest.mark.process
def test_a_daemon_answers_before_its_load_is_done(tmp_path: Path) -> None:
    """The background load is stuck on one session (its log a FIFO nothing
    writes to yet); meanwhile the daemon answers ping and stats (loading 0
    of N), serves a turn on a session it had not loaded, refuses a create
    of an existing id, and lists what it has with a `loading` note; once
    the read goes through, everything is there."""
    d = Daemon(tmp_path / "d", '[daemon]\nsession_uid_range = ""\nallow_root_tools = true\n')
    ids = [f"s{i:03d}" for i in range(300)]
    echo_sessions(d.state_dir, ["aaa-held", *ids], os.getuid())
    held = d.state_dir / "sessions" / "aaa-held" / "log.0"
    data = held.read_bytes()
    held.unlink()
    os.mkfifo(held, 0o600)
    try:
        d.start()
        stats = json.loads(d.ctl("--json", "stats").stdout)
        assert stats["loading"] is not None and stats["sessions"] == 0
        assert stats["loading"]["total"] in (0, 301)  # (0: not an admin here)
        sent = d.ctl("send", "s150", "after")
        assert sent.returncode == 0 and sent.stdout.strip() == "2: after", sent
        refused = d.ctl("create", "--id", "s007")
        assert refused.returncode == 1 and "already exists" in refused.stderr, refused
        listed = d.ctl("--json", "ls")
        partial = json.loads(listed.stdout)
        assert partial["loading"] is not None and len(partial["sessions"]) < 301
        assert "s150" in {s["id"] for s in partial["sessions"]}
        assert "still loading" in d.ctl("ls").stderr
        full = d.ctl("--json", "ls", "--sort", "id")  # (the full path: --sort is not the one-shot path's)
        assert json.loads(full.stdout)["loading"] == partial["loading"], full
        fd = os.open(held, os.O_WRONLY)  # the loader's read goes through
        os.write(fd, data)
        os.close(fd)

        def complete() -> bool:
            listed = json.loads(d.ctl("--json", "ls").stdout)
            return "loading" not in listed and len(listed["sessions"]) == 301

        wait_for(complete, 30, "the load to end")
        assert json.loads(d.ctl("--json", "stats").stdout)["loading"] is None
        assert d.ctl("send", "s007", "late").stdout.strip() == "2: late"
    finally:
        d.cleanup()
