"""Spare workers in cluster mode: placed and forked ahead of time on the
node hosts, so that a create (or a revive) takes one that waits for its
Boot, instead of waiting for a Ray placement group and a fork on a node.

As `[daemon] spare_workers` does on one machine, where the zygote keeps
them.  Here each spare holds a slot (its placement group) like any worker,
so spares must never cost a session its place:
- a spare is placed only if a slot is free at once (a short wait), and the
  pool waits a while after a spare could not be placed;
- a create that comes while a spare is being made waits for it (it is
  placed or given up within a short wait) rather than hold one more slot;
- a create that waits for a slot gets a spare's slot: the newest spare is
  killed (its group removed) and the pool waits before making another;
- a spare on a node that is draining, shunned or gone is killed when seen
  (`usable`), never handed out; and before one is handed out its node host
  is asked to `claim` it, which it refuses on a node marked draining by any
  front (a host being marked kills the spares it holds at once).

Runs in the daemon's loop.  The pool knows spares as (pid, socket) pairs
made by `RaySpawner`; killing one is the spawner's `kill_tree`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

__all__ = ["SpareWorkers"]

log = logging.getLogger("sessiond.cluster")

# After a spare could not be placed, or gave its slot to a create: the
# time before the pool tries again.
HOLD_OFF_SECS = 5.0

Made = tuple[int, socket.socket]


class SpareWorkers:
    def __init__(
        self,
        make: Callable[[], Awaitable[Made]],
        usable: Callable[[int], bool],
        discard: Callable[[int], None],
        spawn_task: Callable[[Coroutine[Any, Any, None]], object],
    ) -> None:
        self._make = make
        self._usable = usable
        self._discard_pid = discard
        self._spawn_task = spawn_task
        self._ready: deque[Made] = deque()
        self._want = 0
        self._making = 0
        self._held_off: asyncio.TimerHandle | None = None
        self._closed = False
        # Takers waiting for a spare being made: woken when one is done.
        self._waiting: list[asyncio.Future[None]] = []

    def __len__(self) -> int:
        return len(self._ready)

    def keep(self, count: int) -> None:
        self._want = max(0, count)
        while len(self._ready) > self._want:
            self._discard(self._ready.pop())
        self._fill()

    def take(self) -> Made | None:
        """A spare that is ready, on a node still in use; None if none is."""
        while self._ready:
            made = self._ready.popleft()
            if self._usable(made[0]):
                self._fill()
                return made
            self._discard(made)
        self._fill()
        return None

    async def take_soon(self) -> Made | None:
        """A spare that is ready, or else the next one being made: it is
        placed (or fails) within a short wait, and a worker placed afresh
        beside it would hold one more slot.  None if none is on its way."""
        made = self.take()
        if made is not None or not self._making:
            return made
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(done)
        await done
        return self.take()

    def give_slot_back(self) -> None:
        """A create waits for a slot: the newest spare's is the create's."""
        if self._ready:
            log.info("a worker waits for a slot: giving it a spare worker's")
            self._discard(self._ready.pop())
        self._hold_off()

    def prune(self) -> None:
        """Kill the spares on nodes no longer in use (a drain began)."""
        for made in [m for m in self._ready if not self._usable(m[0])]:
            self._ready.remove(made)
            self._discard(made)

    def close(self) -> None:
        self._closed = True
        for waiter in self._waiting:
            _resolve(waiter)
        self._waiting.clear()
        if self._held_off is not None:
            self._held_off.cancel()
        while self._ready:
            self._discard(self._ready.pop())

    # ---------------------------------------------------------------- inside

    def discard(self, made: Made) -> None:
        """A spare taken and not used (refused by its node host): killed."""
        self._discard(made)

    def _discard(self, made: Made) -> None:
        made[1].close()
        self._discard_pid(made[0])

    def _fill(self) -> None:
        if self._closed or self._held_off is not None:
            return
        while len(self._ready) + self._making < self._want:
            self._making += 1
            self._spawn_task(self._one())

    async def _one(self) -> None:
        try:
            made = await self._make()
        except Exception as exc:
            log.debug("no spare worker placed (%s); trying again in %gs", exc, HOLD_OFF_SECS)
            self._hold_off()
            return
        finally:
            self._making -= 1
            self._wake()
        if self._closed or len(self._ready) >= self._want:
            self._discard(made)
        else:
            self._ready.append(made)

    def _wake(self) -> None:
        """Wake one waiting taker per spare made (or failed); from the loop's
        next turn, so a spare made is in the queue before it looks."""
        while self._waiting:
            waiter = self._waiting.pop(0)
            if not waiter.done():  # (else its taker was cancelled)
                asyncio.get_running_loop().call_soon(_resolve, waiter)
                return

    def _hold_off(self) -> None:
        if self._held_off is not None or self._closed:
            return

        def again() -> None:
            self._held_off = None
            self._fill()

        self._held_off = asyncio.get_running_loop().call_later(HOLD_OFF_SECS, again)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
