"""Handlers for the operator-facing tests (`operator_handlers:NAME`), one
behaviour each: what `sessionctl` must show a user, and what the worker
must log."""

from __future__ import annotations

from fixture_handlers import _Base
from session_worker.handler import HandlerInit, TurnContext, TurnResult


class Counter(_Base):
    """The example of docs/agent.md ("Your own handler"): streams a progress
    word, returns the reply without streaming it."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        ctx.emit("counting… ")
        self.turns += 1
        return TurnResult(reply=f"{len(text)} characters, turn {self.turns}", record=1)


def counter(init: HandlerInit) -> Counter:
    return Counter(init)


class Silent(_Base):
    """Streams nothing at all; the reply is only in TurnDone."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        self.turns += 1
        return TurnResult(reply=f"silent reply to {text}", record=1)


def silent(init: HandlerInit) -> Silent:
    return Silent(init)


class Broken(_Base):
    """Raises KeyError from a nested function, so that the last frame is
    not handle() itself."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        return TurnResult(reply=_lookup({}, "missing"), record=1)


def _lookup(table: dict[str, str], key: str) -> str:
    return table[key]


def broken(init: HandlerInit) -> Broken:
    return Broken(init)


class ToolUser(_Base):
    """Acts as the agent loop does around one bash call: a `tool_call`
    notice, a permission request (the input text is the command), a
    `tool_result` notice, then a reply."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        args = {"command": text}
        ctx.notice("tool_call", {"id": "call_1", "name": "bash", "arguments": args})
        allowed = await ctx.ask_permission("bash", args)
        output = "file-a\nfile-b\n" if allowed else "error: permission denied"
        ctx.notice("tool_result", {"id": "call_1", "name": "bash", "ok": allowed,
                                   "output": output, "truncated": False})
        ctx.emit("done\n")
        self.turns += 1
        return TurnResult(reply="done\n", record=1)


def tool_user(init: HandlerInit) -> ToolUser:
    return ToolUser(init)



class TwoAsks(_Base):
    """Asks two permissions at once (as the agent's parallel tool calls may)."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        import asyncio

        answers = await asyncio.gather(ctx.ask_permission("bash", {"command": "one"}),
                                       ctx.ask_permission("write_file", {"path": "two"}))
        self.turns += 1
        return TurnResult(reply=f"{answers}", record=1)


def two_asks(init: HandlerInit) -> TwoAsks:
    return TwoAsks(init)
