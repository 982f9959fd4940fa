"""The cluster's spare-worker pool (supervisor.cluster.ray_spares) on its
own, in one event loop: what a create gets while spares are ready, being
made, or failing.  The pool's `make` is the test's: no Ray here (the pool
on a real cluster is in test_cluster)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Coroutine
from typing import Any

import pytest

from supervisor.cluster.ray_spares import SpareWorkers

pytestmark = pytest.mark.component


class Pool:
    """A pool whose spares are made when the test says: each `make` waits
    for `release()`, which hands it the next pid (or an error)."""

    def __init__(self) -> None:
        self.pending: list[asyncio.Future[int]] = []
        self.discarded: list[int] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.spares = SpareWorkers(self._make, lambda pid: True, self.discarded.append, self._spawn)

    async def _make(self) -> tuple[int, socket.socket]:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        pid = await fut
        ours, theirs = socket.socketpair()
        theirs.close()
        return pid, ours

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> object:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def release(self, pid: int | None) -> None:
        fut = self.pending.pop(0)
        if pid is None:
            fut.set_exception(OSError("no slot"))
        else:
            fut.set_result(pid)


def run(body: Any) -> None:
    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_create_that_comes_while_a_spare_is_being_made_waits_for_that_spare() -> None:
    """Else the create would place a worker of its own beside the spare,
    one more slot held, and the spare it could have had sits unused."""
    async def body() -> None:
        pool = Pool()
        pool.spares.keep(1)
        await asyncio.sleep(0)
        assert len(pool.pending) == 1
        taker = asyncio.ensure_future(pool.spares.take_soon())
        await asyncio.sleep(0)
        assert not taker.done()
        pool.release(101)
        made = await taker
        assert made is not None and made[0] == 101
        made[1].close()
        pool.spares.close()

    run(body)


def test_a_spare_that_cannot_be_made_leaves_the_create_to_place_its_own() -> None:
    async def body() -> None:
        pool = Pool()
        pool.spares.keep(1)
        await asyncio.sleep(0)
        taker = asyncio.ensure_future(pool.spares.take_soon())
        await asyncio.sleep(0)
        pool.release(None)
        assert await taker is None
        pool.spares.close()

    run(body)


def test_without_a_spare_on_its_way_a_create_does_not_wait() -> None:
    async def body() -> None:
        pool = Pool()
        assert await pool.spares.take_soon() is None  # none wanted
        pool.spares.keep(1)
        await asyncio.sleep(0)
        pool.release(7)
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(pool.spares) == 1
        made = await pool.spares.take_soon()  # ready: at once
        assert made is not None and made[0] == 7
        made[1].close()
        pool.spares.close()

    run(body)


def test_one_spare_made_wakes_one_waiting_create_and_a_cancelled_one_is_passed_over() -> None:
    async def body() -> None:
        pool = Pool()
        pool.spares.keep(2)
        await asyncio.sleep(0)
        assert len(pool.pending) == 2
        gone = asyncio.ensure_future(pool.spares.take_soon())
        first = asyncio.ensure_future(pool.spares.take_soon())
        second = asyncio.ensure_future(pool.spares.take_soon())
        await asyncio.sleep(0)
        gone.cancel()
        pool.release(1)
        got = await first
        assert got is not None and got[0] == 1
        assert not second.done()
        pool.release(2)
        got2 = await second
        assert got2 is not None and got2[0] == 2
        for made in (got, got2):
            made[1].close()
        pool.spares.close()
        for fut in pool.pending:
            fut.cancel()

    run(body)


def test_closing_the_pool_wakes_every_waiting_create() -> None:
    async def body() -> None:
        pool = Pool()
        pool.spares.keep(1)
        await asyncio.sleep(0)
        taker = asyncio.ensure_future(pool.spares.take_soon())
        await asyncio.sleep(0)
        pool.spares.close()
        assert await taker is None
        pool.release(9)  # made after the close: killed, never handed out
        for _ in range(3):
            await asyncio.sleep(0)
        assert pool.discarded == [9]

    run(body)
