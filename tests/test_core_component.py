"""The daemon's core in-process (component tier): SessionManager and its
parts over the in-process spawner and the in-memory store.  No daemon, no
fork: turns, crashes, restarts, the restart intensity, the worker-message
boundary, sub-agents and reload, each in milliseconds."""

from __future__ import annotations

import pytest

import asyncio
import dataclasses
import errno
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from fakespawner import FakeRemoteSpawner, FakeSpawner, FakeWorker
from ipc import messages as m
from ipc.settings import SessionSettings
from supervisor.core.admission import Admission, Identities
from supervisor.config import parse_config
from supervisor.errors import Capacity, NoSpace
from supervisor.core.manager import SessionManager
from supervisor.store.memory import InMemoryStateStore
from supervisor.core.session import Session, valid_session_id
from supervisor.core.workspaces import Workspaces
from polling import until


pytestmark = pytest.mark.component

_event = msgspec.msgpack.Decoder(m.Event)

FAST = {
    "agent": {"worker": {"restart_backoff_initial_ms": 1, "restart_backoff_max_ms": 2,
                         "max_restart_attempts": 2, "restart_window_secs": 60.0}},
    "daemon": {"stop_grace_secs": 0.2},
    # No workspace image per session (as root, "auto" makes one): the walk.
    "tools": {"disk_quota": "measured"},
}


class Recorder:
    """A Subscriber that keeps every event it is sent."""

    uid = 0
    event_tags = frozenset({"reasoning"})

    def __init__(self) -> None:
        self.events: list[Any] = []

    def deliver(self, frame: bytes | bytearray) -> None:
        self.events.append(_event.decode(bytes(frame)[4:]))

    def of(self, kind: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def _core(tmp_path: Path, config: dict[str, Any] | None = None) -> tuple[SessionManager, FakeSpawner, InMemoryStateStore]:
    spawner, store = FakeSpawner(), InMemoryStateStore()
    mgr = SessionManager(parse_config(config or FAST, "test"), tmp_path, spawner, store=store)
    mgr.load_all()
    return mgr, spawner, store


def _run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 20))




def _worker(spawner: FakeSpawner, session: Session) -> FakeWorker:
    assert session.worker is not None
    return spawner.workers[session.worker.pid]


def test_a_turn_is_committed_before_it_is_done(tmp_path: Path) -> None:
    mgr, spawner, store = _core(tmp_path)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        watcher = Recorder()
        mgr.attach(session, watcher, None)
        accepted = await mgr.send(session, "hello", None)
        assert accepted.turn == 1
        await until(lambda: watcher.of(m.TurnDone), "TurnDone")
        assert watcher.of(m.TurnDone)[0].reply == "1: hello"
        # The commit is in the store, synced, before TurnDone was sent.
        handle, loaded = store.load("s")
        assert loaded.turns == 1
        assert session.state.value == "idle"

    _run(body)


def test_a_crash_mid_turn_fails_the_turn_restarts_and_gives_up_past_the_intensity(tmp_path: Path) -> None:
    mgr, spawner, _ = _core(tmp_path)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        watcher = Recorder()
        mgr.attach(session, watcher, None)
        for round_ in range(1, 4):
            worker = _worker(spawner, session)
            worker.behaviour = lambda w, msg: isinstance(msg, m.Input) and (w.exit(sig=9) or True)
            await mgr.send(session, f"crash {round_}", None)
            await until(lambda: len(watcher.of(m.TurnFailed)) == round_, "the failed turn")
            if round_ < 3:
                await until(lambda: session.state.value == "idle", "the restart")
        await until(lambda: session.state.value == "failed", "the give-up")
        assert "SIGKILL" in watcher.of(m.TurnFailed)[0].reason
        assert [e.kind for e in watcher.of(m.LimitExceeded)] == ["restarts"]
        assert session.restarts == 2 and session.last_exit is not None
        assert session.last_exit.reason == "crashed"

    _run(body)


def test_a_bug_handling_a_worker_message_fails_the_turn_and_keeps_the_session(tmp_path: Path) -> None:
    mgr, spawner, _ = _core(tmp_path)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        watcher = Recorder()
        mgr.attach(session, watcher, None)
        pid = session.worker.pid if session.worker else 0
        real_commit = mgr.ledger.commit

        def broken(*args: Any) -> None:
            raise KeyError("a bug in the daemon")

        mgr.ledger.commit = broken  # type: ignore[method-assign]
        await mgr.send(session, "one", None)
        await until(lambda: watcher.of(m.TurnFailed), "the failed turn")
        assert "internal error" in watcher.of(m.TurnFailed)[0].reason
        mgr.ledger.commit = real_commit  # type: ignore[method-assign]
        await until(lambda: session.state.value == "idle", "idle again")
        assert session.worker is not None and session.worker.pid == pid  # no restart needed
        await mgr.send(session, "two", None)
        await until(lambda: watcher.of(m.TurnDone), "the next turn")

    _run(body)


