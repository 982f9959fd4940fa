"""Durable steps of one turn, the worker's side: `ctx.step(key, fn)`.

Runs in the worker's event loop, inside the turn's task.  A step runs `fn`
once and sends its msgpack-encoded result to the daemon (`StepDone`), which
journals it (the same journal, group commit and fencing as the turn's
records) and answers `StepSaved` once it is durable.  The daemon is the only
writer of state: the worker never keeps steps anywhere itself.

When the worker waits for that answer: by default `ctx.step` returns once
its result is durable, and before a step runs its `fn` every earlier step
is durable (the barrier).  An `idempotent` step (an LLM request: running it
again costs money, changes nothing) waits for neither: its request overlaps
the flush of the step before, its own flush overlaps what follows.  A step
with `wait=False` keeps the barrier but returns at once (the agent's tool
results: the next LLM request overlaps their flush; the next tool waits for
it).  So a step that may act never runs before the steps that led to it
are durable, and the turn's commit covers every step before the client
hears it is done.  A worker that dies loses no step it sent (the daemon
still reads and journals it); a daemon that dies loses at most steps not
yet durable, none of which was followed by a step that acts.

A resumed turn (its worker died during it; `Input.resumed`) is the same turn
run again by the same handler code, given the steps it journaled: step `n`
returns the journaled result of step `n` without running `fn`, as long as
the key matches (a handler that asks for other steps than it journaled is
not deterministic between steps: the turn fails, `StepError`).  The first
step past the journal is the one that may have been running when the worker
died: `fn` runs again, unless the handler passed `interrupted`, which then
gives the step's result instead (the agent answers a tool that was running
as killed rather than run it twice).

A step's value comes back decoded from its msgpack bytes on both paths, so
a first run and a replay see the same types (a tuple comes back a list).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from ipc import messages as m
from session_worker.errors import StepError

__all__ = ["Interruption", "TurnSteps"]

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


@dataclass(slots=True, frozen=True)
class Interruption:
    """Why a resumed turn's step is being redone: its worker died.

    `reason` is the exit reason (`killed_memory`, `crashed`,
    `killed_heartbeat`..., or `daemon_stopped`); `cause` says it in words
    ("memory cap of 64 MiB reached", "the worker crashed (signal SIGKILL)");
    `certain` is False when it is not known whether the step had begun
    (the daemon itself died)."""

    reason: str
    cause: str
    key: str
    certain: bool = True
    step: int = 0  # the step the turn resumed at: those before it are journaled

    @property
    def killed(self) -> bool:
        """The session was killed for a limit its processes reached (memory,
        processes): the step running then is the likely cause."""
        return self.reason in ("killed_memory", "killed_processes")


class TurnSteps:
    """The steps of one turn, numbered in the order the handler asks for them."""

    def __init__(self, turn: int, send: Callable[[Any], None], flush: Callable[[], None],
                 resumed: m.Resumed | None, max_step_bytes: int, max_turn_bytes: int) -> None:
        self._turn = turn
        self._send = send
        self._flush = flush
        self._resumed = resumed
        self._max = max_step_bytes
        self._max_turn = max_turn_bytes
        self._bytes = sum(len(s.result) for s in resumed.steps) if resumed is not None else 0
        self._next = 0
        # Steps sent and not yet answered; the first refusal, raised at the next step.
        self._waiting: dict[int, asyncio.Future[m.StepSaved]] = {}
        self._refused = ""

    @property
    def interruption(self) -> Interruption | None:
        """Why this turn is a resumed one (None: a first run)."""
        r = self._resumed
        if r is None:
            return None
        return Interruption(reason=r.reason, cause=r.cause, key=r.running, certain=not r.uncertain, step=r.step)

    def saved(self, msg: m.StepSaved) -> None:
        if msg.error and not self._refused:
            self._refused = f"step {msg.n} was not saved: {msg.error}"
        fut = self._waiting.pop(msg.n, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def durable(self) -> None:
        """Return once every step sent so far is durable (StepError if one
        was refused)."""
        if self._waiting:
            await asyncio.gather(*self._waiting.values())
        if self._refused:
            raise StepError(self._refused)

    async def step(self, key: str, fn: Callable[[], Any | Awaitable[Any]], kind: str = "",
                   interrupted: Callable[[Interruption], Any] | None = None, idempotent: bool = False,
                   wait: bool = True) -> Any:
        if self._refused:
            raise StepError(self._refused)
        n = self._next
        self._next += 1
        r = self._resumed
        if r is not None and n < len(r.steps):
            journaled = r.steps[n]
            if journaled.key != key:
                raise StepError(
                    f"the resumed turn asked for step {n} {key!r}, but step {n} journaled is "
                    f"{journaled.key!r}: a handler must ask for the same steps in the same order "
                    "when its turn is resumed (docs/agent.md, durable steps)")
            return _decode(journaled.result)
        value: Any
        if (r is not None and n == r.step and interrupted is not None
                and (r.running == key or (r.uncertain and not r.running))):
            value = interrupted(Interruption(reason=r.reason, cause=r.cause, key=key, certain=not r.uncertain,
                                             step=n))
        else:
            if not idempotent:
                await self.durable()  # the barrier: what led here survives us
            self._send(m.StepBegun(turn=self._turn, n=n, key=key, kind=kind))
            self._flush()  # out before fn starts: the daemon knows what ran if we die now
            value = fn()
            if inspect.isawaitable(value):
                value = await value
        try:
            data = _encode(value)
        except (TypeError, msgspec.EncodeError) as exc:
            raise StepError(f"step {n} {key!r}: its result cannot be journaled (msgpack): {exc}") from None
        if len(data) > self._max:
            raise StepError(f"step {n} {key!r}: its result is {len(data)} bytes, over "
                            f"agent.worker.max_step_kb ({self._max // 1024})")
        self._bytes += len(data)
        if self._bytes > self._max_turn:
            raise StepError(f"step {n} {key!r}: the turn's steps would hold {self._bytes} bytes, over "
                            f"agent.worker.max_turn_steps_mb ({self._max_turn >> 20})")
        self._waiting[n] = asyncio.get_running_loop().create_future()
        self._send(m.StepDone(turn=self._turn, n=n, key=key, kind=kind, result=data))
        self._flush()
        if wait and not idempotent:
            await self.durable()
        return _decode(data)
