"""Many sessions in one daemon (issue 32): what a hibernated session costs
the core, work per create and per sweep that does not grow with the
sessions at rest, and live slots freed ahead of demand.  In-process over
the in-process spawner (component tier), and the pure parts (pure)."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fakespawner import FakeSpawner, FakeWorker
from ipc import messages as m
from supervisor.config import ConfigError, parse_config
from supervisor.core import fdbudget
from supervisor.core.fdbudget import FdBudget
from supervisor.core.manager import SessionManager
from supervisor.core.registry import Registry
from supervisor.core.session import Session
from supervisor.core.slots import LiveSlots
from supervisor.core.states import State
from supervisor.errors import Capacity
from supervisor.store.memory import InMemoryStateStore
from polling import until

_until = functools.partial(until, timeout=20.0)

_event = msgspec.msgpack.Decoder(m.Event)


def _config(live: int, **limits: Any) -> dict[str, Any]:
    return {
        "agent": {"limits": {"max_concurrent_sessions": live, **limits},
                  "worker": {"restart_backoff_initial_ms": 1, "restart_backoff_max_ms": 2}},
        "daemon": {"stop_grace_secs": 0.2, "max_sessions_per_uid": 100_000},
        "tools": {"disk_quota": "measured"},
    }


class Recorder:
    """A client attached to sessions, keeping what it is sent."""

    uid = 0
    event_tags: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.events: list[Any] = []

    def deliver(self, frame: bytes | bytearray) -> None:
        self.events.append(_event.decode(bytes(frame)[4:]))


def _run(body: Callable[[], Awaitable[None]], secs: float = 60) -> None:
    asyncio.run(asyncio.wait_for(body(), secs))




async def _turn(mgr: SessionManager, session: Session, text: str = "hi") -> None:
    await mgr.send(session, text, None)
    await _until(lambda: session.state is State.IDLE, f"{session.id}'s turn to end")


def _settled(mgr: SessionManager) -> bool:
    """No hibernation on its way, no worker left over the ceiling."""
    return not mgr.slots._hibernating and mgr.slots.count() <= mgr.slots.ceiling()


def _hibernated_why(mgr: SessionManager, session: Session) -> str | None:
    """Why it last went to `hibernated` (the `logs` entry), None if it never did."""
    why = None
    for _, ev in mgr.events.lifecycle(session):
        if isinstance(ev, m.StateChanged) and ev.new == State.HIBERNATED:
            why = ev.reason
    return why


def _traced() -> int:
    gc.collect()
    return sum(s.size for s in tracemalloc.take_snapshot().statistics("filename"))


# ---------------------------------------------------------------- what a hibernated session holds

# Traced bytes per hibernated session in the core, its file store included
# (and what the test's fakes leave, a few hundred): the old core held
# 8.8 KiB for a created session after one turn, 5.6 KiB for one loaded at
# start (an empty ring and lifecycle deque each, decoded lifecycle events, a
# dozen empty containers, a store object with Paths); now 2-3 KiB.  The
# bench (bench/scale.py) measures the daemon's RSS.
HIBERNATED_BYTES = 4 * 1024


@pytest.mark.component
def test_a_hibernated_session_holds_little_of_the_daemon_s_memory_and_no_fd(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # (the info lines of a create and a hibernation would be kept by the
    # test's log capture, where an earlier test left the level at info)
    caplog.set_level(logging.WARNING, logger="sessiond")
    live, extra = 8, 160
    spawner = FakeSpawner()
    mgr = SessionManager(parse_config(_config(live), "test"), tmp_path, spawner)
    mgr.load_all()

    def forget_dead_fakes() -> None:  # (the fake spawner keeps every worker it made)
        spawner.workers = {pid: w for pid, w in spawner.workers.items() if w.alive}

    async def made() -> None:
        for _ in range(live):
            await _turn(mgr, await mgr.create(0, None, "echo", {}))
        await _until(lambda: _settled(mgr), "the first sessions")
        forget_dead_fakes()
        tracemalloc.start()
        try:
            before = _traced()
            for _ in range(extra):  # each one a turn, each making room: `extra` hibernated
                await _turn(mgr, await mgr.create(0, None, "echo", {}))
            await _until(lambda: _settled(mgr) and sum(1 for s in mgr.sessions.values() if s.worker is None)
                         >= extra, "the hibernations")
            forget_dead_fakes()
            per = (_traced() - before) / extra
        finally:
            tracemalloc.stop()
        assert per < HIBERNATED_BYTES, f"{per:.0f} bytes per hibernated session"
        await mgr.shutdown(1.0)

    _run(made)

    # Loaded at start: every session hibernated, no fd of the daemon's held for any.
    fds = len(os.listdir("/proc/self/fd"))
    tracemalloc.start()
    try:
        before = _traced()
        again = SessionManager(parse_config(_config(live), "test"), tmp_path, FakeSpawner())
        again.load_all()
        per = (_traced() - before) / len(again.sessions)
    finally:
        tracemalloc.stop()
    assert len(again.sessions) == live + extra
    assert {s.state for s in again.sessions.values()} == {State.HIBERNATED}
    assert per < HIBERNATED_BYTES, f"{per:.0f} bytes per loaded session"
    assert len(os.listdir("/proc/self/fd")) - fds < 16  # (the journal, the spend ledger: not per session)
    again.store.close()


@pytest.mark.component
def test_a_hibernated_session_keeps_its_logs_and_lets_go_of_its_ring(tmp_path: Path) -> None:
    """`sessionctl logs` is the same before and after the lifecycle is
    packed (and compressed: hundreds of turns); the ring goes at
    hibernation: an attach from an older seq is told the gap (then reads
    history, as after a daemon restart) and follows the revived session."""
    mgr = SessionManager(parse_config(_config(4), "test"), tmp_path, FakeSpawner(),
                         store=InMemoryStateStore())
    mgr.load_all()

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        for i in range(300):
            await _turn(mgr, session, f"t{i}")
        before = mgr.events.lifecycle(session)
        assert len(before) == 500 and session.ring is not None  # (the last 500 kept)
        seen = session.seq
        await mgr.slots.hibernate(session, "test")
        assert isinstance(session.lifecycle, bytes) and len(session.lifecycle) < 16 * 1024
        after = mgr.events.lifecycle(session)
        assert after[:-1] == before[1:]  # the same events, and its hibernation
        assert isinstance(after[-1][1], m.StateChanged) and after[-1][1].new == State.HIBERNATED
        assert session.ring is None and session.ring_bytes == 0 and mgr.events.retained_bytes == 0
        client = Recorder()
        mgr.attach(session, client, seen)
        assert [type(e) for e in client.events] == [m.Gap]
        await _turn(mgr, session, "again")
        assert any(isinstance(e, m.TurnDone) and e.reply.endswith("again") for e in client.events)
        assert isinstance(mgr.events.lifecycle(session)[-1][1], m.StateChanged)

    _run(body)


@pytest.mark.component
def test_a_session_keeps_a_lock_only_while_a_request_holds_or_waits_for_it(tmp_path: Path) -> None:
    """The lock was made at a session's first request and kept until it
    hibernated (and let go of then by reading asyncio.Lock's private
    `_waiters`): now it goes with its last user, holder or waiter, a
    cancelled waiter too; two requests at once still share one."""
    mgr = SessionManager(parse_config(_config(4), "test"), tmp_path, FakeSpawner(),
                         store=InMemoryStateStore())
    mgr.load_all()

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        await _turn(mgr, session)
        assert session._lock is None and not session.lock_held
        order: list[str] = []
        go = asyncio.Event()

        async def holder() -> None:
            async with session.locked():
                order.append("held")
                await go.wait()
            order.append("let go")

        async def waiter(name: str) -> None:
            async with session.locked():
                order.append(name)

        first = asyncio.create_task(holder())
        await _until(lambda: order == ["held"], "the holder")
        lock = session._lock
        second, third = asyncio.create_task(waiter("second")), asyncio.create_task(waiter("third"))
        await asyncio.sleep(0)
        third.cancel()
        assert session.lock_held and session._lock is lock
        go.set()
        await asyncio.gather(first, second, return_exceptions=True)
        assert order == ["held", "let go", "second"] and third.cancelled()
        assert session._lock is None and session._lock_users == 0 and not session.lock_held
        await mgr.slots.hibernate(session, "test")
        await _turn(mgr, session, "again")
        await mgr.stop(session)
        assert session._lock is None and session._lock_users == 0

    _run(body)


@pytest.mark.component
def test_a_create_waits_for_a_slot_a_hibernation_on_its_way_frees(tmp_path: Path) -> None:
    """The finding (20 users, each creating 100 sessions at once, 200
    slots, sessions at their own uids): creates were refused `all 200 live
    sessions are busy` while idle sessions were on their way to
    hibernation, each taken by another create or ahead of demand, so that
    no idle one was left to take.  A slot about to come free is waited
    for; a daemon whose slots are all busy still refuses at once."""
    config = _config(2)
    config["daemon"]["max_live_sessions_per_uid"] = 2
    mgr = SessionManager(parse_config(config, "test"), tmp_path, FakeSpawner(), store=InMemoryStateStore())
    mgr.load_all()

    async def body() -> None:
        idle = await mgr.create(1000, "idle", "echo", {})
        held = await mgr.create(1000, "held", "echo", {})
        go = asyncio.Event()

        async def hold() -> None:  # a request holds it: it cannot be taken
            async with held.locked():
                await go.wait()

        holding = asyncio.create_task(hold())
        await _until(lambda: held.lock_held, "the hold")
        mgr.slots.hibernate_soon(idle, "test: ahead of demand")  # on its way, not gone yet
        assert idle.worker is not None and mgr.slots.count() == 2
        made = await mgr.create(1000, "new", "echo", {})
        assert made.worker is not None and idle.state is State.HIBERNATED
        with pytest.raises(Capacity, match="all 2 live sessions are busy|already has 2 live sessions"):
            async with made.locked():
                await mgr.create(1000, "refused", "echo", {})
        go.set()
        await holding
        await mgr.shutdown(1.0)

    _run(body)


@pytest.mark.component
def test_a_waiting_create_takes_a_slot_freed_any_way_not_only_by_the_hibernation_it_waits_for(
        tmp_path: Path) -> None:
    """A create waiting for a hibernation on its way (above) was woken only
    when one ended: a slot freed meanwhile by a crash, a stop or a removal
    went unused until then.  Here the hibernation cannot end (its session's
    lock is held); another session's worker crashes, with no restart left."""
    config = _config(2)
    config["daemon"]["max_live_sessions_per_uid"] = 2
    spawner = FakeSpawner()
    mgr = SessionManager(parse_config(config, "test"), tmp_path, spawner, store=InMemoryStateStore())
    mgr.load_all()

    async def body() -> None:
        slow = await mgr.create(1000, "slow", "echo", {})
        doomed = await mgr.create(1000, "doomed", "echo", {"agent.worker.max_restart_attempts": 0})
        go = asyncio.Event()

        async def hold(session: Session) -> None:  # a request holds it: it cannot be taken or hibernated
            async with session.locked():
                await go.wait()

        holding = [asyncio.create_task(hold(s)) for s in (slow, doomed)]
        await _until(lambda: slow.lock_held and doomed.lock_held, "the holds")
        mgr.slots.hibernate_soon(slow, "test: ahead of demand")  # on its way, held up by the lock
        creating = asyncio.create_task(mgr.create(1000, "new", "echo", {}))
        await _until(lambda: mgr.slots._freed, "the create to wait for a slot")
        assert doomed.worker is not None
        spawner.workers[doomed.worker.pid].exit(sig=9)  # its slot is free, and stays so
        made = await asyncio.wait_for(creating, 5)
        assert made.worker is not None and slow.worker is not None and slow.state is State.IDLE
        go.set()
        await asyncio.gather(*holding)
        await mgr.shutdown(1.0)

    _run(body)


