"""Cluster mode for real: a daemon whose workers run on node hosts of a
local Ray cluster (tests/ray_cluster.py: a head and two worker nodes on
127.0.0.11 and .12, two session slots each), with its state in a real
PostgreSQL (tests/pg_server.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import tomli_w

from conftest import FAST_CONFIG
from harness import env_for_children, wait_for
from ipc import messages as m
from ipc import operator as op
from pg_server import PgServer
from ray_cluster import NODE_IPS, LoopbackNetns, RayCluster
from supervisor.ctl import cli as ctl
from supervisor.config import parse_config
from supervisor.errors import ConfigError
from supervisor.ctl.drain import drain_exit_code, drain_json, drain_text
from supervisor.core.drainreq import check_request
from supervisor.errors import BadRequest
from supervisor.cluster.nodehost import read_more
from test_spawner_contract import CHECKS, Check


@pytest.fixture(scope="module")
def loopback_netns() -> Iterator[LoopbackNetns]:
    """Where this module's Ray nodes and the fronts that join them run:
    only `lo` is up there (tests/ray_cluster.py says why)."""
    netns = LoopbackNetns()
    try:
        yield netns
    finally:
        netns.close()


@pytest.fixture(scope="module")
def ray_cluster(loopback_netns: LoopbackNetns, request: pytest.FixtureRequest) -> Iterator[RayCluster]:
    """One cluster for this module's tests, gone once they are done: an
    idle Ray costs the rest of the run a share of its two cores.  After a
    failure its logs stay (the node hosts' say what the front cannot)."""
    cluster = RayCluster(netns=loopback_netns)
    failed = request.session.testsfailed
    try:
        yield cluster
    finally:
        cluster.close(keep_logs=request.session.testsfailed > failed)


@pytest.fixture
def make_daemon(make_daemon: Any, loopback_netns: LoopbackNetns) -> Any:
    """The suite's make_daemon (tests/conftest.py), each daemon started in
    the cluster's network namespace: a front must reach the Ray nodes, and
    the test reaches it over its Unix socket."""
    def make(config: str = FAST_CONFIG, start: bool = True, **kwargs: Any) -> Any:
        d = make_daemon(config, start=False, **kwargs)
        d.cmd_prefix = [*loopback_netns.enter, *d.cmd_prefix]
        if start:
            d.start()
        return d
    return make


@pytest.fixture(scope="module")
def ray_contract(ray_cluster: RayCluster) -> dict[str, dict[str, Any]]:
    """The suite against the Ray spawner, run once in a child process
    (tests/ray_contract_child.py: joining Ray starts threads, and this
    process must stay single-threaded for the zygote's run): check -> result."""
    child = Path(__file__).parent / "ray_contract_child.py"
    done = subprocess.run([*ray_cluster.enter, sys.executable, str(child), ray_cluster.address], capture_output=True,
                          text=True, timeout=300, env={**env_for_children(), **ray_cluster.auth_env()})
    results = {}
    for line in done.stdout.splitlines():
        with contextlib.suppress(ValueError):
            result = json.loads(line)
            results[result["check"]] = result
    assert results, f"the Ray contract run reported nothing ({done.returncode}):\n{done.stderr[-4000:]}"
    return results


@pytest.mark.process
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.strip("_"))
def test_ray_spawner_contract(check: Check, ray_contract: dict[str, dict[str, Any]]) -> None:
    """Workers on node hosts of a real local Ray cluster (tests/ray_cluster.py)."""
    result = ray_contract.get(check.__name__.strip("_"))
    assert result is not None, "the Ray contract run did not get to this check"
    assert result["ok"], result["error"]




def cluster_config(cluster: RayCluster, dsn: str) -> str:
    # Beats every 0.5 s, not FAST_CONFIG's 0.2: Ray, two fronts' spares and
    # the drains' moves on two busy cores can hold a beat past 0.6 s.
    base = FAST_CONFIG.replace("heartbeat_interval_secs = 0.2", "heartbeat_interval_secs = 0.5")
    return base + "\n" + tomli_w.dumps({
        "store": {"backend": "postgres", "dsn": dsn},
        "cluster": {"backend": "ray", "address": cluster.address, "front_lease_secs": 2.0,
                    "auth_token_file": str(cluster.token_file)},
    })


