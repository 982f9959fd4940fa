"""A handler whose turns burn CPU in a child process, as a busy tool does
(`bench._burn_handler:burner`, used by bench/load.py).  Runs in a worker.

Input `burn SECS`: one child (`python3 -c`, a busy loop) for SECS seconds,
started as a tool is (it inherits the worker's nice and cgroup); the turn
ends when it does.
"""

from __future__ import annotations

import asyncio
import sys

from session_worker.echo import EchoHandler
from session_worker.handler import HandlerInit, TurnContext, TurnResult

_LOOP = "import time\nend = time.monotonic() + {secs}\nwhile time.monotonic() < end: pass\n"


class Burner(EchoHandler):
    """Echo's turn count, state and close; turns of its own."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        secs = float(text.split()[1]) if text.startswith("burn ") else 0.0
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _LOOP.format(secs=secs))
        await proc.wait()
        self.turns += 1
        return TurnResult(f"burned {secs:g}s", record=1)


def burner(init: HandlerInit) -> Burner:
    return Burner(init)
