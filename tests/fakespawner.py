"""An in-process `Spawner` for component tests of the daemon's core.

Each "worker" is an asyncio protocol on the far end of a real socketpair, in
the test's own loop, speaking the real worker protocol (ipc.messages): Boot
-> Ready, Input -> Delta + Done (echo: "N: TEXT"), WorkerPing -> WorkerPong,
Shutdown -> it closes and exits 0.  Kills and signals end it as a real one
would end, reported through `on_exit` from the loop.  Tests steer a worker's
behaviour with `behave(pid, fn)`; what it received is in `FakeWorker.got`.

It must pass the same contract suite as the zygote
(tests/test_spawner_contract.py).
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import socket
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from ipc import messages as m
from ipc.connection import FramedProtocol
from supervisor.spawn.pidfd import PidFd
from supervisor.errors import SpawnerDied

_to_worker = msgspec.msgpack.Decoder(m.ToWorker)
_pids = itertools.count(4_000_000)  # never a real pid of this machine
_SIGKILL, _SIGTERM = signal.SIGKILL, signal.SIGTERM  # (the spawner has a method named `signal`)

# A behaviour may answer a message itself: return True to say it did.
Behaviour = Callable[["FakeWorker", m.ToWorker], bool]


class FakeWorker:
    def __init__(self, spawner: FakeSpawner, pid: int, sock: socket.socket) -> None:
        self.spawner = spawner
        self.pid = pid
        self.alive = True
        self.turns = 0
        self.got: list[m.ToWorker] = []
        self.behaviour: Behaviour | None = None
        self.proto: FramedProtocol[m.ToWorker] = FramedProtocol(
            _to_worker, on_message=self._on_message, max_frame_bytes=1 << 30
        )
        self._sock = sock

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(lambda: self.proto, sock=self._sock)

    def send(self, msg: Any) -> None:
        if self.alive:
            self.proto.send(msg)

    def _on_message(self, msg: m.ToWorker) -> None:
        if not self.alive:
            return
        self.got.append(msg)
        if self.behaviour is not None and self.behaviour(self, msg):
            return
        match msg:
            case m.Boot(turns=turns):
                self.turns = turns
                self.send(m.Ready(pid=self.pid))
            case m.Input(turn=turn, text=text):
                self.turns += 1
                reply = f"{self.turns}: {text}"
                self.send(m.Delta(turn=turn, text=reply))
                self.send(m.Done(turn=turn, reply=reply, record=msgspec.msgpack.encode(self.turns)))
            case m.WorkerPing(nonce=nonce):
                self.send(m.WorkerPong(nonce=nonce))
            case m.Shutdown():
                self.exit(code=0)

    def exit(self, code: int | None = None, sig: int | None = None) -> None:
        """End as a process would: the link drops, the exit is reported."""
        if not self.alive:
            return
        self.alive = False
        self.proto.abort()
        asyncio.get_running_loop().call_soon(self.spawner.on_exit, self.pid, code, sig)


class FakeSpawner:
    def __init__(self) -> None:
        self.on_exit: Callable[[int, int | None, int | None], None] = lambda pid, code, sig: None
        self.on_zygote_lost: Callable[[], None] = lambda: None
        self.workers: dict[int, FakeWorker] = {}
        self.closed = False
        self.spares = 0
        self.next_behaviour: Behaviour | None = None

    @property
    def zygote_pid(self) -> int:
        return 0

    def request(self) -> asyncio.Future[tuple[int, socket.socket]]:
        fut: asyncio.Future[tuple[int, socket.socket]] = asyncio.get_running_loop().create_future()
        if self.closed:
            fut.set_exception(SpawnerDied("the spawner is closed"))
            return fut
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        theirs.setblocking(False)
        pid = next(_pids)
        worker = FakeWorker(self, pid, theirs)
        worker.behaviour, self.next_behaviour = self.next_behaviour, None
        self.workers[pid] = worker

        async def start() -> None:
            await worker.connect()
            fut.set_result((pid, ours))

        asyncio.get_running_loop().create_task(start())
        return fut

    def keep_spares(self, count: int) -> None:
        self.spares = count

    def signal(self, pid: int, sig: int) -> None:
        worker = self.workers.get(pid)
        if worker is None or not worker.alive:
            return
        if sig == _SIGTERM:
            worker.exit(code=0)  # a worker takes SIGTERM as Shutdown
        elif sig != 0:
            worker.exit(sig=sig)

    def kill_tree(self, pid: int, others: Iterable[PidFd] = (), sig: int = _SIGKILL) -> None:
        self.signal(pid, sig)

    def tree_alive(self, pid: int, others: Iterable[PidFd] = ()) -> bool:
        worker = self.workers.get(pid)
        return worker is not None and worker.alive

    def placement(self, pid: int) -> tuple[int, str | None]:
        return pid, None

    def close(self) -> None:
        self.closed = True
        for worker in self.workers.values():
            if worker.alive:
                worker.alive = False
                worker.proto.abort()


class FakeRemoteSpawner(FakeSpawner):
    """Its workers are "on other machines" (`LosesWorkers`, as the Ray
    spawner's): a test says what a silent worker's node host answers
    (`answer(pid)`: seconds since it last heard from the worker, or None
    once it is gone or lost) and reads which workers were asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.on_worker_lost: Callable[[int, str], None] = lambda pid, why: None
        self.asked: list[int] = []
        self.answer: Callable[[int], float | None] = lambda pid: 0.0

    async def node_silence(self, pid: int) -> float | None:
        self.asked.append(pid)
        await asyncio.sleep(0)  # an answer comes from another machine, never at once
        return self.answer(pid)
