"""Several daemons on one PostgreSQL database (supervisor.cluster.fronts,
supervisor.core.fencing): a daemon that starts takes nothing from the others;
any daemon serves any session by claiming it when used; the daemon that
held it lets go (its worker stopped, the session hibernated there) and
can claim it back; a turn running on a live daemon is never taken; a
daemon frozen mid-turn is taken over once its hold runs out, and writes
nothing after.  Real daemons, real PostgreSQL (tests/pg_server.py)."""

from __future__ import annotations

import os
import re
import secrets
import signal
import threading

import msgspec
import psutil
import psycopg
import pytest
import tomli_w

from conftest import FAST_CONFIG
from harness import wait_for
from pg_server import PgServer
from supervisor.ctl.client import RequestError, TurnFailedError

pytestmark = pytest.mark.process


@pytest.fixture
def dsn(pg_server: PgServer) -> str:
    return pg_server.fresh_dsn()


def pg_config(dsn: str, worker: str = "", lease: float = 10.0) -> str:
    return (FAST_CONFIG.replace("[agent.worker]\n", f"[agent.worker]\n{worker}") + "\n"
            + tomli_w.dumps({"store": {"backend": "postgres", "dsn": dsn},
                             "cluster": {"front_lease_secs": lease}}))


def sql(dsn: str, query: str, *args: object) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query.encode(), args)
        return cur.fetchall() if cur.description else []


def records(dsn: str, sid: str) -> list[tuple[int, dict[str, object]]]:
    rows = sql(dsn, "SELECT pos, frame FROM sessiond_records WHERE session = %s ORDER BY pos", sid)
    return [(int(pos), msgspec.msgpack.decode(bytes(frame)[8:])) for pos, frame in rows]


def inputs(dsn: str, sid: str) -> list[object]:
    return [r["text"] for _, r in records(dsn, sid) if r["r"] == "input"]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_daemon_that_starts_takes_nothing_and_any_daemon_serves_any_session(make_daemon, dsn: str) -> None:
    first = make_daemon(pg_config(dsn))
    with first.client() as c:
        sid = c.create().id
        assert c.send_text(sid, "a") == "1: a"
        first_pid = c.status(sid).pid
    assert first_pid is not None
    second = make_daemon(pg_config(dsn))
    with second.client() as c:
        st = c.status(sid)  # known there, not claimed: no worker there
        assert st.state == "hibernated" and st.pid is None and st.turns == 1, st
    with first.client() as c:  # the first still holds it and goes on
        assert c.send_text(sid, "b") == "2: b"
        assert c.status(sid).pid == first_pid
    with second.client() as c:  # used there: claimed there, with what the first did
        assert c.send_text(sid, "c") == "3: c"
        assert c.status(sid).turns == 3
    with first.client() as c:  # the first let go at once: worker stopped, hibernated, saying why
        wait_for(lambda: c.status(sid).state == "hibernated", 10, "the first daemon to let go")
        st = c.status(sid)
        assert st.pid is None and "taken over by another daemon" in (st.error or ""), st
        wait_for(lambda: gone(first_pid), 10, "the first daemon's worker to be gone")
        assert c.send_text(sid, "d") == "4: d"  # and takes it back when used
        assert c.status(sid).turns == 4 and c.status(sid).error is None
    with second.client() as c:
        wait_for(lambda: c.status(sid).state == "hibernated" and c.status(sid).pid is None, 10,
                 "the second daemon to let go")
    rows = records(dsn, sid)
    assert [pos for pos, _ in rows] == list(range(len(rows)))
    assert inputs(dsn, sid) == ["a", "b", "c", "d"]
    assert not [r for _, r in rows if r["r"] == "abort"], "no turn was cut"