# ---------------------------------------------------------------- counts instead of walks


def _check_counts(mgr: SessionManager) -> None:
    """The registry's counts are what a walk of every session says."""
    reg, every = mgr.sessions, list(mgr.sessions.values())
    live = [s for s in every if s.worker is not None or s.state is State.STARTING]
    assert set(reg.live) == set(live)
    assert mgr.slots.count() == len(live)
    for uid in {s.meta.owner_uid for s in every} | {1000, 1001, 4242}:
        assert reg.owned(uid) == sum(1 for s in every if s.meta.owner_uid == uid)
        assert mgr.slots.count(uid=uid) == sum(1 for s in live if s.meta.owner_uid == uid)
    for s in every:
        assert s.meta.run_uid in reg.run_uids
    assert mgr.live_workers() == sum(1 for s in every if s.worker is not None)


@pytest.mark.component
def test_the_counts_follow_create_hibernate_revive_stop_crash_and_rm(tmp_path: Path) -> None:
    cfg = _config(4, free_slots_low_water_pct=0, free_slots_high_water_pct=0)
    cfg["daemon"]["max_sessions_per_uid"] = 3
    spawner = FakeSpawner()
    mgr = SessionManager(parse_config(cfg, "test"), tmp_path, spawner, store=InMemoryStateStore())
    mgr.load_all()

    async def body() -> None:
        a = [await mgr.create(1000, f"a{i}", "echo", {}) for i in range(3)]
        _check_counts(mgr)
        # The quota, as before: counted, not walked.
        with pytest.raises(Capacity, match="max_sessions_per_uid = 3"):
            await mgr.create(1000, "a3", "echo", {})
        _check_counts(mgr)
        b = [await mgr.create(1001, f"b{i}", "echo", {}) for i in range(3)]  # each uid: 2 live at most
        await _until(lambda: _settled(mgr), "room made")
        _check_counts(mgr)
        assert sum(1 for s in a if s.state is State.HIBERNATED) == 1
        await _turn(mgr, a[0])  # revived
        await _until(lambda: _settled(mgr), "room made")
        _check_counts(mgr)
        await mgr.stop(b[2])
        _check_counts(mgr)
        await mgr.restart(b[2])
        _check_counts(mgr)
        live = next(s for s in a if s.worker is not None)
        spawner.workers[live.worker.pid].exit(sig=9)  # a crash: restarted
        await _until(lambda: live.state is State.IDLE, "the restart")
        _check_counts(mgr)
        await mgr.remove(a[1])
        _check_counts(mgr)
        assert (await mgr.create(1000, "a3", "echo", {})).state is State.IDLE  # room in the quota again
        # A create whose worker never boots leaves nothing, counts included.
        spawner.next_behaviour = lambda w, msg: isinstance(msg, m.Boot) and (w.exit(code=1) or True)
        with pytest.raises(Exception):
            await mgr.create(4242, "doomed", "echo", {})
        assert "doomed" not in mgr.sessions
        _check_counts(mgr)

    _run(body)


