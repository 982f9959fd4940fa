"""File descriptors have a budget: per session (each worker and its tools
hold at most `[agent.limits] max_open_files`, soft and hard), and for the
daemon (its live ceiling held to what its RLIMIT_NOFILE allows, and a
create or revive refused `capacity` naming file descriptors before the
last one is gone; what exists goes on).  See supervisor.core.fdbudget."""

from __future__ import annotations

import errno
import os
import resource
import socket

import pytest

from harness import Daemon, wait_for
from supervisor.config import Config
from supervisor.core.fdbudget import FDS_PER_LIVE_SESSION, FdBudget, out_of_fds
from supervisor.core.slots import per_uid_ceiling
from supervisor.errors import Capacity
from supervisor.store.journal import write_error

LIMIT = 107  # with the config below: room for 8 live sessions (56 kept apart, 6 each)
CONFIG = """
[daemon]
spare_workers = 0
max_connections_per_uid = 8
[agent.limits]
max_concurrent_sessions = 64
"""


def _config(text: str) -> Config:
    import tomllib

    import msgspec

    return msgspec.convert(tomllib.loads(text), Config)


@pytest.mark.pure
def test_the_live_ceiling_is_clamped_to_the_fds_and_each_users_share_follows() -> None:
    cfg = _config(CONFIG)
    budget = FdBudget.of(LIMIT, cfg)
    assert budget.live_fit == 8 and budget.live_ceiling(cfg) == 8
    assert per_uid_ceiling(cfg, budget.live_ceiling(cfg)) == 4  # half of the clamped ceiling, not of 64
    why = budget.clamped(cfg)
    assert "max_concurrent_sessions = 64" in why and "LimitNOFILE=" in why and f"RLIMIT_NOFILE {LIMIT}" in why
    # Enough fds: no clamp, no warning.
    roomy = FdBudget.of(budget.reserve + 64 * FDS_PER_LIVE_SESSION, cfg)
    assert roomy.live_ceiling(cfg) == 64 and roomy.clamped(cfg) == ""
    assert FdBudget.of(10, cfg).live_fit == 1  # never none


@pytest.mark.pure
def test_emfile_from_the_store_is_a_capacity_refusal_naming_file_descriptors() -> None:
    try:
        try:
            raise OSError(errno.EMFILE, "Too many open files")
        except OSError as exc:
            raise write_error("s1/fence", exc) from exc
    except Exception as store_error:
        refusal = out_of_fds(store_error, "session 's1' could not be saved: ")
    assert isinstance(refusal, Capacity)
    assert "file descriptors" in refusal.message and "LimitNOFILE=" in refusal.message
    assert out_of_fds(OSError(errno.ENFILE, "Too many open files in system")) is not None
    assert out_of_fds(OSError(errno.ENOENT, "No such file")) is None


@pytest.mark.process
def test_a_session_cannot_open_more_fds_than_max_open_files_nor_raise_it(tmp_path) -> None:
    d = Daemon(tmp_path / "d", "[daemon]\nspare_workers = 0\n[agent.limits]\nmax_open_files = 100\n")
    d.start()
    try:
        with d.client() as c:
            sid = c.create(handler="fixture_handlers:whoami",
                           settings={"agent.limits.max_open_files": 80}).id
            reply = c.send_text(sid, "fds")
            head, _, tool = reply.partition(" tool=")
            worker = head.removeprefix("worker=")
            assert worker == "80,80"  # the handler's own, soft and hard: the override, under the operator's 100
            raised, err, opened, soft, hard = tool.split()
            assert raised == "kept" and (soft, hard) == ("80", "80")
            assert int(err) == errno.EMFILE and int(opened) < 80
            # The operator's value is a ceiling: a session may not ask for more.
            from supervisor.ctl.client import RequestError

            with pytest.raises(RequestError):
                c.create(handler="echo", settings={"agent.limits.max_open_files": 4096})
    finally:
        d.stop()


