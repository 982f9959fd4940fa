"""The real daemon, driven through sessionctl and the Python client."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from harness import Daemon, wait_for
from ipc import messages as m
from supervisor.ctl.client import Client, RequestError

pytestmark = pytest.mark.process


def test_create_send_ls_status_stop_rm_through_sessionctl(daemon: Daemon) -> None:
    created = daemon.ctl("create", "--json")
    assert created.returncode == 0, created.stderr
    sid = json.loads(created.stdout)["id"]

    sent = daemon.ctl("send", sid, "hello")
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout == "1: hello\n"
    assert daemon.ctl("send", sid, "again").stdout == "2: again\n"

    ls = json.loads(daemon.ctl("ls", "--json").stdout)
    assert [s["id"] for s in ls["sessions"]] == [sid]
    status = json.loads(daemon.ctl("--json", "status", sid).stdout)
    for key in ("id", "state", "pid", "rss_bytes", "restarts", "turns", "created_at", "last_exit"):
        assert key in status
    assert status["state"] == "idle" and status["turns"] == 2 and status["last_exit"] is None
    assert psutil.pid_exists(status["pid"]) and status["rss_bytes"] > 0

    ping = daemon.ctl("ping", sid, "--json")
    assert ping.returncode == 0 and json.loads(ping.stdout)["pid"] == status["pid"]
    stats = json.loads(daemon.ctl("stats", "--json").stdout)
    assert stats["sessions"] == 1 and stats["live_workers"] == 1

    assert daemon.ctl("stop", sid).returncode == 0
    stopped = json.loads(daemon.ctl("status", sid, "--json").stdout)
    assert stopped["state"] == "stopped" and stopped["pid"] is None
    assert stopped["last_exit"]["reason"] == "stopped"
    assert not _alive(status["pid"])
    # A stopped session refuses input with a hint, and restart brings it back.
    refused = daemon.ctl("send", sid, "x")
    assert refused.returncode == 1 and "restart" in refused.stderr
    assert daemon.ctl("restart", sid).returncode == 0
    assert daemon.ctl("send", sid, "back").stdout == "3: back\n"

    assert daemon.ctl("rm", sid).returncode == 0
    assert daemon.ctl("status", sid).returncode == 4
    assert json.loads(daemon.ctl("ls", "--json").stdout) == {"sessions": []}
    assert not (daemon.state_dir / "sessions" / sid).exists()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_exit_codes(daemon: Daemon, tmp_path) -> None:
    assert daemon.ctl("status", "nope").returncode == 4
    assert daemon.ctl("send", "nope", "x").returncode == 4
    assert daemon.ctl("create", "--id", "dup").returncode == 0
    dup = daemon.ctl("create", "--id", "dup")
    assert dup.returncode == 1 and "already exists" in dup.stderr
    bad_id = daemon.ctl("create", "--id", "../escape")
    assert bad_id.returncode == 2 and "invalid session id" in bad_id.stderr
    assert daemon.ctl("frobnicate").returncode == 2
    # No daemon there: 3, saying how to start one (the one-shot path and the full one).
    for argv in (["ls"], ["send", "s", "x"]):
        unreachable = daemon.ctl("--socket", str(tmp_path / "none.sock"), *argv)
        assert unreachable.returncode == 3 and "cannot connect" in unreachable.stderr
        assert "`make run`" in unreachable.stderr and "systemctl start sessiond.socket" in unreachable.stderr


def test_set_overrides_are_validated_and_capped(daemon: Daemon) -> None:
    ok = daemon.ctl("create", "--set", "agent.limits.max_memory_mb=64", "--json")
    assert ok.returncode == 0, ok.stderr
    above = daemon.ctl("create", "--set", "agent.limits.max_memory_mb=999999")
    assert above.returncode == 2 and "above the operator's limit" in above.stderr
    unknown = daemon.ctl("create", "--set", "agent.limits.nonsense=1")
    assert unknown.returncode == 2 and "agent.limits.nonsense" in unknown.stderr
    outside = daemon.ctl("create", "--set", "daemon.state_dir=/tmp")
    assert outside.returncode == 2


def test_sessions_survive_daemon_sigkill(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        a = c.create(session="alpha").id
        b = c.create(session="beta").id
        assert c.send_text(a, "one") == "1: one"
        assert c.send_text(a, "two") == "2: two"
        assert c.send_text(b, "uno") == "1: uno"
        worker_pids = [c.status(s).pid for s in (a, b)]
    d.kill()
    d.assert_no_leftovers()  # zygote and workers die with the daemon
    for pid in worker_pids:
        assert pid is not None and not _alive(pid)

    d.start()
    with d.client() as c:
        listed = {s.id: s for s in c.list()}
        assert set(listed) == {a, b}
        assert listed[a].state == "hibernated" and listed[a].turns == 2
        # The next input starts a worker restored from the log.
        assert c.send_text(a, "three") == "3: three"
        assert c.send_text(b, "dos") == "2: dos"


def test_snapshots_keep_restore_short(make_daemon) -> None:
    cfg = "[agent.worker]\nsnapshot_every_turns = 5\n"
    d = make_daemon(cfg)
    sdir = d.state_dir / "sessions"
    turns = 0

    def logs(sid: str) -> list[str]:
        return sorted(p.name for p in (sdir / sid).glob("log.*"))

    with d.client() as c:
        sid = c.create().id
        for turns in range(1, 13):
            assert c.send_text(sid, f"t{turns}") == f"{turns}: t{turns}"
        # Two snapshots taken: log.0 deleted; the log before the newest
        # kept with snapshot.prev as the fallback should the newest
        # snapshot fail its checksum.  (Snapshots are written off the loop;
        # old logs go once the newest one is durable, and one asked for
        # while the last is still being written is skipped: on a busy
        # machine it takes a few more turns.)
        deadline = time.monotonic() + 30
        while not (len(logs(sid)) == 2 and "log.0" not in logs(sid)):
            assert time.monotonic() < deadline, f"log.0 never folded into the snapshots: {logs(sid)}"
            turns += 1
            assert c.send_text(sid, f"t{turns}") == f"{turns}: t{turns}"
    assert (sdir / sid / "snapshot").exists() and (sdir / sid / "snapshot.prev").exists()
    d.kill()
    d.start()
    with d.client() as c:
        assert c.send_text(sid, "again") == f"{turns + 1}: again"


def test_worker_crash_mid_turn_is_reported_and_restarted(daemon: Daemon) -> None:
    with daemon.client() as c:
        sid = c.create(handler="fixture_handlers:crash_mid_turn").id
        assert c.send_text(sid, "a") == "1: a"
        events = list(c.send(sid, "crash"))
        failed = events[-1]
        assert isinstance(failed, m.TurnFailed)
        assert "crashed" in failed.reason and "SIGKILL" in failed.reason
        wait_for(lambda: c.status(sid).state == "idle", 10, "the restarted worker")
        st = c.status(sid)
        assert st.restarts == 1 and st.last_exit is not None
        assert st.last_exit.reason == "crashed" and st.last_exit.signal == signal.SIGKILL
        # The aborted turn is not replayed; committed state is intact.
        assert c.send_text(sid, "b") == "2: b"


def test_handler_failure_keeps_the_worker(daemon: Daemon) -> None:
    with daemon.client() as c:
        sid = c.create(handler="fixture_handlers:crash_mid_turn").id
        pid = c.status(sid).pid
        events = list(c.send(sid, "fail"))
        assert isinstance(events[-1], m.TurnFailed) and events[-1].reason == "asked to fail"
        assert c.status(sid).pid == pid and c.status(sid).state == "idle"


def test_boot_failure_at_create_leaves_nothing(daemon: Daemon) -> None:
    r = daemon.ctl("create", "--id", "bad", "--handler", "fixture_handlers:crash_at_boot")
    assert r.returncode == 1
    assert "this handler cannot start" in r.stderr
    assert daemon.ctl("status", "bad").returncode == 4
    r = daemon.ctl("create", "--handler", "no_such_module:factory")
    assert r.returncode == 2 and "no_such_module" in r.stderr


def test_repeated_crashes_end_in_failed(make_daemon) -> None:
    cfg = """
