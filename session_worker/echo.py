"""The `echo` handler: replies `N: TEXT`, N being the session's turn count
including this turn.  N comes from the handler's own restored state, so a
worker restarted from the log shows the history it was given; smoke tests and
benchmarks rely on that."""

from __future__ import annotations

import asyncio
from typing import Any

from session_worker.handler import HandlerInit, TurnContext, TurnResult

__all__ = ["EchoHandler"]


class EchoHandler:
    def __init__(self, init: HandlerInit) -> None:
        self.turns = 0

    def restore(self, state: Any, records: list[Any]) -> None:
        self.turns = int(state or 0) + len(records)

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        n = self.turns + 1
        # A few deltas, as a real model would stream them.
        head = f"{n}: "
        mid = len(text) // 2
        pieces = [head, text[:mid], text[mid:]]
        for piece in pieces:
            if piece:
                ctx.emit(piece)
        await asyncio.sleep(0)  # a cancellation point, like any real handler
        self.turns = n
        return TurnResult(reply="".join(pieces), record=1)

    def snapshot(self) -> Any:
        return self.turns

    async def aclose(self) -> None:
        return None