@pytest.mark.process
def test_a_daemon_at_its_fd_limit_refuses_capacity_and_every_session_goes_on(tmp_path) -> None:
    """RLIMIT_NOFILE 107 (soft and hard) holds 8 live sessions, below
    max_concurrent_sessions = 64: the start-up log says so; sessions are
    created (the idle ones hibernated to make room) until all live ones
    are busy, and the next create is `capacity` naming file descriptors
    (the old daemon went on until EMFILE: `internal error`).  Then every
    session answers a turn, hibernated ones revived; ls and status answer;
    after rm of a few, creates succeed again."""
    from supervisor.ctl.client import RequestError

    d = Daemon(tmp_path / "d", CONFIG)
    d.preexec = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
    d.start()
    try:
        wait_for(lambda: "does not fit the daemon's file descriptors" in d.log, 10, "the clamp's warning")
        assert "LimitNOFILE=" in d.log
        with d.client() as c:
            idle = [c.create(handler="echo").id for _ in range(2)]
            for sid in idle:
                assert c.send_text(sid, "hi").endswith("hi")
            busy: list[str] = []
            refusal = None
            for _ in range(12):
                try:
                    sid = c.create(handler="fixture_handlers:slow").id
                except RequestError as exc:
                    refusal = exc
                    break
                with d.client() as feeder:  # (its ticks are not for this connection, which would lag)
                    feeder.send_input(sid, "100000")  # ticks until interrupted
                busy.append(sid)
            assert refusal is not None, "never refused"
            assert refusal.code == "capacity" and "file descriptors" in str(refusal), refusal
            assert len(busy) == 8
            assert {c.status(sid).state for sid in idle} == {"hibernated"}
            assert len(c.list()) == 10  # ls answers
            for sid in busy:
                c.interrupt(sid)
            for sid in busy:
                wait_for(lambda sid=sid: c.status(sid).state == "idle", 30, f"{sid} to end its turn")
            for sid in idle:  # revived, each making room by hibernating an idle one
                assert c.send_text(sid, "again").endswith("again")
            for sid in busy[:3]:
                c.remove(sid)
            more = [c.create(handler="echo").id for _ in range(3)]
            for sid in more:
                assert c.send_text(sid, "new").endswith("new")
    finally:
        d.stop()


@pytest.mark.process
def test_a_start_is_refused_before_the_last_fd_is_gone_and_nothing_that_exists_breaks(tmp_path) -> None:
    """Connections hold the daemon's fds until a live session and its
    spare no longer fit: a create and the revive of a hibernated session
    are `capacity` naming file descriptors (the old daemon went on into
    EMFILE: `internal error`), the hibernated session stays as it was, ls
    and status answer on a connection already open; once the connections
    are gone both work."""
    import msgspec

    from harness import raw_connect
    from ipc import messages as m
    from ipc.framing import encode_frame
    from supervisor.ctl.client import RequestError

    d = Daemon(tmp_path / "d", CONFIG)
    d.preexec = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
    d.start()
    flood = []
    try:
        with d.client() as c:
            sleeper = c.create(handler="echo", settings={"agent.session_timeout_secs": 1}).id
            assert c.send_text(sleeper, "hi").endswith("hi")
            wait_for(lambda: c.status(sleeper).state == "hibernated", 30, "the session to hibernate")
            fds = f"/proc/{d.pid}/fd"
            hello = encode_frame(m.Hello(protocol=m.PROTOCOL_VERSION, client="flood"))
            while len(os.listdir(fds)) < LIMIT - 20:
                s = raw_connect(d.socket)
                s.sendall(hello)
                header = s.recv(4, socket.MSG_WAITALL)
                reply = msgspec.msgpack.decode(s.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL),
                                               type=m.Reply)
                assert isinstance(reply, m.Welcome), reply
                flood.append(s)
            for attempt in (lambda: c.create(handler="echo"), lambda: c.send_text(sleeper, "wake")):
                with pytest.raises(RequestError) as told:
                    attempt()
                assert told.value.code == "capacity" and "file descriptors" in str(told.value), told.value
            assert c.status(sleeper).state == "hibernated"
            assert [info.id for info in c.list()] == [sleeper]
            for s in flood:
                s.close()
            flood.clear()
            wait_for(lambda: len(os.listdir(fds)) < LIMIT - 40, 10, "the connections to be closed")
            assert c.send_text(sleeper, "wake").endswith("wake")
            assert c.send_text(c.create(handler="echo").id, "new").endswith("new")
    finally:
        for s in flood:
            s.close()
        d.stop()