[agent.worker]
max_restart_attempts = 2
restart_window_secs = 60
restart_backoff_initial_ms = 10
"""
    d = make_daemon(cfg)
    with d.client() as c:
        sid = c.create().id
        for _ in range(3):
            # Booted (idle), not just forked: a kill before Ready is a boot failure.
            pid = wait_for(lambda: (s := c.status(sid)).state == "idle" and s.pid, 10, "a booted worker")
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: c.status(sid).pid != pid, 10, "the worker to go")
        wait_for(lambda: c.status(sid).state == "failed", 10, "failed state")
        st = c.status(sid)
        assert st.last_exit is not None and st.last_exit.reason == "crashed"
        with pytest.raises(RequestError) as err:
            c.send_text(sid, "x")
        assert err.value.code == "conflict" and "restart" in err.value.message
        c.restart(sid)
        assert c.send_text(sid, "x") == "1: x"
    # failed survives a daemon restart
    d.stop()


def test_interrupt_keeps_partial_reply(daemon: Daemon) -> None:
    with daemon.client() as c, daemon.client() as c2:
        sid = c.create(handler="fixture_handlers:slow").id
        stream = c.send(sid, "1000")
        first = next(ev for ev in stream if isinstance(ev, m.TextDelta))
        assert first.text == "tick 0\n"
        c2.interrupt(sid)
        done = [ev for ev in stream if isinstance(ev, (m.TurnDone, m.TurnFailed))][-1]
        assert isinstance(done, m.TurnDone) and done.interrupted
        assert done.reply.startswith("tick 0\n")
        assert c.status(sid).state == "idle"
        # usable afterwards
        assert c.send_text(sid, "2") == "tick 0\ntick 1\n"


def test_graceful_sigterm_finishes_running_turn(daemon: Daemon) -> None:
    with daemon.client() as c:
        sid = c.create(handler="fixture_handlers:slow").id
        stream = c.send(sid, "20")
        next(ev for ev in stream if isinstance(ev, m.TextDelta))
        daemon.signal(signal.SIGTERM)
        events = list(stream)
        done = events[-1]
        assert isinstance(done, m.TurnDone) and not done.interrupted
        assert done.reply.count("tick") == 20
    assert daemon.proc is not None and daemon.proc.wait(20) == 0
    assert not daemon.socket.exists()


def test_attach_replays_from_seq(daemon: Daemon) -> None:
    with daemon.client() as c:
        sid = c.create().id
        events = list(c.send(sid, "hello"))
        first_seq = events[0].seq
        c.send_text(sid, "world")
    with daemon.client() as c:
        replay = c.attach(sid, from_seq=first_seq)
        got = []
        for ev in replay:
            got.append(ev)
            if isinstance(ev, m.TurnDone) and ev.turn == 2:
                break
        seqs = [e.seq for e in got]
        assert seqs == sorted(seqs) and seqs[0] == first_seq
        assert [e.reply for e in got if isinstance(e, m.TurnDone)] == ["1: hello", "2: world"]


def test_seq_stays_monotonic_across_daemon_restart(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        sid = c.create().id
        before = max(ev.seq for ev in c.send(sid, "a"))
    d.kill()
    d.start()
    with d.client() as c:
        after = min(ev.seq for ev in c.send(sid, "b"))
    assert after > before


def test_spare_workers_are_kept_ready_and_handed_out(make_daemon) -> None:
    d = make_daemon("[daemon]\nspare_workers = 2\n")
    zygote = psutil.Process(d.pid).children()[0]

    def spares() -> set[int]:
        with d.client() as c:
            live = {s.pid for s in c.list() if s.pid}
        return {p.pid for p in zygote.children()} - live

    wait_for(lambda: len(spares()) == 2, 10, "two spares")
    before = spares()
    with d.client() as c:
        info = c.create()
        assert info.pid in before  # a spare became the session's worker
        assert c.send_text(info.id, "hi") == "1: hi"
    wait_for(lambda: len(spares()) == 2, 10, "the pool to be refilled")
    d.stop()
    d.assert_no_leftovers()


def test_retained_events_are_bounded_in_bytes(make_daemon) -> None:
    d = make_daemon("[daemon]\nevent_retention_bytes = 65536\n")
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:big_reply").id
        assert c.send_text(sid, str(1024 * 1024)) == "big"  # 256 frames of 4 KiB
    with d.client() as c:
        got = []
        for ev in c.attach(sid, from_seq=1):
            got.append(ev)
            if isinstance(ev, m.TurnDone):
                break
        assert isinstance(got[0], m.Gap)  # the start is no longer retained
        replayed = sum(len(ev.text) for ev in got if isinstance(ev, m.TextDelta))
        assert 0 < replayed <= 65536
