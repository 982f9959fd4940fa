"""Handlers used by the bench scripts (`bench.bench_handlers:NAME`).

They run inside workers, so the daemon must be able to import them: the
bench scripts start the daemon with the repo root on PYTHONPATH and name the
handlers `bench.bench_handlers:grow` and `bench.bench_handlers:overcap`
(bench/ is a namespace package under the repo root).  Naming them through
`bench.` rather than putting bench/ itself on the path keeps bench scripts
such as bench/ipc.py from shadowing the project's packages in the daemon.

* `grow`: keeps every input in a list; a turn's record is its input, the
  snapshot is the whole list, so the state (and what a restarted worker must
  restore) grows with the history.  Replies like echo: `N: TEXT`, N being the
  list's length, so a restored history shows.
* `overcap`: allocates (touching every page) to about 1 MiB under the
  session's `max_memory_mb`, writes `time.time()` and its RSS to
  `<workspace>/<input text>`, then allocates 2 MiB more in one step (crossing
  the cap during that step), appends the time and RSS after the step, and
  sleeps until killed.  The first time is the latest moment the worker was
  certainly still under the cap; with both lines the crossing can be
  interpolated.
* `nap` (a tool, `[tools] custom`): sleeps the milliseconds it is asked to.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from session_worker.handler import HandlerInit, TurnContext, TurnResult

MIB = 1024 * 1024
_PAGE = os.sysconf("SC_PAGE_SIZE")


class Grow:
    def __init__(self, init: HandlerInit) -> None:
        self.messages: list[str] = []

    def restore(self, state: Any, records: list[Any]) -> None:
        self.messages = list(state or [])
        self.messages.extend(str(r) for r in records)

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        n = len(self.messages) + 1
        head = f"{n}: "
        mid = len(text) // 2
        pieces = [head, text[:mid], text[mid:]]
        for piece in pieces:
            if piece:
                ctx.emit(piece)
        await asyncio.sleep(0)
        self.messages.append(text)
        return TurnResult(reply="".join(pieces), record=text)

    def snapshot(self) -> Any:
        return self.messages

    async def aclose(self) -> None:
        return None


def grow(init: HandlerInit) -> Grow:
    return Grow(init)


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


class OverCap:
    def __init__(self, init: HandlerInit) -> None:
        self.cap = init.settings.agent.limits.max_memory_mb * MIB
        self.workspace = init.workspace
        self.turns = 0

    def restore(self, state: Any, records: list[Any]) -> None:
        self.turns = int(state or 0) + len(records)

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        hoard: list[bytes] = []
        below = self.cap - MIB
        while (need := below - _rss()) > MIB // 4:
            hoard.append(b"\x01" * (need - MIB // 8))
        path = self.workspace / os.path.basename(text)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            t0 = time.time()
            os.write(fd, f"{t0!r} {_rss()}\n".encode())
            hoard.append(b"\x01" * (2 * MIB))  # crosses the cap in here
            t1 = time.time()
            os.write(fd, f"{t1!r} {_rss()}\n".encode())
        finally:
            os.close(fd)
        ctx.emit("over the cap\n")
        await asyncio.sleep(60)
        self.turns += 1
        return TurnResult("not killed", record=1)

    def snapshot(self) -> Any:
        return self.turns

    async def aclose(self) -> None:
        return None


def overcap(init: HandlerInit) -> OverCap:
    return OverCap(init)


async def nap(ms: int) -> str:
    """Sleep `ms` milliseconds (a tool that waits on the world, for bench/steps.py)."""
    await asyncio.sleep(ms / 1000)
    return f"slept {ms} ms"