@pytest.mark.pure
def test_the_registry_counts_a_replaced_entry_and_metadata_read_back() -> None:
    from supervisor.store.state_store import Meta

    def session(sid: str, uid: int, run_uid: int | None) -> Session:
        return Session(id=sid, meta=Meta(id=sid, handler="echo", owner_uid=uid, run_uid=run_uid),
                       store=None, settings=None, state=State.STARTING)  # type: ignore[arg-type]

    reg = Registry()
    one = session("x", 7, 70)
    reg["x"] = one
    assert reg.owned(7) == 1 and 70 in reg.run_uids and reg.live_count() == reg.live_count(7) == 1
    assert reg.live_count(excluding=one) == 0
    reg["x"] = session("x", 8, 80)  # (repaired into a new one)
    assert reg.owned(7) == 0 and reg.owned(8) == 1 and 70 not in reg.run_uids and reg.live_count() == 1
    two = reg["x"]
    old, two.meta = two.meta, Meta(id="x", handler="echo", owner_uid=9, run_uid=90)
    reg.meta_changed(two, old)  # claimed back: what its store says now
    assert reg.owned(8) == 0 and reg.owned(9) == 1 and 90 in reg.run_uids
    assert reg.pop("x") is two and reg.owned(9) == 0 and reg.live_count() == 0 and len(reg) == 0
    with pytest.raises(TypeError):
        reg.update({"y": one})