def test_sub_agent_ids_are_always_valid(tmp_path: Path) -> None:
    mgr, _, _ = _core(tmp_path)

    async def body() -> None:
        for parent_id in ("a" * 64, "a" + "-" * 63, "a" + "." * 63, "x"):
            parent = await mgr.create(1000, parent_id, "echo", {})
            for _ in range(20):
                child = mgr.subagents._child_id(parent)
                assert valid_session_id(child) and child.startswith(parent_id[:8]), child

    _run(body)


def test_a_sub_agent_whose_create_fails_leaves_no_trace_in_its_parent(tmp_path: Path) -> None:
    mgr, spawner, store = _core(tmp_path)

    async def body() -> None:
        parent = await mgr.create(1000, "p", "echo", {})
        spawner.next_behaviour = (
            lambda w, msg: isinstance(msg, m.Boot) and (w.send(m.BootFailed(reason="no")) or w.exit(code=3) or True)
        )
        pw = _worker(spawner, parent)
        assert parent.worker is not None
        await mgr.subagents.run(parent, parent.worker, m.SpawnAgent(turn=1, request_id="r1", task="t"))
        await until(lambda: [msg for msg in pw.got if isinstance(msg, m.SpawnResult)], "the answer")
        result = [msg for msg in pw.got if isinstance(msg, m.SpawnResult)]
        assert not result[0].ok and "could not start" in result[0].reason
        assert not parent.children and set(mgr.sessions) == {"p"} and store.ids() == ["p"]

    _run(body)


def test_a_reload_reaches_live_workers(tmp_path: Path) -> None:
    mgr, spawner, _ = _core(tmp_path)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {"agent.max_turns": 5})
        lowered = dict(FAST)
        lowered["agent"] = {**FAST["agent"], "max_turns": 3}
        mgr.reload(parse_config(lowered, "test"))
        worker = _worker(spawner, session)
        await until(lambda: any(isinstance(x, m.Reconfigure) for x in worker.got), "Reconfigure")
        sent = next(x for x in worker.got if isinstance(x, m.Reconfigure))
        settings = msgspec.msgpack.decode(sent.settings, type=SessionSettings)
        assert settings.agent.max_turns == 3 == session.settings.agent.max_turns  # the override pulled back

    _run(body)


def test_the_store_holds_what_the_ledger_acknowledged(tmp_path: Path) -> None:
    mgr, spawner, store = _core(tmp_path)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        for i in range(5):
            await mgr.send(session, f"t{i}", None)
            await until(lambda: session.state.value == "idle", "the turn's end")
        store.crash()  # only what was synced survives
        _, loaded = store.load("s")
        assert loaded.turns == 5

    _run(body)


def test_a_full_session_uid_range_refuses_with_capacity(tmp_path: Path) -> None:
    span = range(1879113725, 1879113728)  # three uids no user has here
    config = parse_config(FAST, "test")
    spaces = Workspaces(lambda: config, tmp_path, Admission(lambda: config, Identities(session_uids=span)))
    held: set[int | None] = set()  # (the registry's run uids)
    for _ in span[:-1]:  # the last is kept for listing MCP servers' tools (supervisor.spawn.mcplist)
        uid = spaces.allocate_uid(held)
        assert uid in span[:-1] and uid not in held
        held.add(uid)
    with pytest.raises(Capacity, match="session_uid_range"):
        spaces.allocate_uid(held)


def test_the_senders_events_follow_its_accepted_and_a_long_hold_lets_go(tmp_path: Path) -> None:
    config = {**FAST, "daemon": {**FAST["daemon"], "event_retention": 16}}
    mgr, spawner, _ = _core(tmp_path, config)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        watcher, sender = Recorder(), Recorder()
        mgr.attach(session, watcher, None)
        order: list[str] = []
        sender.deliver = lambda frame: order.append(type(_event.decode(bytes(frame)[4:])).__name__)  # type: ignore[method-assign]
        accepted = await mgr.send(session, "hello", sender, lambda a: order.append("Accepted"))
        await until(lambda: "TurnDone" in order, "the turn")
        assert order[0] == "Accepted" and order[1:3] == ["StateChanged", "TextDelta"], order
        assert watcher.of(m.StateChanged)[-1].seq > accepted.seq  # the watcher was not held

        # A hold that lasts (a disk that stalls the flush) keeps at most
        # event_retention frames, then lets them go in order.
        held = Recorder()
        mgr.events.hold(session, held)
        for i in range(20):
            mgr.events.emit(session, m.TextDelta(session="s", seq=mgr.events.next_seq(session), turn=9, text=str(i)))
            assert len(held.events) == (0 if i < 15 else i + 1)
        mgr.events.release(session)
        assert [e.text for e in held.events] == [str(i) for i in range(20)]
        assert not session.held

    _run(body)


