"""Data-plane work in bounded slices, so that the loop reads between them.

Why: an asyncio loop runs, in each pass, every callback that was ready when
the pass began, and only then reads its sockets again.  Under load the
daemon's passes grew to 5-40 ms (bench/load.py, 50 sessions: group commit
completes 50 turns at once, and their 50 next inputs arrive together), and
a `ping` read at the start of a pass was answered at its end.  Work that
can wait a moment (a worker's messages, a turn's input, a flush's
completion) is queued here instead and run in slices of `budget_secs`;
after each slice the loop polls again before the next one, so a control
request waits for at most one slice.

Light load pays nothing: `now_or_later` runs the work at once when
nothing is queued and the work already run at once in this pass is under
the budget (a lone session's turn takes no extra pass; measured with
bench/ipc.py, deferring everything cost a session ping ~8% more CPU in the
daemon).

Order: one FIFO for everything deferred, so what one connection sent is
handled in the order it was sent, and a completion queued after a message
runs after it.  Code that must keep its order with deferred work (a
client's request on a connection that still has requests queued) defers
too.

Runs on the loop of the process that uses it (the daemon); one per daemon.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Pacer", "SLICE_SECS"]

log = logging.getLogger(__name__)

# Measured (bench/load.py, 50 sessions): slices of 0.5 ms keep a ping's p99
# near the slice plus the loop's own I/O, and cost no throughput: the extra
# passes cost one epoll_wait each (~0.7 more a turn at 200 sessions, 1.4 µs
# a pass on uvloop), and slices of 4 ms or slices that never end were no
# faster at 200 sessions, interleaved (bench/README.md).
SLICE_SECS = 0.0005


class Pacer:
    def __init__(self, budget_secs: float = SLICE_SECS) -> None:
        self.budget_secs = budget_secs
        self._queue: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        # Work run at once (now_or_later) in this pass of the loop, and
        # whether some is running now (what it defers waits its turn).
        self._inline_secs = 0.0
        self._inline = False

    def __len__(self) -> int:
        return len(self._queue)

    def now_or_later(self, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` now if nothing is queued ahead of it and this pass
        has run less than a slice's worth at once; else `defer`."""
        if self._queue or self._inline or self._inline_secs >= self.budget_secs:
            self.defer(fn, *args)
            return
        if self._inline_secs == 0.0:
            self._loop_now().call_soon(self._new_pass)
        self._inline = True
        began = time.perf_counter()
        try:
            fn(*args)
        except Exception:
            log.exception("%r failed", fn)
        finally:
            self._inline = False
            self._inline_secs += max(time.perf_counter() - began, 1e-9)

    def _new_pass(self) -> None:
        self._inline_secs = 0.0

    def _loop_now(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def defer(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` in a later slice, after everything deferred
        before it."""
        self._queue.append((fn, args))
        if not self._scheduled:
            self._scheduled = True
            self._loop_now().call_soon(self._slice)

    def _slice(self) -> None:
        queue = self._queue
        deadline = time.perf_counter() + self.budget_secs
        while queue:
            fn, args = queue.popleft()
            try:
                fn(*args)
            except Exception:  # one item's bug must not stall the others
                log.exception("deferred %r failed", fn)
            if time.perf_counter() >= deadline:
                break
        loop = self._loop
        if queue and loop is not None and not loop.is_closed():
            # The next pass: the loop polls its sockets first.
            loop.call_soon(self._slice)
        else:
            queue.clear()  # (only left over when the loop is gone)
            self._scheduled = False
