"""Handlers with one behaviour each, for tests (`fixture_handlers:NAME`)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from session_worker.handler import HandlerInit, TurnContext, TurnFailure, TurnResult


class _Base:
    def __init__(self, init: HandlerInit) -> None:
        self.turns = 0
        self.init = init

    def restore(self, state: Any, records: list[Any]) -> None:
        self.turns = int(state or 0) + len(records)

    def snapshot(self) -> Any:
        return self.turns

    async def aclose(self) -> None:
        return None


class Slow(_Base):
    """Streams 'tick i' deltas forever-ish, 20 ms apart, until interrupted or
    `count` is reached (the input text is the count)."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        count = int(text) if text.isdigit() else 1000
        parts: list[str] = []
        try:
            for i in range(count):
                piece = f"tick {i}\n"
                parts.append(piece)
                ctx.emit(piece)
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            self.turns += 1
            return TurnResult("".join(parts), record=1, interrupted=True)
        self.turns += 1
        return TurnResult("".join(parts), record=1)


def slow(init: HandlerInit) -> Slow:
    return Slow(init)


class CrashMidTurn(_Base):
    """Turn text 'crash' kills the worker with SIGKILL after one delta."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        if text == "crash":
            ctx.emit("about to crash")
            await asyncio.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        if text == "fail":
            raise TurnFailure("asked to fail", record=1)
        self.turns += 1
        ctx.emit(f"{self.turns}: {text}")
        return TurnResult(f"{self.turns}: {text}", record=1)


def crash_mid_turn(init: HandlerInit) -> CrashMidTurn:
    return CrashMidTurn(init)


def crash_at_boot(init: HandlerInit) -> Any:
    raise RuntimeError("this handler cannot start")


class BigReply(_Base):
    """Replies with int(text) bytes in 4 KiB deltas, paced so that a client
    that reads keeps up and one that does not falls behind."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        total = int(text)
        chunk = "x" * 4096
        sent = 0
        while sent < total:
            ctx.emit(chunk)
            sent += len(chunk)
            await asyncio.sleep(0.0005)
        self.turns += 1
        return TurnResult("big", record=1)


def big_reply(init: HandlerInit) -> BigReply:
    return BigReply(init)