def test_a_create_or_a_remove_on_one_daemon_is_seen_by_the_other(make_daemon, dsn: str) -> None:
    first = make_daemon(pg_config(dsn))
    second = make_daemon(pg_config(dsn))
    with first.client() as c:
        sid = c.create().id
        assert c.send_text(sid, "a") == "1: a"
    with second.client() as c:
        wait_for(lambda: sid in {s.id for s in c.list()}, 10, "the other daemon to learn of the create")
        assert c.send_text(sid, "b") == "2: b"
    with first.client() as c:
        c.remove(sid)  # claimed back, then removed
    with second.client() as c:
        wait_for(lambda: sid not in {s.id for s in c.list()}, 10, "the other daemon to learn of the remove")
        with pytest.raises(RequestError) as exc:
            c.status(sid)
        assert exc.value.code == "not_found"
    assert records(dsn, sid) == []


def test_a_turn_running_on_a_live_daemon_is_not_taken(make_daemon, dsn: str) -> None:
    first = make_daemon(pg_config(dsn))
    second = make_daemon(pg_config(dsn))
    with first.client() as c:
        sid = c.create(handler="fixture_handlers:slow").id  # input N: N ticks of 20 ms
    outcome: list[object] = []

    def long_turn() -> None:
        with first.client() as c:
            outcome.append(c.send_text(sid, "100000"))

    thread = threading.Thread(target=long_turn)
    thread.start()
    try:
        with first.client() as c:
            wait_for(lambda: c.status(sid).state == "running", 10, "the long turn to run")
        # (An input not yet durable is not a turn yet: a claim meanwhile
        # would fence it, and its client would be told it was not taken.)
        wait_for(lambda: inputs(dsn, sid) == ["100000"], 10, "its input to be durable")
        with second.client() as c:
            for ask in (lambda: c.send_text(sid, "1"), lambda: c.stop(sid), lambda: c.restart(sid)):
                with pytest.raises(RequestError, match="running turn 1 on another daemon"):
                    ask()
            assert c.status(sid).pid is None
        with first.client() as c:
            assert c.status(sid).state == "running", "the turn runs on, untouched"
            c.interrupt(sid)
    finally:
        thread.join(10)
    assert len(outcome) == 1, outcome
    with second.client() as c:  # ended there: now it can be taken
        assert c.send_text(sid, "1") == "tick 0\n"
    turns = [(r["r"], r["turn"]) for _, r in records(dsn, sid) if r["r"] in ("input", "commit", "abort")]
    assert turns == [("input", 1), ("commit", 1), ("input", 2), ("commit", 2)], turns


@pytest.mark.parametrize("heartbeat", ["60", "0.2"], ids=["stale-commit", "heartbeats-missed"])
def test_a_daemon_frozen_mid_turn_is_taken_over_once_its_hold_runs_out_and_writes_nothing_after(
    make_daemon, dsn: str, heartbeat: str
) -> None:
    """The stale writer: a daemon frozen (SIGSTOP) in the middle of a turn.
    Another daemon is refused the session while the frozen one's hold
    lasts, then claims it (ending the frozen turn) and runs turns.  Resumed
    (SIGCONT), the frozen daemon lets go: its turn fails, its worker is
    stopped, not restarted, and nothing of it lands.

    With long heartbeats the resumed daemon meets the stale turn's commit
    (or the claim's message first); with short ones it may first kill the
    worker it did not hear from: let go all the same."""
    first = make_daemon(pg_config(dsn, lease=1.0).replace("heartbeat_interval_secs = 0.2",
                                                          f"heartbeat_interval_secs = {heartbeat}"))
    with first.client() as c:
        sid = c.create(handler="fixture_handlers:slow").id
        assert c.send_text(sid, "2") == "tick 0\ntick 1\n"
    outcome: list[object] = []

    def stale_turn() -> None:
        try:
            with first.client() as c:
                outcome.append(c.send_text(sid, "100000"))
        except Exception as exc:  # noqa: BLE001 (handed to the test's thread)
            outcome.append(exc)

    thread = threading.Thread(target=stale_turn)
    thread.start()
    with first.client() as c:
        wait_for(lambda: c.status(sid).state == "running", 10, "the long turn to run")
        wait_for(lambda: [r["r"] for _, r in records(dsn, sid)][-1] == "input", 10, "its input to be durable")
        stale_pid = c.status(sid).pid
    assert stale_pid is not None
    os.kill(first.pid, signal.SIGSTOP)
    refused: list[str] = []
    try:
        second = make_daemon(pg_config(dsn, lease=1.0))
        with second.client() as c:
            def taken() -> bool:
                try:
                    return c.send_text(sid, "1") == "tick 0\n"
                except RequestError as exc:
                    refused.append(str(exc))
                    return False

            wait_for(taken, 15, "the frozen daemon's hold to run out")
            assert c.send_text(sid, "2") == "tick 0\ntick 1\n"
        took_over_at = len(records(dsn, sid))
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert all("running turn 2 on another daemon" in why for why in refused), refused
    with first.client() as c:
        wait_for(lambda: c.status(sid).state == "hibernated" and c.status(sid).pid is None, 10,
                 "the first daemon to let go")
        st = c.status(sid)
        assert st.error is not None and ("taken over by another daemon" in st.error
                                         or "held by another daemon" in st.error), st
    thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], TurnFailedError), outcome
    wait_for(lambda: gone(stale_pid), 10, "the stale worker to be gone")
    rows = records(dsn, sid)
    assert len(rows) == took_over_at, "nothing of the stale writer landed"
    assert [pos for pos, _ in rows] == list(range(len(rows)))
    turns = [(r["r"], r["turn"]) for _, r in rows if r["r"] in ("input", "commit", "abort")]
    assert turns == [("input", 1), ("commit", 1), ("input", 2), ("abort", 2),  # the second daemon's abort
                     ("input", 3), ("commit", 3), ("input", 4), ("commit", 4)], turns
    with second.client() as c:  # the second daemon holds it and goes on
        assert c.send_text(sid, "1") == "tick 0\n"
        assert c.status(sid).turns == 5


