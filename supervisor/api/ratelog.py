"""Warnings a hostile or broken peer can make us repeat, rate-limited per peer.

A fuzzer that opens thousands of connections with oversized frames made one
warning line each (6,500 lines in one run): the journal fills and the lines
that matter scroll away.  Per key (a peer's uid), at most `burst` lines per
`window_secs`; past that they are counted, and the next line let through
says how many were held back.  Runs in the daemon's loop.
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, burst: int = 10, window_secs: float = 60.0,
                 max_keys: int = 4096) -> None:
        self._log = logger
        self._burst = burst
        self._window = window_secs
        self._max_keys = max_keys
        # key -> [window start, lines let through in it, lines held back]
        self._seen: dict[Any, list[float]] = {}

    def warning(self, key: Any, msg: str, *args: Any) -> None:
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self._window:
            held = int(entry[2]) if entry is not None else 0
            if len(self._seen) >= self._max_keys:
                self._seen.clear()  # bounded: forgetting only lets lines through
            entry = self._seen[key] = [now, 0.0, 0.0]
            if held:
                msg += f" ({held} similar line(s) held back in the last {self._window:g}s)"
        if entry[1] >= self._burst:
            entry[2] += 1
            return
        entry[1] += 1
        self._log.warning(msg, *args)
