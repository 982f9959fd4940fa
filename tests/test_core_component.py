"""The daemon's core in-process (component tier): SessionManager and its
parts over the in-process spawner and the in-memory store.  No daemon, no
fork: turns, crashes, restarts, the restart intensity, the worker-message
boundary, sub-agents and reload, each in milliseconds."""

from __future__ import annotations

import pytest

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from fakespawner import FakeSpawner, FakeWorker
from ipc import messages as m
from ipc.settings import SessionSettings
from supervisor.config import parse_config
from supervisor.errors import Capacity
from supervisor.core.manager import SessionManager
from supervisor.store.memory import InMemoryStateStore
from supervisor.core.session import Session, valid_session_id
from supervisor.core.workspaces import Workspaces


pytestmark = pytest.mark.component

_event = msgspec.msgpack.Decoder(m.Event)

FAST = {
    "agent": {"worker": {"restart_backoff_initial_ms": 1, "restart_backoff_max_ms": 2,
                         "max_restart_attempts": 2, "restart_window_secs": 60.0}},
    "daemon": {"stop_grace_secs": 0.2},
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


async def _until(predicate: Callable[[], Any], what: str) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


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
        await _until(lambda: watcher.of(m.TurnDone), "TurnDone")
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
            await _until(lambda: len(watcher.of(m.TurnFailed)) == round_, "the failed turn")
            if round_ < 3:
                await _until(lambda: session.state.value == "idle", "the restart")
        await _until(lambda: session.state.value == "failed", "the give-up")
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
        await _until(lambda: watcher.of(m.TurnFailed), "the failed turn")
        assert "internal error" in watcher.of(m.TurnFailed)[0].reason
        mgr.ledger.commit = real_commit  # type: ignore[method-assign]
        await _until(lambda: session.state.value == "idle", "idle again")
        assert session.worker is not None and session.worker.pid == pid  # no restart needed
        await mgr.send(session, "two", None)
        await _until(lambda: watcher.of(m.TurnDone), "the next turn")

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
        await _until(lambda: [msg for msg in pw.got if isinstance(msg, m.SpawnResult)], "the answer")
        result = [msg for msg in pw.got if isinstance(msg, m.SpawnResult)]
        assert not result[0].ok and "could not start" in result[0].reason
        assert parent.children == [] and set(mgr.sessions) == {"p"} and store.ids() == ["p"]

    _run(body)


def test_a_reload_reaches_live_workers(tmp_path: Path) -> None:
    mgr, spawner, _ = _core(tmp_path)

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {"agent.max_turns": 5})
        lowered = dict(FAST)
        lowered["agent"] = {**FAST["agent"], "max_turns": 3}
        mgr.reload(parse_config(lowered, "test"))
        worker = _worker(spawner, session)
        await _until(lambda: any(isinstance(x, m.Reconfigure) for x in worker.got), "Reconfigure")
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
            await _until(lambda: session.state.value == "idle", "the turn's end")
        store.crash()  # only what was synced survives
        _, loaded = store.load("s")
        assert loaded.turns == 5

    _run(body)


def test_a_full_session_uid_range_refuses_with_capacity(tmp_path: Path) -> None:
    span = range(1879113726, 1879113728)  # two uids no user has here
    spaces = Workspaces(lambda: parse_config(FAST, "test"), tmp_path, None, span)
    held: list[Any] = []
    for _ in span:
        uid = spaces.allocate_uid(held)
        assert uid in span and uid not in {s.meta.run_uid for s in held}
        held.append(SimpleNamespace(meta=SimpleNamespace(run_uid=uid)))
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
        await _until(lambda: "TurnDone" in order, "the turn")
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
        assert session.held == {}

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
        await _until(lambda: watcher.of(m.TurnFailed), "the failed turn")
        assert session.last_exit is not None and session.last_exit.reason == "crashed"
        assert session.last_exit.code == 3 and "boot_failed" not in watcher.of(m.TurnFailed)[0].reason

    _run(body)


def test_a_worker_lost_with_its_node_is_node_lost_even_after_a_heartbeat_kill(tmp_path: Path) -> None:
    """The finding (a chaos run, 8 resumes of 11): a node's loss was told to
    the client and to the model as `killed_heartbeat`, because the worker's
    silence was noticed first and its kill (which could not land) was
    recorded as the reason.  The loss of the node is why."""
    from ipc.contract import ExitReason

    spawner, store = FakeSpawner(), InMemoryStateStore()
    spawner.on_worker_lost = None  # type: ignore[attr-defined]  # workers on other machines (cluster mode)
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
        spawner.on_worker_lost(worker.pid, "node_lost: lost the node host on 10.0.0.7 (ActorDiedError)")  # type: ignore[attr-defined]
        await _until(lambda: watcher.of(m.TurnFailed), "the failed turn")
        assert session.last_exit is not None and session.last_exit.reason == "node_lost"
        assert session.last_exit.detail == "lost the node host on 10.0.0.7 (ActorDiedError)"
        assert watcher.of(m.TurnFailed)[0].reason.startswith("node_lost: lost the node host on 10.0.0.7")

    _run(body)
