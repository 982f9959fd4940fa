"""Durable steps of one turn, the worker's side: `ctx.step(key, fn)`.

Runs in the worker's event loop, inside the turn's task (and the tasks a
handler starts: steps may overlap).  A step runs `fn` once and sends its
msgpack-encoded result to the daemon (`StepDone`), which journals it (the
same journal, group commit and fencing as the turn's records) and answers
`StepSaved` once it is durable.  The daemon is the only writer of state:
the worker never keeps steps anywhere itself.

A step is known by its number, the order in which the turn *started* it
(called `ctx.step`), and its key: never by the order it ended.  Its start
is journaled too (`StepBegun`), so that after a death the steps that had
begun and not ended are known: the steps in flight.

When the worker waits: by default `ctx.step` returns once its result is
durable.  Before a step that is not `idempotent` runs its `fn`, every step
that had ended before it started is durable (the barrier); and if another
step may be in flight then (another `ctx.step` call is outstanding, or an
ended one is not durable yet), its own start is durable too, which the
daemon answers after journaling everything sent before it: so a step that
acts never runs before the steps that led to it survive, and after any
death the steps that may have begun are known.  A step that runs alone
(the usual sequential turn) does not wait for its start: if the daemon dies
then, the resumed turn's first step not journaled may have begun
(`Resumed.uncertain`).  An `idempotent` step (an LLM request: running it
again costs money, changes nothing) waits for nothing: its request
overlaps the flush of the step before, its own flush overlaps what
follows.  A step with `wait=False` keeps the barrier but returns at once
(the agent's tool results: the next LLM request overlaps their flush; the
next tool waits for it).  A step whose `fn` raises (or whose call is
cancelled before it runs) is journaled as failed, with no result.

A resumed turn (its worker died during it; `Input.resumed`) is the same turn
run again by the same handler code, given the steps it journaled: step `n`
returns the journaled result of step `n` without running `fn`, whatever
order the steps ended in, as long as the key matches (a handler that asks
for other steps than it journaled is not deterministic between steps: the
turn fails, `StepError`).  A step that was in flight runs again, unless the
handler passed `interrupted`, which then gives the step's result instead
(the agent answers a tool that was running as killed rather than run it
twice).  A step that failed, or never began, runs as a new one.

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
    """The steps of one turn, numbered in the order the handler starts them."""

    def __init__(self, turn: int, send: Callable[[Any], None], flush: Callable[[], None],
                 resumed: m.Resumed | None, max_step_bytes: int, max_turn_bytes: int) -> None:
        self._turn = turn
        self._send = send
        self._flush = flush
        self._resumed = resumed
        self._max = max_step_bytes
        self._max_turn = max_turn_bytes
        # A resumed turn's journaled results and its steps that were in
        # flight, by number (`n` -1: a step's place in the list).
        self._journaled: dict[int, m.StepResult] = {}
        self._was_flying: dict[int, str] = {}
        if resumed is not None:
            for i, s in enumerate(resumed.steps):
                self._journaled.setdefault(s.n if s.n >= 0 else i, s)
            self._was_flying = {f.n: f.key for f in resumed.in_flight}
            if resumed.running and not resumed.in_flight:
                self._was_flying[resumed.step] = resumed.running
        self._bytes = sum(len(s.result) for s in self._journaled.values())
        self._next = 0
        self._calls = 0  # `ctx.step` calls of this run not yet returned (past a replay)
        # Steps ended and not yet durable; starts asked durable and not yet.
        self._unsaved: dict[int, asyncio.Future[m.StepSaved]] = {}
        self._marks: dict[int, asyncio.Future[m.StepSaved]] = {}
        self._refused = ""  # the first refusal, raised at the next step

    @property
    def interruption(self) -> Interruption | None:
        """Why this turn is a resumed one (None: a first run)."""
        r = self._resumed
        if r is None:
            return None
        return Interruption(reason=r.reason, cause=r.cause, key=r.running, certain=not r.uncertain, step=r.step)

    def saved(self, msg: m.StepSaved) -> None:
        if msg.error and not self._refused:
            what = "'s start" if msg.begun else ""
            self._refused = f"step {msg.n}{what} was not saved: {msg.error}"
        fut = (self._marks if msg.begun else self._unsaved).pop(msg.n, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def durable(self) -> None:
        """Return once every step ended so far is durable (StepError if one
        was refused)."""
        if self._unsaved:
            await asyncio.gather(*self._unsaved.values())
        if self._refused:
            raise StepError(self._refused)

    async def step(self, key: str, fn: Callable[[], Any | Awaitable[Any]], kind: str = "",
                   interrupted: Callable[[Interruption], Any] | None = None, idempotent: bool = False,
                   wait: bool = True) -> Any:
        if self._refused:
            raise StepError(self._refused)
        n = self._next
        self._next += 1
        journaled = self._journaled.get(n)
        was = self._was_flying.get(n)
        if (journaled is not None and journaled.key != key) or (was is not None and was != key):
            raise StepError(
                f"the resumed turn asked for step {n} {key!r}, but step {n} journaled is "
                f"{(journaled.key if journaled is not None else was)!r}: a handler must start the same steps "
                "in the same order when its turn is resumed (docs/agent.md, durable steps)")
        if journaled is not None:
            return _decode(journaled.result)
        r = self._resumed
        if (r is not None and interrupted is not None
                and (was is not None or (r.uncertain and not self._was_flying and n == r.step))):
            value = interrupted(Interruption(reason=r.reason, cause=r.cause, key=key, certain=not r.uncertain,
                                             step=r.step))
            return await self._end(n, key, kind, value, wait and not idempotent)
        self._calls += 1
        try:
            try:
                await self._begin(n, key, kind, idempotent)
                value = fn()
                if inspect.isawaitable(value):
                    value = await value
            except BaseException:
                self._failed(n, key, kind)
                raise
            return await self._end(n, key, kind, value, wait and not idempotent)
        finally:
            self._calls -= 1

    def _failed(self, n: int, key: str, kind: str) -> None:
        """Step `n` ends without a result: its number is closed (a resumed
        turn runs it again, never takes it for one in flight)."""
        self._marks.pop(n, None)
        self._send(m.StepDone(turn=self._turn, n=n, key=key, kind=kind, failed=True))

    async def _begin(self, n: int, key: str, kind: str, idempotent: bool) -> None:
        """Send step `n`'s start; return once its `fn` may run."""
        if idempotent:
            self._started(n, key, kind)
            return
        if self._calls == 1:  # alone (for now): the barrier, then go
            before = list(self._unsaved.values())
            if before:
                await asyncio.gather(*before)
            if self._refused:
                raise StepError(self._refused)
            if self._calls == 1 and not self._unsaved:
                self._started(n, key, kind)
                return
        # Steps overlap: run once this start is durable, which the daemon
        # answers after journaling what was sent before it (every step that
        # ended before this one started among it).
        mark = self._marks[n] = asyncio.get_running_loop().create_future()
        self._started(n, key, kind, durable=True)
        await mark
        if self._refused:
            raise StepError(self._refused)

    def _encoded(self, n: int, key: str, value: Any) -> bytes:
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
        return data

    def _started(self, n: int, key: str, kind: str, durable: bool = False) -> None:
        self._send(m.StepBegun(turn=self._turn, n=n, key=key, kind=kind, durable=durable))
        self._flush()  # out before fn starts: the daemon knows what ran if we die now

    async def _end(self, n: int, key: str, kind: str, value: Any, wait: bool) -> Any:
        """Journal step `n`'s result; return it (once durable if `wait`)."""
        try:
            data = self._encoded(n, key, value)
        except StepError:
            self._failed(n, key, kind)
            raise
        fut = self._unsaved[n] = asyncio.get_running_loop().create_future()
        self._send(m.StepDone(turn=self._turn, n=n, key=key, kind=kind, result=data))
        self._flush()
        if wait:
            await fut
            if self._refused:
                raise StepError(self._refused)
        return _decode(data)
