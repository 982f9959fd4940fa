"""User tools for the agent tests (loaded through `tools.custom`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Optional


def word_count(text: str, min_length: int = 1, ignore: list[str] | None = None) -> int:
    """Count the words in a text.

    Words shorter than min_length and words in ignore are not counted."""
    skip = set(ignore or [])
    return sum(1 for w in text.split() if len(w) >= min_length and w not in skip)


async def scale(values: list[float], factor: float, label: Optional[str] = None, exact: bool = False) -> dict[str, object]:
    """Multiply numbers by a factor."""
    await asyncio.sleep(0)
    return {"label": label, "values": [v * factor for v in values], "exact": exact}


def explode(reason: str) -> str:
    """Always fails."""
    raise ValueError(f"exploded: {reason}")


def untyped(x):  # type: ignore[no-untyped-def]
    return x


def with_varargs(*names: str) -> str:
    return ",".join(names)


def with_dict(options: dict[str, str]) -> str:
    return str(options)


# What `rendezvous` calls did, in order ("start N", "end N"); cleared by the tests.
RENDEZVOUS: list[str] = []


async def rendezvous(n: int, of: int, wait_secs: float = 10.0) -> str:
    """Starts, waits (at most wait_secs) until `of` calls have started, then
    ends once call n+1 has ended: calls run at once end in reverse order.
    Alone (the others never came): says so."""

    async def until(met: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + wait_secs
        while not met():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    RENDEZVOUS.append(f"start {n}")
    if not await until(lambda: sum(e.startswith("start") for e in RENDEZVOUS) >= of):
        RENDEZVOUS.append(f"end {n}")
        return f"{n}: alone"
    if n + 1 < of:
        await until(lambda: f"end {n + 1}" in RENDEZVOUS)
    RENDEZVOUS.append(f"end {n}")
    return f"{n}: met"
