"""A worker the machine starves of CPU is not killed as stuck
(supervisor.core.silence, supervisor.host.schedstat).

The finding (a `make test` run beside 8 busy loops on 2 cores): a cluster
test's healthy worker, ticking every 20 ms, was killed `killed_heartbeat`
with "nothing from it on its node for 1.5s".  Measured apart: a nice-10
worker doing 50 ms of work every 0.5 s beside 20 busy loops went 4.6 s at a
time without running, 98% of it waiting for a CPU.  Workers run below the
daemon's priority, so on a busy machine they are the first to wait, and the
daemon read that wait as a stuck loop.

Starvation is made here, deterministically, by the kernel's CFS bandwidth
limit (what a unit's `CPUQuota=` sets): the worker may run 20 ms a second
and waits, runnable, the rest.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from harness import FAST_SWEEP, wait_for
from ipc import messages as m
from supervisor.cluster.nodehost import NodeHost, _Worker
from supervisor.core.limits import STARVED_STRETCH_MAX
from test_metrics import parse, tcp_metrics_url, value

pytestmark = pytest.mark.process

# The worker may run QUOTA_US of every PERIOD_US: silent up to 0.98 s at a
# time, more than three heartbeats of INTERVAL.
PERIOD_US, QUOTA_US = 1_000_000, 20_000
INTERVAL = 0.1
ALLOWANCE = 3 * INTERVAL


def _cpu_controller() -> tuple[Path, str]:
    """Where CPU bandwidth can be limited: (a cgroup to make children in,
    "v1" or "v2")."""
    with open("/proc/self/mounts") as f:
        mounts = [line.split() for line in f]
    for _, where, kind, options, *_ in mounts:
        if kind == "cgroup" and "cpu" in options.split(","):
            return Path(where), "v1"
    for _, where, kind, *_ in mounts:
        if kind == "cgroup2" and "cpu" in (Path(where) / "cgroup.controllers").read_text().split():
            root = Path(where)
            (root / "cgroup.subtree_control").write_text("+cpu")
            return root, "v2"
    pytest.fail("these tests need the kernel's cpu cgroup controller (a cgroup v1 `cpu` hierarchy, or cpu in "
                "cgroup v2's cgroup.controllers) to starve a worker of CPU")


@pytest.fixture
def starve() -> Iterator[Callable[[int], None]]:
    """starve(pid): the process may run QUOTA_US of every PERIOD_US from
    now on.  Whatever is left in the cgroup goes back to its parent after."""
    parent, version = _cpu_controller()
    group = parent / f"sessiond-test-starved-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    if version == "v1":
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
    else:
        (group / "cpu.max").write_text(f"{QUOTA_US} {PERIOD_US}")

    def put(pid: int) -> None:
        (group / "cgroup.procs").write_text(str(pid))

    yield put
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            (parent / "cgroup.procs").write_text(pid)
        except ProcessLookupError:
            pass  # ended meanwhile
    wait_for(lambda: _removed(group), 10, f"{group} to be removed")


def _removed(group: Path) -> bool:
    try:
        group.rmdir()
    except OSError:
        return False
    return True


def test_a_healthy_worker_starved_of_cpu_finishes_its_turn(make_daemon, starve) -> None:
    """Old: killed `killed_heartbeat` about 0.3 s into its first wait for a
    CPU, its turn failed."""
    d = make_daemon(FAST_SWEEP + 'metrics_listen = "127.0.0.1:0"\n')
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:cpu_chunks",
                       settings={"agent.worker.heartbeat_interval_secs": INTERVAL}).id
        before = c.status(sid)
        starve(before.pid)
        # 40 ms of work at 20 ms a second: about two seconds of turn.
        events = list(c.send(sid, "8"))
        assert isinstance(events[-1], m.TurnDone) and events[-1].reply == "8 chunks", events[-1]
        assert not [e for e in events if isinstance(e, m.LimitExceeded)], events
        after = c.status(sid)
    assert after.pid == before.pid and after.restarts == 0 and after.last_exit is None
    assert "killed_heartbeat" not in d.log
    assert "waiting for a CPU" in d.log and "starved by the machine's load, not stuck" in d.log
    assert value(parse(httpx.get(tcp_metrics_url(d)).text), "sessiond_workers_starved_total") >= 1


def test_a_stuck_loop_starved_of_cpu_is_still_killed_within_the_stretched_allowance(make_daemon, starve) -> None:
    """A busy loop on a starved machine waits for a CPU too: it is killed,
    once its silence is STARVED_STRETCH_MAX allowances long."""
    d = make_daemon(FAST_SWEEP)
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:busy_loop",
                       settings={"agent.worker.heartbeat_interval_secs": INTERVAL}).id
        starve(c.status(sid).pid)
        events = list(c.send(sid, "spin"))
        assert isinstance(events[-1], m.TurnFailed), events[-1]
        reason = events[-1].reason
        assert reason.startswith("killed_heartbeat: no heartbeat for") and "starved of CPU, waiting for one" in reason, reason
        silent = float(re.search(r"no heartbeat for ([0-9.]+)s", reason).group(1))
        # Starved, so never killed before the stretched allowance (figures
        # to a tenth of a second).
        assert silent >= STARVED_STRETCH_MAX * ALLOWANCE - 0.05, reason
        wait_for(lambda: c.status(sid).state == "idle", 10, "the restart")


def test_a_node_host_counts_only_the_silence_a_worker_could_run(starve) -> None:
    """On another machine the node host answers for the worker: a starved
    one is silent there only for the share it could run; one asleep (a
    blocking call) for all of it."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    asleep = subprocess.Popen(["sleep", "60"])
    try:
        starve(spin.pid)

        async def body() -> tuple[float | None, float | None]:
            host = NodeHost()
            loop = asyncio.get_running_loop()
            ends = []
            for pid in (spin.pid, asleep.pid):
                ours, theirs = socket.socketpair()
                ours.setblocking(False)
                ends += [ours, theirs]
                worker = host._workers[pid] = _Worker(ours, loop.create_future(), "front", claimed=True)
                worker.heard -= 10.0  # it last wrote ten seconds ago
            try:
                return await host.silent_for(spin.pid), await host.silent_for(asleep.pid)
            finally:
                for end in ends:
                    end.close()

        starved, stuck = asyncio.run(body())
        assert starved is not None and 10.0 / STARVED_STRETCH_MAX <= starved <= 10.2 / 2, starved
        assert stuck is not None and stuck >= 10.0, stuck
    finally:
        for proc in (spin, asleep):
            proc.kill()
            proc.wait()
