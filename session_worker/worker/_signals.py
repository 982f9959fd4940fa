"""Setting a signal's disposition in a freshly forked worker, cheaply.

`signal.signal` wraps the C call to convert the previous handler to a
`signal.Handlers` enum member, and that conversion (the enum's Python
machinery, an exception when the previous handler is a function) is the
first Python a worker would run after fork: in `bench/README.md`'s
measurements it copied ~0.2 MiB of the zygote's pages into every worker.
The C function underneath takes the same arguments and does the same;
only the return value is not an enum.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType
from typing import Any

import _signal  # type: ignore[import-not-found]

__all__ = ["set_signal"]

Handler = Callable[[int, FrameType | None], Any] | int


def set_signal(signum: int, handler: Handler) -> None:
    """`signal.signal(signum, handler)`, without the enum conversion.
    (The C function knows SIG_DFL and SIG_IGN as plain ints, not as the
    `signal.Handlers` members; `int()` of one is done in C.)"""
    _signal.signal(signum, handler if callable(handler) else int(handler))
