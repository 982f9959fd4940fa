"""Waiting in a test's event loop for something to become true: polled,
with a deadline (never a fixed sleep), failing with what was awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

__all__ = ["until"]


async def until(predicate: Callable[[], Any], what: str = "the condition", timeout: float = 10.0,
                every: float = 0.005) -> None:
    """Return once `predicate()` is true; AssertionError naming `what`
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(every)