@pytest.mark.process
def test_config_check_says_when_the_live_ceiling_does_not_fit_the_fds(tmp_path) -> None:
    import subprocess
    import sys

    from harness import env_for_children

    path = tmp_path / "config.toml"
    path.write_text(CONFIG)

    def check(limit: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "supervisor.cli", "config", "check", str(path)],
                              capture_output=True, text=True, env=env_for_children(), timeout=60,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))

    tight = check(LIMIT)
    assert tight.returncode == 0, tight.stderr
    assert "max_concurrent_sessions = 64 does not fit" in tight.stderr and "LimitNOFILE=" in tight.stderr
    roomy = check(4096)
    assert roomy.returncode == 0 and "does not fit" not in roomy.stderr, roomy.stderr


@pytest.mark.component
def test_emfile_met_anyway_on_create_or_revive_is_capacity_and_the_session_goes_on(tmp_path) -> None:
    """The estimate may be wrong (another thread's files, a burst of
    connections): an EMFILE while a new session's files are made, or while
    a hibernated one's are read for its revive, is `capacity` naming file
    descriptors, not `internal`; the revived session is not failed and
    answers its next input."""
    import asyncio

    from fakespawner import FakeSpawner
    from supervisor.config import parse_config
    from supervisor.core.manager import SessionManager
    from supervisor.store.memory import InMemoryStateStore

    fast = {"agent": {"worker": {"restart_backoff_initial_ms": 1, "restart_backoff_max_ms": 2}},
            "tools": {"disk_quota": "measured"}}
    store = InMemoryStateStore()
    mgr = SessionManager(parse_config(fast, "test"), tmp_path, FakeSpawner(), store=store)
    mgr.load_all()
    emfile = OSError(errno.EMFILE, "Too many open files")

    async def body() -> None:
        real_create = store.create

        def no_fds(*args: object, **kwargs: object) -> object:
            try:
                raise emfile
            except OSError as exc:
                raise write_error("s2/fence", exc) from exc

        store.create = no_fds  # type: ignore[assignment,method-assign]
        with pytest.raises(Capacity) as told:
            await mgr.create(1000, "s2", "echo", {})
        assert "file descriptors" in told.value.message and "s2" not in mgr.sessions
        store.create = real_create  # type: ignore[method-assign]

        session = await mgr.create(1000, "s", "echo", {})
        await mgr.slots.hibernate(session, "test")
        assert session.state.value == "hibernated"
        real_read = session.store.read_for_boot_soon

        def unreadable() -> asyncio.Future[object]:
            fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            fut.set_exception(emfile)
            session.store.read_for_boot_soon = real_read  # type: ignore[method-assign]
            return fut

        session.store.read_for_boot_soon = unreadable  # type: ignore[method-assign]
        with pytest.raises(Capacity) as told:
            await mgr.send(session, "hi", None)
        assert "file descriptors" in told.value.message
        for _ in range(2000):
            if session.state.value in ("idle", "hibernated"):
                break
            await asyncio.sleep(0.005)
        assert session.state.value in ("idle", "hibernated"), session.state
        accepted = await mgr.send(session, "again", None)
        assert accepted.turn == 1

    asyncio.run(asyncio.wait_for(body(), 20))