def test_a_daemon_that_stops_lets_its_sessions_be_claimed_at_once_and_claims_its_own_back(
    make_daemon, dsn: str
) -> None:
    """A clean stop deletes the daemon's hold: a turn it could not finish
    is not waited for; the same daemon restarted is still itself."""
    first = make_daemon(pg_config(dsn, lease=600))
    with first.client() as c:
        sid = c.create().id
        assert c.send_text(sid, "a") == "1: a"
    first.stop()
    second = make_daemon(pg_config(dsn, lease=600))
    with second.client() as c:
        assert c.send_text(sid, "b") == "2: b"
    second.kill()  # its hold lasts 600 s: only it may end a turn of it early; none runs
    first.start()
    with first.client() as c:
        assert c.send_text(sid, "c") == "3: c"  # idle: taken from a daemon that may still live
    second.start()  # itself again (its front-id): held nothing now, takes nothing
    with second.client() as c:
        assert c.status(sid).pid is None
    with first.client() as c:
        assert c.status(sid).pid is not None
    assert inputs(dsn, sid) == ["a", "b", "c"]


def test_a_daemon_that_missed_a_claim_while_cut_off_lets_go_once_it_hears_again(
    make_daemon, pg_server: PgServer, dsn: str
) -> None:
    """The claim's message is lost with the first daemon's listening
    connection (which cannot come back meanwhile: its role may not log
    in); once it can, the daemon compares its sessions with the table and
    lets go of the one claimed elsewhere, without writing anything first."""
    role = f"front_{secrets.token_hex(3)}"
    sql(pg_server.dsn, f"CREATE ROLE {role} LOGIN SUPERUSER")
    first = make_daemon(pg_config(f"{dsn} user={role}"))
    with first.client() as c:
        sid = c.create().id
        assert c.send_text(sid, "a") == "1: a"
        pid = c.status(sid).pid
    assert pid is not None
    listening = ("SELECT pid FROM pg_stat_activity WHERE usename = %s "
                 "AND application_name = 'sessiond-front'")
    sql(pg_server.dsn, f"ALTER ROLE {role} NOLOGIN")
    sql(pg_server.dsn, f"SELECT pg_terminate_backend(pid) FROM ({listening}) a", role)
    wait_for(lambda: not sql(pg_server.dsn, listening, role), 10, "its listening connection to be gone")
    second = make_daemon(pg_config(dsn))
    with second.client() as c:
        assert c.send_text(sid, "b") == "2: b"
    with first.client() as c:
        assert c.status(sid).pid == pid, "it did not hear of the claim"
    sql(pg_server.dsn, f"ALTER ROLE {role} LOGIN")
    with first.client() as c:
        wait_for(lambda: c.status(sid).state == "hibernated", 20, "the first daemon to let go")
        assert "taken over by another daemon" in (c.status(sid).error or "")
    wait_for(lambda: gone(pid), 10, "its worker to be gone")
    assert inputs(dsn, sid) == ["a", "b"]
    with second.client() as c:
        assert c.send_text(sid, "c") == "3: c"


