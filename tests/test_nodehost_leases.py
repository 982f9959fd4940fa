"""A node host's lease watch (supervisor/cluster/nodehost.py), in-process:
a stall of the node host's own loop is never blamed on a front.  Under a
busy node, renewals queue behind the stall; judging the leases as soon as
the loop ran again killed every worker of a live front (boot_failed and
crashed with SIGKILL in the cluster tests under load)."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from supervisor.cluster import nodehost
from supervisor.cluster.nodehost import NodeHost, _Worker

pytestmark = pytest.mark.component

CHECK = 0.05  # the watch's period here (nodehost._LEASE_CHECK_SECS), made short
LEASE = 0.2


class _Spawner:
    def __init__(self) -> None:
        self.killed: list[int] = []

    def kill_tree(self, pid: int, *_: Any) -> None:
        self.killed.append(pid)


def _renew(host: NodeHost, front: str) -> None:
    host._leases[front] = time.monotonic() + LEASE


async def _host_with_worker(front: str) -> tuple[NodeHost, _Spawner, list[socket.socket]]:
    host = NodeHost()
    spawner = _Spawner()
    host._spawner = spawner  # type: ignore[assignment]
    a, b = socket.socketpair()
    host._workers[7] = _Worker(a, asyncio.get_running_loop().create_future(), front, claimed=True)
    await host.lease(front, 1.0)  # starts the watch
    _renew(host, front)
    return host, spawner, [a, b]


def test_a_stall_of_the_node_hosts_own_loop_does_not_expire_a_live_fronts_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodehost, "_LEASE_CHECK_SECS", CHECK)

    async def go() -> list[int]:
        host, spawner, socks = await _host_with_worker("live")
        try:
            await asyncio.sleep(CHECK * 1.5)  # the watch has looked once
            time.sleep(LEASE * 3)  # the node host's loop held up: nothing else runs
            # The renewal the front sent meanwhile is read off its socket
            # only once the loop runs again: a few turns after the watch.
            async def late_renewal() -> None:
                for _ in range(3):
                    await asyncio.sleep(0)
                _renew(host, "live")

            renewal = asyncio.ensure_future(late_renewal())
            await asyncio.sleep(CHECK * 3)
            await renewal
            return spawner.killed
        finally:
            assert host._watchdog is not None
            host._watchdog.cancel()
            for s in socks:
                s.close()

    assert asyncio.run(go()) == []


def test_a_front_that_stopped_renewing_still_loses_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodehost, "_LEASE_CHECK_SECS", CHECK)

    async def go() -> list[int]:
        host, spawner, socks = await _host_with_worker("gone")
        try:
            deadline = time.monotonic() + 5
            while not spawner.killed and time.monotonic() < deadline:
                await asyncio.sleep(CHECK)
            return spawner.killed
        finally:
            assert host._watchdog is not None
            host._watchdog.cancel()
            for s in socks:
                s.close()

    assert asyncio.run(go()) == [7]