@pytest.mark.component
def test_a_create_a_revive_a_sweep_and_a_client_s_going_walk_no_session_at_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With 200 sessions at rest, a create (making room), a revive, the
    sweep and a client that goes touch the live sessions only: a walk of
    the registry fails the test (the old core walked all of them for every
    create and revive, twice per slot count, at every sweep and at every
    client's disconnect)."""
    mgr = SessionManager(parse_config(_config(4, free_slots_low_water_pct=0), "test"), tmp_path,
                         FakeSpawner(), store=InMemoryStateStore())
    mgr.load_all()

    async def body() -> None:
        made = [await mgr.create(0, f"s{i}", "echo", {}) for i in range(200)]
        await _until(lambda: _settled(mgr), "room made")
        client = Recorder()
        mgr.attach(made[-1], client, None)
        mgr.budgets.uid_spent(0)  # (its one walk, at its first use, done)

        def walked(*args: Any) -> Any:
            raise AssertionError("a walk of every session")

        for name in ("values", "items", "keys", "__iter__"):
            monkeypatch.setattr(Registry, name, walked)
        fresh = await mgr.create(0, "new", "echo", {})
        await _turn(mgr, made[0])  # revived, making room
        for _ in range(2 * 10):  # (a quiet session's checks come every tenth sweep)
            mgr.sweeper.sweep(time.monotonic())
        mgr.detach(client)
        await _until(lambda: _settled(mgr), "room made")
        monkeypatch.undo()
        assert fresh.state is State.IDLE and made[0].state is State.IDLE and not made[-1].subscribers
        _check_counts(mgr)

    _run(body)


# ---------------------------------------------------------------- hibernation ahead of demand


@pytest.mark.component
def test_idle_sessions_are_hibernated_ahead_of_demand_so_a_create_finds_a_free_slot(tmp_path: Path) -> None:
    """Ceiling 20, marks 10 % and 20 % (2 and 4 slots free).  Past the
    ceiling, the background hibernates the least recently used idle
    sessions until 4 slots are free, never a busy one nor one a client is
    attached to; then creates take free slots, none waits for a hibernation."""
    cfg = _config(20, free_slots_low_water_pct=10, free_slots_high_water_pct=20)
    spawner = FakeSpawner()
    mgr = SessionManager(parse_config(cfg, "test"), tmp_path, spawner, store=InMemoryStateStore())
    mgr.load_all()
    assert mgr.slots.water_marks() == (2, 4)

    async def body() -> None:
        made = [await mgr.create(0, f"s{i:02}", "echo", {}) for i in range(20)]
        for s in made:
            await _turn(mgr, s)  # oldest first (least recently used)
        _worker(spawner, made[1]).behaviour = lambda w, msg: isinstance(msg, m.Input)  # never ends its turn
        await mgr.send(made[1], "busy", None)
        mgr.attach(made[2], Recorder(), None)
        assert mgr.slots.count() == 20 and not mgr.slots._hibernating  # (no more sessions than slots: none)
        made.append(await mgr.create(0, "s20", "echo", {}))  # the ceiling: the oldest idle one makes room
        await _until(lambda: _settled(mgr) and mgr.slots.count() == 16, "the background's hibernations")
        asleep = [s.id for s in made if s.state is State.HIBERNATED]
        assert asleep == ["s00", "s03", "s04", "s05", "s06"], asleep
        assert _hibernated_why(mgr, made[0]) == "hibernated to make room (max_concurrent_sessions)"
        for s in made[3:7]:
            assert _hibernated_why(mgr, s) == "hibernated ahead of demand (free_slots_low_water_pct)"
        assert made[1].state is State.RUNNING and made[2].state is State.IDLE  # busy, attached: kept

        async def no_waiting(*args: Any) -> None:
            raise AssertionError("a create waited for another session's hibernation")

        mgr.slots._evict = no_waiting  # type: ignore[method-assign]
        for i in range(3):  # 4 free, then 3, 2 (the low mark): the background frees more
            made.append(await mgr.create(0, f"t{i}", "echo", {}))
        await _until(lambda: _settled(mgr) and mgr.slots.count() == 16, "the background again")
        assert all(s.state is State.IDLE for s in made[-3:])

    _run(body)


def _worker(spawner: FakeSpawner, session: Session) -> FakeWorker:
    assert session.worker is not None
    return spawner.workers[session.worker.pid]


@pytest.mark.pure
def test_the_water_marks_follow_the_ceiling_and_leave_one_uid_its_share() -> None:
    def marks(**cfg: Any) -> tuple[int, int]:
        daemon = cfg.pop("daemon", {})
        config = parse_config({"agent": {"limits": cfg}, "daemon": daemon}, "test")
        slots = LiveSlots(lambda: config, Registry(), lambda uid: False, None, lambda c: None,  # type: ignore[arg-type]
                          terminate=lambda s, why, grace: asyncio.sleep(0))
        return slots.water_marks()

    assert marks() == (3, 6)  # 64 live: 5 % and 10 %, rounded down
    assert marks(max_concurrent_sessions=10) == (0, 0)  # a small ceiling: none kept free
    assert marks(max_concurrent_sessions=500) == (25, 50)
    assert marks(free_slots_low_water_pct=0) == (0, 0)  # off
    # Never below what one uid's whole ceiling needs: 20 live, 15 for one uid: 5 free at most.
    assert marks(max_concurrent_sessions=20, free_slots_high_water_pct=50, free_slots_low_water_pct=40,
                 daemon={"max_live_sessions_per_uid": 15}) == (5, 5)
    assert marks(max_concurrent_sessions=20, daemon={"max_live_sessions_per_uid": 20}) == (0, 0)


@pytest.mark.pure
def test_bad_water_marks_are_an_error_naming_the_key_and_the_file() -> None:
    with pytest.raises(ConfigError) as told:
        parse_config({"agent": {"limits": {"free_slots_low_water_pct": 20, "free_slots_high_water_pct": 10}}},
                     "/etc/sessiond/config.toml")
    assert "/etc/sessiond/config.toml" in str(told.value) and "agent.limits.free_slots_low_water_pct" in str(told.value)
    with pytest.raises(ConfigError) as told:
        parse_config({"agent": {"limits": {"free_slots_high_water_pct": 80}}}, "/etc/sessiond/config.toml")
    assert "/etc/sessiond/config.toml" in str(told.value) and "free_slots_high_water_pct" in str(told.value)


# ---------------------------------------------------------------- file descriptors counted near the limit


@pytest.mark.pure
def test_the_fds_are_listed_near_the_limit_and_at_most_once_a_second_far_from_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    open_now = [2000]
    listings: list[int] = []
    clock = [100.0]

    def listed(limit: int) -> int:
        listings.append(open_now[0])
        return open_now[0]

    monkeypatch.setattr(fdbudget.fds, "open_count", listed)
    monkeypatch.setattr(fdbudget.time, "monotonic", lambda: clock[0])
    budget = FdBudget(limit=65536, reserve=200)
    for live in range(100, 200):  # far from the limit: one listing, the estimate moved on by each start
        budget.check(live)
    assert len(listings) == 1
    clock[0] += fdbudget.RECOUNT_SECS  # stale: listed again
    budget.check(200)
    assert len(listings) == 2
    open_now[0] = 65_520  # connections took them meanwhile: the estimate would not know...
    clock[0] += fdbudget.RECOUNT_SECS
    with pytest.raises(Capacity, match="file descriptors"):
        budget.check(200)
    for _ in range(3):  # ...and near the limit every check lists them
        with pytest.raises(Capacity, match="file descriptors"):
            budget.check(200)
    assert len(listings) == 6