def test_what_a_daemon_hears_on_the_channel_is_checked_and_costs_no_data(make_daemon, dsn: str) -> None:
    """Anyone who can connect to the database can NOTIFY on the channel
    (and, to be fair, write the tables): malformed messages are ignored,
    unknown sessions too, a claim of an older generation than the daemon's
    too, and a forged claim makes the daemon let go of a session it then
    claims back at its next input, losing nothing."""
    d = make_daemon(pg_config(dsn))
    with d.client() as c:
        sid = c.create().id
        assert c.send_text(sid, "a") == "1: a"
        pid = c.status(sid).pid
    # A claim older than the daemon's own (one that crossed its claim) is no
    # reason to let go; the malformed marker after it says it was heard.
    for payload in [f"claim {sid} someone 1", "marker-after-the-stale-claim"]:
        sql(dsn, "SELECT pg_notify('sessiond_sessions', %s)", payload)
    wait_for(lambda: "marker-after-the-stale-claim" in d.log, 10, "the stale claim to be heard")
    with d.client() as c:
        assert c.status(sid).state == "idle" and c.status(sid).pid == pid
    for payload in ["", "bogus", "claim", "claim a b c d", "create nosuch someone", "remove nosuch someone",
                    "\x00" * 100, "claim " + "x" * 7000 + " someone", f"claim {sid} someone",
                    f"claim {sid} someone x", f"create {sid} someone 7", f"claim {sid} someone 999999"]:
        sql(dsn, "SELECT pg_notify('sessiond_sessions', %s)", payload.replace("\x00", "?"))
    with d.client() as c:
        wait_for(lambda: c.status(sid).state == "hibernated", 10, "the forged claim to be heard")
        assert c.send_text(sid, "b") == "2: b"
        assert [s.id for s in c.list()] == [sid]
    assert "ignoring a malformed message" in d.log
    assert inputs(dsn, sid) == ["a", "b"]


def test_a_daemon_s_name_is_one_word_and_a_mangled_one_stops_the_start_saying_which_file(
    make_daemon, dsn: str
) -> None:
    d = make_daemon(pg_config(dsn))
    name = (d.state_dir / "front-id").read_text().strip()
    assert re.fullmatch(r"[A-Za-z0-9._-]+:[0-9a-f]{8}", name), name
    d.stop()
    (d.state_dir / "front-id").write_text("two words\n")
    with pytest.raises(AssertionError, match="exited with 1"):
        d.start()
    assert f"{d.state_dir / 'front-id'} holds 'two words', not a daemon's name" in d.log
    assert "delete it and a new name is made" in d.log
    (d.state_dir / "front-id").unlink()
    d.start()
    assert (d.state_dir / "front-id").read_text().strip() != name


def test_logs_of_a_claimed_session_show_what_happened_where_it_was_held(make_daemon, dsn: str) -> None:
    """`sessionctl logs` reads the lifecycle kept in the shared store: after
    a claim, what the other daemon saw of the session since this one last
    held it is there too (it was what this daemon had known at its start)."""
    first = make_daemon(pg_config(dsn, lease=600))
    second = make_daemon(pg_config(dsn, lease=600))
    with first.client() as c:
        sid = c.create().id
        c.stop(sid)
        c.restart(sid)
        assert c.send_text(sid, "a") == "1: a"
    with second.client() as c:
        assert c.send_text(sid, "b") == "2: b"  # claimed here, idle there
    logs = second.ctl("logs", sid)
    assert logs.returncode == 0, logs.stderr
    assert "idle -> stopping" in logs.stdout and "restart requested" in logs.stdout, logs.stdout