def _held_bytes(value: Any, depth: int = 3) -> int:
    """The bytes `value` holds, through containers and structs, a few levels deep."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if depth == 0:
        return 0
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif hasattr(type(value), "__struct_fields__"):
        items = [getattr(value, f) for f in type(value).__struct_fields__]
    else:
        return 0
    return sum(_held_bytes(v, depth - 1) for v in items)


def test_a_running_turn_s_steps_are_held_in_the_store_and_read_back_to_resume_it(tmp_path: Path) -> None:
    """Steps overlap: three begin, the last ends first, the worker dies.  The
    daemon holds byte counts and the keys in flight, never a result; the
    restarted worker gets the journaled one by its number, and the two in
    flight, read back from the store."""
    mgr, spawner, store = _core(tmp_path)
    big = b"\x01" * (1 << 20)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        watcher = Recorder()
        mgr.attach(session, watcher, None)

        def steps(w: FakeWorker, msg: m.ToWorker) -> bool:
            if not isinstance(msg, m.Input) or msg.resumed is not None:
                return False
            w.send(m.StepBegun(turn=msg.turn, n=0, key="a"))
            w.send(m.StepBegun(turn=msg.turn, n=1, key="b", durable=True))
            w.send(m.StepBegun(turn=msg.turn, n=2, key="c", durable=True))
            w.send(m.StepDone(turn=msg.turn, n=2, key="c", result=big))
            return True

        first = _worker(spawner, session)
        first.behaviour = steps
        await mgr.send(session, "go", None)
        saved = lambda: [x for x in first.got if isinstance(x, m.StepSaved)]  # noqa: E731
        await until(lambda: len(saved()) == 3, "the starts it waits on, and the end, durable")
        assert sorted((x.n, x.begun, x.error) for x in saved()) == [(1, True, ""), (2, False, ""), (2, True, "")]
        assert session.step_records == 4 and session.steps_flying == {0: "a", 1: "b"}
        assert session.step_bytes > len(big)
        held = {f.name: _held_bytes(getattr(session, f.name)) for f in dataclasses.fields(session)}
        assert max(held.values()) < len(big), held  # (the old daemon kept `steps`: every result)
        first.exit(sig=9)
        await until(lambda: session.worker is not None and session.worker.pid != first.pid
                     and any(isinstance(x, m.Input) for x in _worker(spawner, session).got), "the resumed input")
        resumed = next(x for x in _worker(spawner, session).got if isinstance(x, m.Input)).resumed
        assert resumed is not None
        assert [(s.n, s.key, s.result == big) for s in resumed.steps] == [(2, "c", True)]
        assert resumed.in_flight == [m.StepInFlight(n=0, key="a"), m.StepInFlight(n=1, key="b")]
        assert (resumed.step, resumed.running, resumed.uncertain) == (0, "a", False)
        await until(lambda: watcher.of(m.TurnDone), "the turn's end")
        notice = next(e for e in watcher.of(m.Notice) if e.kind == "turn_resumed")
        assert notice.data["in_flight"] == ["a", "b"] and notice.data["step"] == 0
        assert session.step_records == 0 and not session.steps_flying

    _run(body)


def test_a_turn_whose_steps_cannot_be_read_back_fails_and_the_session_goes_on(tmp_path: Path) -> None:
    mgr, spawner, store = _core(tmp_path)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        watcher = Recorder()
        mgr.attach(session, watcher, None)

        def one_step_then_die(w: FakeWorker, msg: m.ToWorker) -> bool:
            if not isinstance(msg, m.Input):
                return False
            w.send(m.StepDone(turn=msg.turn, n=0, key="a", result=b"\xa1A"))
            asyncio.get_running_loop().call_later(0.01, w.exit, None, 9)
            return True

        _worker(spawner, session).behaviour = one_step_then_die
        real = session.store.read_steps_soon

        def unreadable(turn: int) -> asyncio.Future[Any]:
            fut = real(turn)
            broken: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            fut.add_done_callback(lambda _: broken.set_exception(OSError(5, "Input/output error")))
            return broken

        session.store.read_steps_soon = unreadable  # type: ignore[method-assign]
        await mgr.send(session, "go", None)
        await until(lambda: watcher.of(m.TurnFailed), "the failed turn")
        assert "its steps could not be read back: [Errno 5] Input/output error" in watcher.of(m.TurnFailed)[0].reason
        await until(lambda: session.state.value == "idle", "idle again")
        session.store.read_steps_soon = real  # type: ignore[method-assign]
        await mgr.send(session, "again", None)
        await until(lambda: watcher.of(m.TurnDone), "the next turn")

    _run(body)


def test_a_worker_that_said_ready_and_exits_with_code_3_crashed_it_did_not_fail_to_boot(tmp_path: Path) -> None:
    """The finding: a handler that exits mid-turn with code 3 (the worker's
    boot-failure code, EXIT_BOOT_FAILED) was told as `boot_failed (exit
    code 3)`.  A worker that said Ready and then exited crashed."""
    mgr, spawner, _ = _core(tmp_path)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        watcher = Recorder()
        mgr.attach(session, watcher, None)
        _worker(spawner, session).behaviour = lambda w, msg: isinstance(msg, m.Input) and (w.exit(code=3) or True)
        await mgr.send(session, "exit", None)
        await until(lambda: watcher.of(m.TurnFailed), "the failed turn")
        assert session.last_exit is not None and session.last_exit.reason == "crashed"
        assert session.last_exit.code == 3 and "boot_failed" not in watcher.of(m.TurnFailed)[0].reason

    _run(body)


def test_a_worker_lost_with_its_node_is_node_lost_even_after_a_heartbeat_kill(tmp_path: Path) -> None:
    """The finding (a chaos run, 8 resumes of 11): a node's loss was told to
    the client and to the model as `killed_heartbeat`, because the worker's
    silence was noticed first and its kill (which could not land) was
    recorded as the reason.  The loss of the node is why."""
    from ipc.contract import ExitReason

    spawner, store = FakeRemoteSpawner(), InMemoryStateStore()  # workers on other machines (cluster mode)
    mgr = SessionManager(parse_config(FAST, "test"), tmp_path, spawner, store=store)
    mgr.load_all()

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        watcher = Recorder()
        mgr.attach(session, watcher, None)
        worker = session.worker
        assert worker is not None
        _worker(spawner, session).behaviour = lambda w, msg: isinstance(msg, m.Input)  # the turn runs on
        await mgr.send(session, "x", None)
        spawner.kill_tree = lambda *args, **kwargs: None  # type: ignore[method-assign]  # its node is gone
        mgr.workers.kill(session, worker, ExitReason.KILLED_HEARTBEAT, "no heartbeat for 0.6s")
        spawner.on_worker_lost(worker.pid, "node_lost: lost the node host on 10.0.0.7 (ActorDiedError)")
        await until(lambda: watcher.of(m.TurnFailed), "the failed turn")
        assert session.last_exit is not None and session.last_exit.reason == "node_lost"
        assert session.last_exit.detail == "lost the node host on 10.0.0.7 (ActorDiedError)"
        assert watcher.of(m.TurnFailed)[0].reason.startswith("node_lost: lost the node host on 10.0.0.7")

    _run(body)


def test_an_input_the_store_could_not_save_is_never_resumed_on_the_next_worker(tmp_path: Path) -> None:
    """Issue 32: the sender of an input whose flush failed (a full disk, a
    database away) is told `no_space`; its worker, ahead of the log, is
    restarted from it, uncharged.  A handler that marks steps had that
    refused turn held open and resumed on the next worker, so a turn its
    client was told was not accepted ran to the end and was reported done."""
    mgr, spawner, store = _core(tmp_path)

    def marks_steps(w: FakeWorker, msg: m.ToWorker) -> bool:
        if isinstance(msg, m.Boot):
            w.turns = msg.turns
            w.send(m.Ready(pid=w.pid, uses_steps=True))
            return True
        # (It works on it; a resumed one it ends at once.)
        return isinstance(msg, m.Input) and msg.text == "refused" and msg.resumed is None

    async def body() -> None:
        spawner.next_behaviour = marks_steps
        session = await mgr.create(1000, "s", "echo", {})
        watcher = Recorder()
        mgr.attach(session, watcher, None)
        first = _worker(spawner, session)
        spawner.next_behaviour = marks_steps
        store.flush_error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with pytest.raises(NoSpace):
            await mgr.send(session, "refused", None)
        store.flush_error = None
        await until(lambda: session.worker is not None and session.worker.pid != first.pid
                     and session.state.value == "idle", "the restart from the log")
        assert not [x for x in _worker(spawner, session).got if isinstance(x, m.Input)], "the refused turn resumed"
        assert not watcher.of(m.TurnDone)
        assert session.policy is not None and session.policy.not_charged().attempts_in_window == 0
        accepted = await mgr.send(session, "next", None)
        await until(lambda: watcher.of(m.TurnDone), "the next turn")
        assert [e.turn for e in watcher.of(m.TurnDone)] == [accepted.turn]

    _run(body)
