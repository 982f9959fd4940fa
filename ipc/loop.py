"""Which event loop sessiond runs on: uvloop when it is installed.

Measured in bench/ipc.py (same run, both loops): a session ping 1.2-2.1x
faster, a framed echo 1.5x, an echo turn 1.1-1.5x, with less CPU in
every process.  The stdlib loop remains the fallback, so nothing breaks
where uvloop cannot be installed.  Every process creates its own loop
(the daemon after forking the zygote, each worker after its fork).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["new_event_loop", "run"]

T = TypeVar("T")

_uvloop_factory: Callable[[], asyncio.AbstractEventLoop] | None
try:
    from uvloop import new_event_loop as _uvloop_factory
except ImportError:  # pragma: no cover (uvloop is a dependency)
    _uvloop_factory = None


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop, unless SESSIOND_EVENT_LOOP=asyncio asks for the stdlib loop
    (for debugging, and for benchmarking one against the other)."""
    if _uvloop_factory is not None and os.environ.get("SESSIOND_EVENT_LOOP") != "asyncio":
        return _uvloop_factory()
    # The policy's loop: the stdlib one, or whatever an embedder installed.
    return asyncio.get_event_loop_policy().new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