@pytest.mark.pure
def test_cluster_mode_needs_the_postgres_store() -> None:
    with pytest.raises(ConfigError, match=r"'cluster.backend' = \"ray\" needs 'store.backend' = \"postgres\""):
        parse_config({"cluster": {"backend": "ray"}}, "c.toml")
    assert parse_config({}, "c.toml").cluster.backend == "off"


@pytest.mark.process
def test_sessions_run_on_both_nodes_and_survive_a_worker_kill(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        sids = [c.create(handler="echo").id for _ in range(3)]  # 2 slots a node: both are used
        assert {c.status(s).node for s in sids} == set(NODE_IPS)
        for sid in sids:
            assert c.send_text(sid, "a") == "1: a"
        victim = c.status(sids[0])
        assert victim.pid is not None and victim.node in NODE_IPS
        os.kill(victim.pid, signal.SIGKILL)  # its node's pid (every node is this machine here)
        wait_for(lambda: c.status(sids[0]).state == "idle" and c.status(sids[0]).restarts == 1, 20,
                 "the killed worker to restart on a node host")
        after = c.status(sids[0])
        assert after.last_exit is not None and after.last_exit.reason == "crashed"
        assert after.last_exit.signal == signal.SIGKILL and after.node in NODE_IPS
        assert c.send_text(sids[0], "b") == "2: b"
    listed = json.loads(d.ctl("--json", "ls").stdout)["sessions"]
    assert {s["node"] for s in listed} == set(NODE_IPS)
    status = json.loads(d.ctl("--json", "status", sids[1]).stdout)
    assert status["node"] in NODE_IPS and isinstance(status["pid"], int)
    assert f"node:      {status['node']}\n" in d.ctl("status", sids[1]).stdout
    assert "cluster mode" in d.log


@pytest.mark.process
def test_a_front_that_dies_leaves_no_worker_behind(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """Its lease on the node host runs out; the next front loads the
    session from PostgreSQL and runs it on a new worker."""
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        sid = c.create(handler="echo").id
        assert c.send_text(sid, "a") == "1: a"
        pid = c.status(sid).pid
    assert pid is not None
    worker = psutil.Process(pid)  # every node is this machine here
    d.kill()
    wait_for(lambda: _dead(worker), 20,
             "the node host to kill the dead front's worker")
    d.start()
    with d.client() as c:
        assert c.send_text(sid, "b") == "2: b"


@pytest.mark.process
def test_two_fronts_serve_the_same_sessions_and_one_dying_breaks_nothing(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """Two fronts on one cluster and one database: a session is run by the
    front that was asked last (its worker there, the other's stopped); when
    one front dies the other serves every session, its own and the dead
    one's, with every acknowledged turn."""
    dsn = pg_server.fresh_dsn()
    config = cluster_config(ray_cluster, dsn)
    a = make_daemon(config)
    b = make_daemon(config)
    with a.client() as c:
        moved, stays = c.create(handler="echo").id, c.create(handler="echo").id
        assert c.send_text(moved, "a1") == "1: a1"
        assert c.send_text(stays, "a1") == "1: a1"
        was = c.status(moved).pid
    assert was is not None
    with b.client() as c:
        assert c.send_text(moved, "b2") == "2: b2"  # taken over on demand
        assert c.status(moved).node in NODE_IPS
    with a.client() as c:
        wait_for(lambda: c.status(moved).state == "hibernated", 10, "front a to let go")
        wait_for(lambda: _dead(was),
                 10, "front a's worker to be stopped")
        assert c.send_text(stays, "a2") == "2: a2"  # the other session is a's still
    a.kill()
    with b.client() as c:
        assert c.send_text(stays, "b3") == "3: b3"  # a dead front's idle session: at once
        assert c.send_text(moved, "b3") == "3: b3"
        assert {s.id for s in c.list()} >= {moved, stays}


def unclaimed_workers(cluster: RayCluster) -> set[int]:
    """Workers on the nodes that wait for their Boot (spares): a node
    host's worker is titled "sessiond: worker" until it boots."""
    found = set()
    for ip in NODE_IPS:
        with contextlib.suppress(psutil.Error, AssertionError):
            for proc in cluster.raylet(ip).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if " ".join(proc.cmdline()).strip() == "sessiond: worker":  # (setproctitle pads it)
                        found.add(proc.pid)
    return found


@pytest.mark.process
def test_spare_workers_are_taken_by_creates_and_never_cost_a_session_its_slot(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """A front keeps `spare_workers` placed and forked on the nodes; a
    create takes one (its worker is a spare that was already there).  The
    cluster has 4 slots: a front that needs one while spares hold the
    rest (here, another front's) gets a spare's slot."""
    dsn = pg_server.fresh_dsn()
    assert len(NODE_IPS) * ray_cluster.slots == 4
    # (Spares of the fronts of earlier tests die with their fronts' leases.)
    wait_for(lambda: not unclaimed_workers(ray_cluster), 30, "earlier fronts' spares to be gone")
    a = make_daemon(cluster_config(ray_cluster, dsn).replace("[daemon]\n", "[daemon]\nspare_workers = 2\n"))
    wait_for(lambda: len(unclaimed_workers(ray_cluster)) == 2, 30, "front a's two spares to be placed")
    spares = unclaimed_workers(ray_cluster)
    with a.client() as c:
        sid = c.create(handler="echo").id
        assert c.status(sid).pid in spares
        assert c.send_text(sid, "a") == "1: a"
    wait_for(lambda: len(unclaimed_workers(ray_cluster)) == 2, 30, "front a to make another spare")
    b = make_daemon(cluster_config(ray_cluster, dsn).replace("[daemon]\n", "[daemon]\nspare_workers = 0\n"))
    with b.client() as c:  # one free slot, then two held by a's spares
        made = [c.create(handler="echo").id for _ in range(3)]
        for made_sid in made:
            assert c.send_text(made_sid, "b") == "1: b"
    assert not unclaimed_workers(ray_cluster), "every slot went to a session"
    with a.client() as c:
        assert c.send_text(sid, "again") == "2: again"
    with b.client() as c:
        for made_sid in made:
            c.remove(made_sid)


@pytest.mark.process
def test_a_lost_node_s_sessions_come_back_on_the_other_with_every_turn(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """Kill the node that runs a turn: the turn fails naming node_lost, the
    sessions it held run again on the other node with every acknowledged turn."""
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        echo = c.create(handler="echo").id
        slow = c.create(handler="fixture_handlers:slow").id  # input N: N ticks of 20 ms
        assert c.send_text(echo, "a") == "1: a"
        assert c.send_text(echo, "b") == "2: b"
        assert c.send_text(slow, "1") == "tick 0\n"
        lost = c.status(slow).node
        assert lost in NODE_IPS
        other = next(ip for ip in NODE_IPS if ip != lost)
        on_lost = [s for s in (echo, slow) if c.status(s).node == lost]
        running: list[Any] = []

        def long_turn() -> None:
            with d.client() as c2:
                running.extend(c2.send(slow, "3000"))

        turn = threading.Thread(target=long_turn)
        turn.start()
        wait_for(lambda: c.status(slow).state == "running", 10, "the long turn to run")
        began = time.monotonic()
        ray_cluster.kill_node(lost)
        try:
            turn.join(60)
            # node_lost, also when the worker's silence was noticed first
            # (the kill for it could not land: its node host went with it).
            assert isinstance(running[-1], m.TurnFailed)
            assert running[-1].reason.startswith("node_lost: ") and lost in running[-1].reason, running[-1]
            for sid in on_lost:
                wait_for(lambda: c.status(sid).state == "idle" and c.status(sid).node == other, 60,
                         f"session {sid} to come back on {other}")
            print(f"\nrecovery after a node kill: {time.monotonic() - began:.1f}s")
            for sid in on_lost:
                st = c.status(sid)
                # node_lost, also when its silence (1.5 s here) was noticed
                # before Ray declared the node dead: the node is why.
                assert st.last_exit is not None and st.last_exit.reason == "node_lost", st.last_exit
                assert lost in st.last_exit.detail
            assert c.send_text(echo, "c") == "3: c"  # every acknowledged turn is there
            assert c.send_text(slow, "1") == "tick 0\n"
        finally:
            turn.join(60)
            ray_cluster.start_node(lost)  # whole again for whatever runs next


@pytest.mark.process
def test_a_turn_with_steps_resumes_on_the_other_node_when_its_node_is_lost(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """Durable steps in cluster mode: the steps are in PostgreSQL, the turn
    resumes on the other node, and its client sees one turn.  The node is
    killed once the daemon has the step "wait" in flight (the handler says
    so from inside it); the worker's silence may be noticed before Ray
    declares the node dead, and the resume is told as the node's loss."""
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:pause_once_steps").id
        events: list[Any] = []
        waiting = threading.Event()

        def turn() -> None:
            with d.client() as c2:
                for ev in c2.send(sid, "go"):
                    events.append(ev)
                    if isinstance(ev, m.TextDelta) and "waiting" in ev.text:
                        waiting.set()

        sender = threading.Thread(target=turn)
        sender.start()
        lost = ""
        try:
            assert waiting.wait(20), events
            st = c.status(sid)
            assert st.restarts == 0 and st.last_exit is None, st  # the first worker, in "wait"
            lost = st.node
            ray_cluster.kill_node(lost)
            sender.join(60)
            done = events[-1]
            assert isinstance(done, m.TurnDone) and done.turn == 1 and done.reply == "1: AB go", events
            resumed = [e for e in events if isinstance(e, m.Notice) and e.kind == "turn_resumed"]
            assert len(resumed) == 1 and resumed[0].data["step"] == 1 and resumed[0].data["running"] == "wait"
            # Told as the node's loss, not as the missed heartbeats it caused.
            assert resumed[0].data["reason"] == "node_lost" and "lost with its node" in resumed[0].data["cause"]
            assert c.status(sid).node not in (lost, None)
        finally:
            sender.join(60)
            if lost:
                ray_cluster.start_node(lost)


@pytest.mark.process
def test_a_memory_cap_is_enforced_on_a_remote_worker(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """The node host measures the worker's tree; the front's sweep decides
    and kills through the node host; the exit is killed_memory.  A child of
    the worker holds 400 MiB until it is killed: a cap measured every 0.1 s
    on the node and judged on the front (docs/cluster.md, no cgroup there)
    kills what a session holds, not a peak freed before the figure crosses
    (the `leaky` handler freed its 400 MiB as its turn returned, and on a
    busy machine its turn sometimes ended before the kill landed)."""
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:child_hog", settings={"agent.limits.max_memory_mb": 96}).id
        wait_for(lambda: (c.status(sid).rss_bytes or 0) > 0, 10, "the node host's first figure")
        events = list(c.send(sid, "400"))
        assert isinstance(events[-1], m.TurnFailed) and "killed_memory" in events[-1].reason, events[-1]
        limit = [e for e in events if isinstance(e, m.LimitExceeded)]
        assert limit and limit[0].kind == "memory" and limit[0].value > 96 and limit[0].limit == 96
        wait_for(lambda: c.status(sid).state == "idle" and c.status(sid).restarts == 1, 20,
                 "the restart after the memory kill")
        assert c.status(sid).last_exit.reason == "killed_memory"


@pytest.mark.process
def test_max_processes_is_counted_on_the_node_for_a_remote_worker(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """Where the kernel does not count a session's processes (root's tools
    here: no uid of its own), the node host counts the worker's tree and
    the front's sweep kills it over max_processes."""
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:whoami", settings={"agent.limits.max_processes": 8}).id
        assert "rlimit-nproc" not in c.status(sid).sandbox.get("active", ()), "the kernel would count them"
        assert c.send_text(sid, "forks 4") == "forked 4"  # 5 processes: within the limit
        assert c.send_text(sid, "forks 8") == "forked 8"  # 13: over it
        wait_for(lambda: (s := c.status(sid)).last_exit is not None and s.state == "idle", 20,
                 "the worker over max_processes to be killed and restarted")
        assert c.status(sid).last_exit.reason == "killed_processes", c.status(sid)
    assert "over max_processes = 8" in d.log


@pytest.mark.process
def test_a_cluster_that_cannot_be_reached_stops_the_start_saying_so(make_daemon, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = FAST_CONFIG + "\n" + tomli_w.dumps({
        "store": {"backend": "postgres", "dsn": f"host={tmp_path} dbname=x"},
        "cluster": {"backend": "ray", "address": f"127.0.0.1:{port}"},
    })
    d = make_daemon(config, start=False)
    with pytest.raises(AssertionError, match="exited with 1"):
        d.start()
    assert f"cannot reach the Ray head at 127.0.0.1:{port}" in d.log


@pytest.mark.process
@pytest.mark.parametrize("token", ["none", "wrong", "others-may-read"])
def test_a_front_without_the_cluster_s_token_is_refused_and_says_so(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer, tmp_path: Path, token: str
) -> None:
    """The test cluster requires Ray's token authentication: a front
    without the token, or with another one, cannot join (the start fails
    in one line, it does not hang); a token file others may read is
    refused before it is used."""
    config = cluster_config(ray_cluster, pg_server.fresh_dsn())
    bad = tmp_path / "token"
    if token == "none":
        config = config.replace(f'auth_token_file = "{ray_cluster.token_file}"', "")
    else:
        bad.write_text("0" * 64 if token == "wrong" else ray_cluster.token_file.read_text())
        bad.chmod(0o600 if token == "wrong" else 0o644)
        config = config.replace(str(ray_cluster.token_file), str(bad))
    d = make_daemon(config, start=False)
    began = time.monotonic()
    with pytest.raises(AssertionError, match="exited with 1"):
        d.start()
    print(f"\nrefused in {time.monotonic() - began:.1f}s")
    if token == "others-may-read":
        assert "auth_token_file" in d.log and "others may read it (mode 644)" in d.log
    elif token == "none":
        assert "requires token authentication: set [cluster] auth_token_file" in d.log, d.log[-2000:]
    else:
        assert f"refused this daemon's token (from {bad})" in d.log, d.log[-2000:]


@pytest.mark.process
def test_workers_on_the_nodes_get_nothing_of_ray_s_environment(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """The node hosts run with Ray's environment (its token's path among
    it); the zygote they start, and so every worker, has none of it."""
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        sid = c.create(handler="echo").id
        pid = c.status(sid).pid
    assert pid is not None
    environ = psutil.Process(pid).environ()
    zygote = psutil.Process(pid).parent().environ()
    host = psutil.Process(pid).parent().parent().environ()
    assert host.get("RAY_AUTH_MODE") == "token", "the test looks at the right processes"
    for env in (environ, zygote):
        assert not [k for k in env if k.startswith("RAY_")], sorted(env)


# ---------------------------------------------------------------- drain


@pytest.mark.pure
@pytest.mark.parametrize("node, timeout", [
    ("", None), (None, None), (7, None), ("host name", None), ("127.0.0.1\nforged", None),
    ("x" * 1000, None), ("AB" * 28, None), ("127.0.0.11", 0), ("127.0.0.11", -1.0),
    ("127.0.0.11", float("nan")), ("127.0.0.11", float("inf")), ("127.0.0.11", True),
    ("127.0.0.11", "60"), ("127.0.0.11", 8 * 86400.0),
])
def test_a_drain_request_is_checked_as_hostile_input(node: object, timeout: object) -> None:
    with pytest.raises(BadRequest):
        check_request(node, timeout)


@pytest.mark.pure
def test_a_drain_names_a_node_by_address_or_ray_id() -> None:
    node_id = "b08edb0a0b90ee21925184cb96832c32cb6a60eabedaf04c32b355a0"
    assert check_request("127.0.0.11", None) == ("127.0.0.11", None)
    assert check_request("0:0::1", 5) == ("::1", 5.0)  # as Ray writes it
    assert check_request(node_id, 0.5) == (node_id, 0.5)


@pytest.mark.pure
def test_the_drain_report_for_people_and_for_programs() -> None:
    reply = op.DrainReply(
        id=1, node="127.0.0.11", node_id="b08edb0a0b90ee2192", draining=True, elapsed_secs=3.25,
        moved=[op.DrainMoved(session="a", node="127.0.0.12")],
        left=[op.DrainLeft(session="long-one", state="running", reason="turn 4 still running after 60s")],
    )
    assert drain_text(reply, undo=False) == (
        "drained 127.0.0.11 (node b08edb0a0b90) in 3.2s: 1 session(s) moved, 1 left\n"
        "  moved  a         -> 127.0.0.12\n"
        "  left   long-one  running: turn 4 still running after 60s\n"
        "no new session is placed there until `sessionctl drain --undo 127.0.0.11`\n"
    )
    assert json.loads(drain_json(reply)) == {
        "node": "127.0.0.11", "node_id": "b08edb0a0b90ee2192", "draining": True, "elapsed_secs": 3.25,
        "moved": [{"session": "a", "node": "127.0.0.12"}],
        "left": [{"session": "long-one", "state": "running", "reason": "turn 4 still running after 60s"}],
    }
    assert drain_exit_code(reply) == 1  # something was left: the drain is not done
    done = op.DrainReply(id=1, node="127.0.0.11", node_id="b08edb0a0b90ee2192", draining=False)
    assert drain_exit_code(done) == 0
    assert drain_text(done, undo=True) == "127.0.0.11 (node b08edb0a0b90) takes new sessions again\n"


@pytest.mark.pure
def test_the_drain_command_line() -> None:
    with pytest.raises(SystemExit):
        ctl._parser().parse_args(["drain", "127.0.0.11", "--timeout", "nan"])
    args = ctl._parser().parse_args(["drain", "--undo", "127.0.0.11", "--timeout", "90"])
    assert (args.node, args.undo, args.timeout) == ("127.0.0.11", True, 90.0)


@pytest.mark.process
def test_draining_on_one_machine_is_a_clear_error(make_daemon) -> None:
    d = make_daemon()
    done = d.ctl("drain", "127.0.0.11")
    assert done.returncode == 1
    assert "runs every session on this machine" in done.stderr and "no node to drain" in done.stderr
    done = d.ctl("drain", "not an address")
    assert done.returncode == 2 and "neither an IP address nor a Ray node id" in done.stderr


@pytest.mark.process
def test_drain_moves_a_node_s_sessions_once_idle_and_undo_takes_it_back(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        try:
            _drain_and_undo(d, c)
        finally:  # the marks live on the node hosts, which outlive this daemon
            for ip in NODE_IPS:
                c.drain(ip, undo=True)


@pytest.mark.process
def test_a_drain_that_runs_out_of_time_leaves_the_running_turn_and_says_why(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """--timeout crossed: the session whose turn still runs stays where it
    is, reported with the reason; the node stays marked until undone."""
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:slow").id  # input N: N ticks of 20 ms
        node = c.status(sid).node
        turn = threading.Thread(target=lambda: list(c2.send(sid, "1000")))
        with d.client() as c2:
            turn.start()
            try:
                wait_for(lambda: c.status(sid).state == "running", 10, "the long turn to run")
                late = d.ctl("--json", "drain", node, "--timeout", "0.5", timeout=60)
                assert late.returncode == 1, late.stderr  # something was left
                report = json.loads(late.stdout)
                assert report["draining"] is True and report["moved"] == []
                assert report["left"] == [{"session": sid, "state": "running",
                                           "reason": "turn 1 still running after 0.5s"}]
                assert c.status(sid).node == node and c.status(sid).state == "running"
            finally:
                c.interrupt(sid)
                turn.join(30)
                c.drain(node, undo=True)


def _drain_and_undo(d: Any, c: Any) -> None:
    # One session on each node: three make sure both nodes are used (two
    # slots a node), then one of the node that has two goes.
    made = [c.create(handler="fixture_handlers:slow").id for _ in range(3)]
    where = {s: c.status(s).node for s in made}
    drained = next(ip for ip in NODE_IPS if list(where.values()).count(ip) == 2)
    other = next(ip for ip in NODE_IPS if ip != drained)
    c.remove(next(s for s in made if where[s] == drained))
    busy = next(s for s in made if where[s] == drained and s in {x.id for x in c.list()})
    calm = next(s for s in made if where[s] == other)
    assert c.send_text(busy, "1") == "tick 0\n" and c.send_text(calm, "1") == "tick 0\n"
    running: list[Any] = []

    def long_turn() -> None:
        with d.client() as c2:
            running.extend(c2.send(busy, "60"))

    turn = threading.Thread(target=long_turn)
    turn.start()
    try:
        wait_for(lambda: c.status(busy).state == "running", 10, "the long turn to run")
        done = d.ctl("--json", "drain", drained, timeout=120)
    finally:
        turn.join(60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["node"], report["draining"], report["left"]) == (drained, True, [])
    assert report["moved"] == [{"session": busy, "node": other}], (report, d.log[-4000:])
    # The turn ran to its end where it began, then the session moved.
    assert isinstance(running[-1], m.TurnDone) and not running[-1].interrupted
    assert {c.status(s).node for s in (busy, calm)} == {other}
    assert [(t.input, t.outcome) for t in c.history(busy).turns] == [("1", "done"), ("60", "done")]
    assert c.send_text(busy, "2") == "tick 0\ntick 1\n"
    # New sessions avoid the drained node, though it has the most room.
    c.remove(calm)
    new = c.create(handler="echo").id
    assert c.status(new).node == other
    assert c.send_text(new, "a") == "1: a"
    # Undone, the node takes sessions again: draining the other moves
    # everything there (idle sessions at once), with every turn.
    undone = d.ctl("drain", "--undo", drained)
    assert undone.returncode == 0 and undone.stdout.startswith(f"{drained} (node ")
    done = d.ctl("drain", other, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"drained {other} (node " in done.stdout and ": 2 session(s) moved, 0 left" in done.stdout
    assert f"  moved  {new}" in done.stdout and f"-> {drained}" in done.stdout
    assert {c.status(s).node for s in (busy, new)} == {drained}
    assert [t.input for t in c.history(busy).turns] == ["1", "60", "2"]
    assert c.send_text(new, "b") == "2: b"
    unknown = d.ctl("drain", "127.0.0.99")
    assert unknown.returncode == 1 and "no live node '127.0.0.99' in the Ray cluster" in unknown.stderr
    assert drained in unknown.stderr  # it lists the live ones


def _dead(proc: psutil.Process | int) -> bool:
    """Gone or a zombie (it may be reaped between the two questions)."""
    try:
        if isinstance(proc, int):
            proc = psutil.Process(proc)
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _node_host_of(worker: psutil.Process) -> psutil.Process:
    """The node host actor process that runs a worker's zygote."""
    for parent in worker.parents():
        if "NodeHost" in " ".join(parent.cmdline()):
            return parent
    raise AssertionError(f"no node host above worker {worker.pid}")


def _long_turn_on_a_node(d: Any, c: Any) -> tuple[str, psutil.Process, psutil.Process, list[Any], threading.Thread]:
    """A `slow` session that ran a turn, and a long one now running from a
    thread: (the session, its worker, the node host that runs it, the long
    turn's events as they come, the thread)."""
    sid = c.create(handler="fixture_handlers:slow").id
    assert c.send_text(sid, "1") == "tick 0\n"
    worker_pid = c.status(sid).pid
    assert worker_pid is not None
    worker = psutil.Process(worker_pid)  # every node is this machine here
    events: list[Any] = []

    def long_turn() -> None:  # until interrupted, or its worker is lost
        with d.client() as c2:
            events.extend(c2.send(sid, "100000"))

    turn = threading.Thread(target=long_turn)
    turn.start()
    wait_for(lambda: c.status(sid).state == "running", 10, "the long turn to run")
    return sid, worker, _node_host_of(worker), events, turn


@pytest.mark.process
def test_a_frozen_node_host_s_session_moves_and_its_stale_worker_delivers_nothing(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """SIGSTOP a node host while its worker runs a turn: the front hears
    nothing (Ray sees a live node), asks the host about the silent worker,
    gives up on it when it does not answer, and revives the session on the
    other node.  SIGCONT: the host carries out the kill it was sent with
    the question; nothing the stale worker did reaches the session."""
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        sid, stale, host, running, turn = _long_turn_on_a_node(d, c)
        frozen = c.status(sid).node
        other = next(ip for ip in NODE_IPS if ip != frozen)
        try:
            host.suspend()
            try:
                turn.join(60)
                assert isinstance(running[-1], m.TurnFailed) and "node_lost" in running[-1].reason
                assert f"the node host on {frozen} did not answer within" in running[-1].reason
                wait_for(lambda: c.status(sid).state == "idle" and c.status(sid).node == other, 60,
                         f"the session to come back on {other}")
                assert c.send_text(sid, "2") == "tick 0\ntick 1\n"
                assert stale.is_running() and stale.status() != psutil.STATUS_ZOMBIE  # frozen, not killed
            finally:
                host.resume()
        finally:
            turn.join(60)
        wait_for(lambda: _dead(stale), 30, "the resumed node host to kill the stale worker")
        # What the stale worker did after the move reached nothing: the
        # history is the front's, in order, and the session runs on.
        history = [(t.input, t.outcome) for t in c.history(sid).turns]
        assert history == [("1", "done"), ("100000", "aborted"), ("2", "done")]
        assert c.send_text(sid, "1") == "tick 0\n" and c.status(sid).node == other


@pytest.mark.process
def test_a_node_host_held_up_past_the_heartbeat_allowance_costs_its_healthy_worker_nothing(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """The finding (`make test` on 2 busy cores): a node host's loop was
    held up for about a second while its worker beat on time, and the front,
    hearing nothing, killed the healthy worker as stuck (`killed_heartbeat`;
    its turn resumed on that story).  Here the node host is held with
    SIGSTOP until the front has asked it about the silent worker, then let
    go: it answers that the worker's beats wait in its socket, and the turn
    ends as if nothing had happened."""
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        sid, worker, host, events, turn = _long_turn_on_a_node(d, c)
        try:
            host.suspend()
            try:
                wait_for(lambda: "asking its node host" in d.log, 20,
                         "the front to ask the held-up node host about its silent worker")
            finally:
                host.resume()
            wait_for(lambda: "held up on the way here, not stuck" in d.log or "killed_heartbeat" in d.log, 20,
                     "the node host's answer")
            c.interrupt(sid)
        finally:
            turn.join(60)
        done = events[-1]
        assert isinstance(done, m.TurnDone) and done.interrupted and done.reply.startswith("tick 0\n"), done
        st = c.status(sid)
        assert st.restarts == 0 and st.last_exit is None and st.pid == worker.pid, st.last_exit
    assert "killed_heartbeat" not in d.log


@pytest.mark.process
def test_a_drain_mark_set_by_another_front_is_learned_and_so_is_its_undo(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """The mark lives on the node host: a front that did not set it learns
    it when the host refuses a worker, and drops it once the host no
    longer holds it."""
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    marked, free = NODE_IPS
    other = subprocess.Popen(
        [*ray_cluster.enter, sys.executable, str(Path(__file__).parent / "ray_other_front.py"), ray_cluster.address,
         marked],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**env_for_children(), **ray_cluster.auth_env()},
    )
    try:
        assert other.stdout is not None and other.stdin is not None
        assert other.stdout.readline().strip() == "marked"
        with d.client() as c:
            # Both slots of the free node, though the marked one has as many.
            sids = [c.create(handler="echo").id for _ in range(2)]
            assert [c.status(s).node for s in sids] == [free, free]
            other.stdin.write("\n")
            other.stdin.flush()
            assert other.stdout.readline().strip() == "unmarked"
            # The free node is full: a create succeeds only on the unmarked one.
            assert c.status(c.create(handler="echo").id).node == marked
    finally:
        other.kill()
        other.wait(30)


@pytest.mark.protocol
def test_frames_ready_together_cross_together_up_to_the_batch_limit() -> None:
    """What the bridge reads for one Ray call or stream item (nodehost.read_more)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        for chunk in (b"a" * 10, b"b" * 20, b"c" * 30):
            theirs.sendall(chunk)
        first = ours.recv(10)
        assert read_more(ours, first) == b"a" * 10 + b"b" * 20 + b"c" * 30
        assert read_more(ours, b"x") == b"x"  # nothing more waiting: no wait either
        theirs.sendall(b"d" * 5000)
        assert read_more(ours, ours.recv(1000), limit=3000) == b"d" * 3000  # the rest stays
        theirs.close()
        assert read_more(ours, ours.recv(1000)) == b"d" * 2000
        assert ours.recv(10) == b""  # the end is left for the next read to find


def _net_ns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


@pytest.mark.process
def test_the_cluster_and_its_fronts_reach_no_interface_but_loopback(
    make_daemon, ray_cluster: RayCluster, pg_server: PgServer
) -> None:
    """Ray listens on every interface (`::`, 0.0.0.0) whatever
    --node-ip-address says: every process of the test cluster, and a front
    with its workers, runs in a network namespace where `lo` is the only
    interface, so none of it can be reached from another machine or reach one."""
    if os.geteuid() != 0:
        pytest.skip("a network namespace of our own needs root")
    d = make_daemon(cluster_config(ray_cluster, pg_server.fresh_dsn()))
    with d.client() as c:
        sid = c.create(handler="echo").id
        assert c.send_text(sid, "hi") == "1: hi"
    # Every node's processes (raylet, GCS, agents, the node hosts and the
    # zygotes and workers below them), the front and what it started.
    ours = {p.pid for ip in ray_cluster.nodes for p in ray_cluster._members(ray_cluster.nodes[ip])}
    ours |= {d.pid, *(p.pid for p in d.descendants())}
    names = set()
    for pid in ours:
        with contextlib.suppress(psutil.Error):
            names.add(psutil.Process(pid).name())
    assert {"raylet", "gcs_server"} <= names, names  # the cluster's processes were found
    namespaces = {pid: _net_ns(pid) for pid in ours if os.path.exists(f"/proc/{pid}")}
    outside = {pid for pid, ns in namespaces.items() if ns != ray_cluster.netns.inode}
    assert not outside, f"processes outside the loopback namespace: {sorted(outside)}"
    assert ray_cluster.netns.inode != _net_ns(os.getpid())
    links = subprocess.run([*ray_cluster.enter, "ip", "-o", "link", "show", "up"], capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert [line.split(":")[1].strip() for line in links] == ["lo"], links
