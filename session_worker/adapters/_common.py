"""What the framework adapters share: a tool call (or a graph's node) as a
durable step, the turn's spend, the notices and records clients read.

Runs in the worker's event loop, inside the turn's task and the tasks a
framework makes for its parallel tool calls or nodes.  Everything a client
sees of an adapter's turn is what it sees of the built-in agent's: the
same `tool_call`/`tool_result` notices, the same `[[permissions]]` rules,
the same result for a tool its worker died in (`agent._loop._killed_result`),
the same `[agent.budget]` check before each LLM call, the same records
(`ops` of appended messages, which `sessionctl history` reads).

A step's `fn` may itself reach code that would make steps: an agent used
as a tool runs a whole nested run, a subgraph runs its own nodes.  What runs
inside a step is part of that step (journaled with it, never on its own):
`inside_step()` says so, and the adapters then call straight through.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec

from ipc.contract import LimitKind
from session_worker.agent import _budget, _traced
from session_worker.agent._errors import BudgetReached
# The agent's own words for a tool its worker died in: the model reads one wording.
from session_worker.agent._loop import _killed_result as killed_result
from session_worker.agent._permissions import decide
from session_worker.agent._stream import usage_counts
from session_worker.handler import TurnContext

__all__ = ["Spend", "append_ops", "in_step", "inside_step", "journalable", "parse_arguments", "tool_step",
           "turn_limit_note"]

_asking: weakref.WeakKeyDictionary[TurnContext, asyncio.Lock] = weakref.WeakKeyDictionary()
_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("sessiond_inside_step", default=False)
_encode = msgspec.msgpack.Encoder().encode
# As the agent's: how much of a tool's output goes into the `tool_result` notice.
_NOTICE_OUTPUT_CHARS = 2000


def inside_step() -> bool:
    """Whether this code runs inside a step's `fn` (see the module's docstring)."""
    return _inside.get()


@contextlib.contextmanager
def in_step() -> Iterator[None]:
    token = _inside.set(True)
    try:
        yield
    finally:
        _inside.reset(token)


def parse_arguments(raw: str) -> dict[str, Any] | None:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _main_argument(schema: dict[str, Any], args: dict[str, Any] | None) -> str:
    """What `[[permissions]]` match on, as for a custom tool: the first
    required argument."""
    required = schema.get("required") if isinstance(schema, dict) else None
    if not args or not isinstance(required, list) or not required:
        return ""
    value = args.get(required[0])
    return "" if value is None else value if isinstance(value, str) else json.dumps(value)


def journalable(value: Any) -> Any:
    """A tool's return value as a step can journal it (msgpack): as it is
    when it encodes, a pydantic model's JSON form, else its text."""
    try:
        _encode(value)
        return value
    except (TypeError, msgspec.EncodeError, OverflowError):
        pass
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        with contextlib.suppress(Exception):
            return dump(mode="json")
    return str(value)


async def tool_step(ctx: TurnContext, name: str, call_id: str, raw_arguments: str, schema: dict[str, Any],
                    run: Callable[[], Awaitable[Any]], approval: Callable[[], Awaitable[bool]] | None = None,
                    ) -> tuple[bool, Any]:
    """One tool call as a durable step `tool:NAME:ID`, as the agent runs
    its own: `tool_call` notice, `[[permissions]]` (then the framework's
    own approval: `approval()` True asks the clients), the tool, its value
    journaled; a tool its worker died in is answered as killed (unless it
    is in `[tools] rerun_after_crash`); the `tool_result` notice after.
    Steps of parallel calls run side by side, each known by its key."""

    async def fn() -> tuple[bool, Any]:
        args = parse_arguments(raw_arguments)
        ctx.notice("tool_call", {"id": call_id, "name": name, "arguments": args if args is not None else raw_arguments})
        action = decide(ctx.settings.permissions, name, _main_argument(schema, args))
        if action == "deny":
            return False, f"error: permission denied: a rule forbids this {name} call."
        if (action == "ask" or (approval is not None and await approval())) and \
                not await _ask(ctx, name, args if args is not None else {"arguments": raw_arguments}):
            return False, f"error: permission denied: the user did not approve this {name} call."
        with in_step():
            value = await run()
        return True, journalable(value)

    rerun = name in ctx.settings.tools.rerun_after_crash
    result = await ctx.step(f"tool:{name}:{call_id}", lambda: _traced.tool_call(call_id, name, fn(), raw_arguments), kind="tool",
                            interrupted=None if rerun else killed_result, idempotent=rerun, wait=False)
    ok, value = bool(result[0]), result[1]
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    ctx.notice("tool_result", {"id": call_id, "name": name, "ok": ok, "output": text[:_NOTICE_OUTPUT_CHARS],
                               "truncated": len(text) > _NOTICE_OUTPUT_CHARS})
    return ok, value


async def _ask(ctx: TurnContext, tool: str, arguments: dict[str, Any]) -> bool:
    """Parallel calls ask one at a time, as the agent's: a client answers
    one prompt."""
    lock = _asking.get(ctx)
    if lock is None:
        lock = _asking[ctx] = asyncio.Lock()
    async with lock:
        return await ctx.ask_permission(tool, arguments)


class Spend:
    """The turn's LLM calls and tokens, live or replayed from their steps:
    checked against `[agent.budget]` before each call made now, reported to
    the daemon after each, and the turn's `TurnResult.usage`."""

    def __init__(self, ctx: TurnContext) -> None:
        self._ctx = ctx
        self._turn = _budget.TurnSpend()

    def check(self) -> None:
        """BudgetReached when a ceiling leaves no room for another call."""
        _budget.check(self._ctx.settings.agent.budget, self._ctx, self._turn)

    def add(self, usage: dict[str, Any] | None) -> None:
        """One call's usage, in OpenAI's or Anthropic's names."""
        self._turn.add(usage_counts(usage))
        self._ctx.report_spend(dict(self._turn.counts))

    def tokens(self) -> dict[str, int]:
        return self._turn.tokens()

    def stopped(self, exc: BudgetReached) -> str:
        """Report the ceiling that stopped the turn; the note the user and
        the model read."""
        self._ctx.budget_exceeded(exc.ceiling, exc.used, exc.limit, exc.unit)
        return _budget.stop_note(exc)


def turn_limit_note(ctx: TurnContext, calls: int) -> str:
    """`agent.max_turns` reached: reported, and the note the user reads."""
    limit = ctx.settings.agent.max_turns
    ctx.limit_exceeded(LimitKind.TURNS, calls, limit)
    return (f"[Stopped: reached the limit of {limit} model calls for one input (agent.max_turns). "
            "Send another message to continue.]")


def append_ops(messages: list[Any]) -> list[dict[str, Any]]:
    """A turn record's `ops`, as the agent's (what `sessionctl history`
    reads for tool calls and results)."""
    return [{"op": "append", "message": message} for message in messages]
