"""The `Spawner` seam's contract, run against every implementation: the
zygote (real forks: process tier) and the in-process fake that the core's
component tests stand on; tests/test_cluster.py runs it against the Ray
spawner (workers on node hosts of a real local Ray cluster).

What every spawner promises: a requested worker speaks the worker protocol
over the socket it hands back; every exit is reported once through
`on_exit` with its code or signal; a kill ends the worker and `tree_alive`
then says so; SIGTERM is a clean stop; a closed spawner refuses."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest

from fakespawner import FakeSpawner
from ipc import messages as m
from ipc.connection import FramedProtocol
from ipc.settings import SessionSettings
from supervisor.spawn.seams import Spawner
from supervisor.errors import SpawnerDied
from supervisor.spawn.spawner import ZygoteSpawner

_from_worker = msgspec.msgpack.Decoder(m.FromWorker)
_settings = msgspec.msgpack.encode(SessionSettings())
Exits = list[tuple[int, int | None, int | None]]


@contextlib.asynccontextmanager
async def _spawner(kind: str) -> AsyncIterator[tuple[Spawner, Exits]]:
    spawner: Any
    if kind == "zygote":
        # Forked from this process, as the daemon does it: never with threads.
        assert threading.active_count() == 1, "the zygote is never forked from a threaded process"
        spawner = ZygoteSpawner()
        spawner.start()
        spawner.attach(asyncio.get_running_loop())
    else:
        spawner = FakeSpawner()
    exits: Exits = []
    spawner.on_exit = lambda pid, code, sig: exits.append((pid, code, sig))
    try:
        yield spawner, exits
    finally:
        spawner.close()
        remove_workspaces()


async def _link(sock: socket.socket) -> tuple[FramedProtocol[m.FromWorker], asyncio.Queue[m.FromWorker]]:
    inbox: asyncio.Queue[m.FromWorker] = asyncio.Queue()
    proto: FramedProtocol[m.FromWorker] = FramedProtocol(
        _from_worker, on_message=inbox.put_nowait, max_frame_bytes=1 << 30
    )
    await asyncio.get_running_loop().create_unix_connection(lambda: proto, sock=sock)
    return proto, inbox


# The workspaces the checks' workers were booted with, removed by whoever
# ran the checks (`_spawner` here, tests/ray_contract_child.py) once its
# spawner is closed.
_WORKSPACES: list[str] = []


def remove_workspaces() -> None:
    while _WORKSPACES:
        shutil.rmtree(_WORKSPACES.pop(), ignore_errors=True)


async def _booted(spawner: Spawner) -> tuple[int, FramedProtocol[m.FromWorker], asyncio.Queue[m.FromWorker]]:
    pid, sock = await asyncio.wait_for(spawner.request(), 10)
    proto, inbox = await _link(sock)
    workspace = tempfile.mkdtemp(prefix="sd-contract-")
    _WORKSPACES.append(workspace)
    proto.send(m.Boot(session="contract", handler="echo", settings=_settings, workspace=workspace))
    ready = await _next(inbox, m.Ready)
    assert ready.pid == spawner.placement(pid)[0]  # the worker it was given
    return pid, proto, inbox


async def _next(inbox: asyncio.Queue[m.FromWorker], kind: type[Any]) -> Any:
    while True:
        msg = await asyncio.wait_for(inbox.get(), 10)
        if isinstance(msg, kind):
            return msg


async def _exit_of(exits: Exits, pid: int) -> tuple[int | None, int | None]:
    for _ in range(1000):
        for got_pid, code, sig in exits:
            if got_pid == pid:
                return code, sig
        await asyncio.sleep(0.01)
    raise AssertionError(f"no exit reported for {pid}")


Check = Callable[[Spawner, Exits], Awaitable[None]]


async def _serves_the_worker_protocol(spawner: Spawner, exits: Exits) -> None:
    pid, proto, inbox = await _booted(spawner)
    proto.send(m.Input(turn=1, text="hi"))
    done = await _next(inbox, m.Done)
    assert done.turn == 1 and done.reply == "1: hi"
    proto.send(m.WorkerPing(nonce=7))
    assert (await _next(inbox, m.WorkerPong)).nonce == 7
    assert spawner.tree_alive(pid)


async def _a_kill_is_reported_once_as_its_signal(spawner: Spawner, exits: Exits) -> None:
    pid, _, _ = await _booted(spawner)
    spawner.kill_tree(pid)
    assert await _exit_of(exits, pid) == (None, signal.SIGKILL)
    for _ in range(500):
        if not spawner.tree_alive(pid):
            break
        await asyncio.sleep(0.01)
    assert not spawner.tree_alive(pid)
    await asyncio.sleep(0.05)
    assert [e for e in exits if e[0] == pid] == [(pid, None, signal.SIGKILL)]


async def _shutdown_is_a_clean_exit(spawner: Spawner, exits: Exits) -> None:
    pid, proto, _ = await _booted(spawner)
    proto.send(m.Shutdown())
    assert await _exit_of(exits, pid) == (0, None)


async def _sigterm_stops_it_cleanly(spawner: Spawner, exits: Exits) -> None:
    pid, _, _ = await _booted(spawner)
    spawner.signal(pid, signal.SIGTERM)
    assert await _exit_of(exits, pid) == (0, None)  # a worker takes SIGTERM as Shutdown


async def _each_worker_is_its_own(spawner: Spawner, exits: Exits) -> None:
    first, _, _ = await _booted(spawner)
    second, proto, inbox = await _booted(spawner)
    assert first != second
    spawner.kill_tree(first)
    await _exit_of(exits, first)
    proto.send(m.Input(turn=1, text="still here"))
    assert (await _next(inbox, m.Done)).reply == "1: still here"


async def _a_closed_spawner_refuses(spawner: Spawner, exits: Exits) -> None:
    spawner.close()
    with pytest.raises(SpawnerDied):
        await asyncio.wait_for(spawner.request(), 10)


CHECKS: list[Check] = [
    _serves_the_worker_protocol,
    _a_kill_is_reported_once_as_its_signal,
    _shutdown_is_a_clean_exit,
    _sigterm_stops_it_cleanly,
    _each_worker_is_its_own,
    _a_closed_spawner_refuses,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.strip("_"))
@pytest.mark.parametrize("kind", [
    pytest.param("zygote", marks=pytest.mark.process),  # real forks
    pytest.param("fake", marks=pytest.mark.component),
])
def test_spawner_contract(kind: str, check: Check) -> None:
    async def run() -> None:
        async with _spawner(kind) as (spawner, exits):
            await check(spawner, exits)

    asyncio.run(run())
