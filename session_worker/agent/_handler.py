"""`AgentHandler`: the LLM agent loop as a `session_worker.handler.Handler`.

Created once per worker (by `load_factory("agent")`), lives as long as the
worker.  It owns the provider client, the tool registry and the history; each
`handle()` runs one `Turn`.  This is the one place where the handler's own
errors become `TurnFailure` (see `_loop.Turn.run` for the mapping).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from session_worker.agent._builtins import BUILTIN_NAMES, builtin_tools
from session_worker.agent._compaction import RequestSizes
from session_worker.agent._custom import load_custom_tool
from session_worker.agent._errors import ToolLoadError
from session_worker.agent._history import History
from session_worker.agent._loop import Turn
from session_worker.agent._mcp import McpTools, close_all
from session_worker.agent._provider import Provider
from session_worker.agent._tools import Tool, ToolRegistry
from session_worker.errors import TurnFailure
from session_worker.handler import HandlerInit, TurnContext, TurnResult
from ipc.settings import SessionSettings

if TYPE_CHECKING:
    from session_worker.agent._mcpclient import McpConnection

__all__ = ["AgentHandler", "build_registry"]


def build_registry(settings: SessionSettings, depth: int, mcp: Sequence[Tool] = ()) -> ToolRegistry:
    """The tools offered to the model.  `spawn_agent` is withheld at or
    beyond the sub-agent depth limit, so the model is never offered a tool
    the daemon would refuse.  `mcp`: the MCP servers' tools listed so far,
    offered after the rest."""
    custom = [load_custom_tool(spec) for spec in settings.tools.custom]
    custom_names = {tool.name for tool in custom}
    builtins = builtin_tools()
    tools: list[Tool] = []
    for name in settings.tools.enabled:
        if name in custom_names:
            continue
        if name not in builtins:
            raise ToolLoadError(
                f"tools.enabled: unknown tool {name!r}; built-in tools are "
                + ", ".join(BUILTIN_NAMES)
            )
        if name == "spawn_agent" and depth >= settings.agent.subagents.max_depth:
            continue
        tools.append(builtins[name])
    for tool in custom:
        if tool.name in builtins:
            raise ToolLoadError(f"custom tool {tool.name!r} has the name of a built-in tool")
        tools.append(tool)
    names = {tool.name for tool in tools}
    return ToolRegistry(tools + [tool for tool in mcp if tool.name not in names])


class AgentHandler:
    # Every LLM response and tool result is a durable step (_loop.Turn):
    # a turn its worker dies in is resumed, even before its first step.
    uses_steps = True

    def __init__(self, init: HandlerInit) -> None:
        self._settings = init.settings
        self._depth = init.depth
        init.workspace.mkdir(parents=True, exist_ok=True)
        self._workspace = init.workspace.resolve()
        # The MCP servers' tools join the registry once listed (`handle`).
        self._mcp = McpTools(init.settings.mcp, self._workspace)
        self._stale_mcp: list[McpConnection] = []
        self._tools = build_registry(init.settings, init.depth)
        self._provider = Provider(init.settings.provider)
        self._stale_providers: list[Provider] = []
        self._history = History()
        self._sizes = RequestSizes()
        self._turn: Turn | None = None

    def reconfigure(self, settings: SessionSettings) -> None:
        """A reloaded config: permission rules, enabled tools and the loop's
        limits apply from the running turn's next tool call; a changed
        provider from the next turn (a request in flight keeps its client)."""
        if settings.mcp != self._settings.mcp:
            self._stale_mcp += self._mcp.reconfigure(settings.mcp)
        mcp = self._mcp.tools()
        try:
            tools = build_registry(settings, self._depth, mcp)
        except ToolLoadError:
            # Tools the new config names cannot load: keep only the old ones
            # it still enables, never more than before.
            tools = ToolRegistry(
                [t for n in self._tools.names() if n in settings.tools.enabled and (t := self._tools.get(n))]
                + mcp
            )
        if settings.provider != self._settings.provider:
            self._stale_providers.append(self._provider)
            self._provider = Provider(settings.provider)
        self._settings = settings
        self._tools = tools
        if self._turn is not None:
            self._turn.reconfigure(settings, tools)

    @property
    def tools(self) -> ToolRegistry:
        return self._tools

    def restore(self, state: Any, records: list[Any]) -> None:
        self._history = History.restored(state, records)

    def snapshot(self) -> Any:
        return self._history.snapshot()

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        if not self._settings.provider.configured:
            raise TurnFailure(
                "no LLM provider is configured: set provider.base_url and provider.model"
            )
        while self._stale_providers:
            await self._stale_providers.pop().aclose()
        await self._refresh_mcp(ctx)
        turn = Turn(
            settings=self._settings,
            provider=self._provider,
            tools=self._tools,
            history=self._history,
            workspace=self._workspace,
            ctx=ctx,
            sizes=self._sizes,
        )
        self._turn = turn
        try:
            return await turn.run(text)
        finally:
            self._turn = None

    async def _refresh_mcp(self, ctx: TurnContext) -> None:
        """The MCP servers' tools not offered yet join the registry: from
        the daemon's lists (nothing started), else listed here (`_mcp`);
        a tools set that fails to build keeps the one in use."""
        stale, self._stale_mcp = self._stale_mcp, []
        await close_all(stale)
        builtin = [name for name in self._tools.names() if not name.startswith("mcp__")]
        if await self._mcp.discover(ctx.notice, builtin):
            try:
                self._tools = build_registry(self._settings, self._depth, self._mcp.tools())
            except ToolLoadError:
                pass

    async def aclose(self) -> None:
        for provider in (*self._stale_providers, self._provider):
            await provider.aclose()
        await close_all(self._stale_mcp)
        await self._mcp.aclose()
