"""User tools for the agent tests (loaded through `tools.custom`)."""

from __future__ import annotations

import asyncio
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
