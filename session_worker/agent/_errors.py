"""Errors of the agent handler.

Exception tree (everything here stays inside the worker; the handler maps
`ProviderError` to `TurnFailure` at one place, `AgentHandler.handle`)::

    AgentError
    ├── ProviderError            the LLM request failed; message is readable
    │   ├── ProviderHTTPError    a non-2xx answer (status kept)
    │   └── ProviderStreamError  the stream broke: cut, timed out, garbage
    ├── ToolLoadError            tools.enabled / tools.custom cannot be honoured
    ├── ToolError                a tool call failed; the model reads the message
    │   └── McpServerError       an MCP server crashed, hung or spoke garbage: its
    │       │                    connection is dropped and made again at its next call
    │       └── McpStartError    it could not be started or listed: the session does
    │                            not try it again before its backoff (retry_backoff_secs)
    └── BudgetReached            an [agent.budget] ceiling stops the next LLM call
                                 (caught in `Turn.run`: the turn ends, with a note)

Tool failures are not exceptions that leave the tools module: they become tool
results the model can read (`ToolError` is raised and caught inside it).

No message here may carry the provider's API key: the provider redacts
server-provided text before building one, and lower-layer exceptions (whose
request objects hold the Authorization header) are not chained.
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "McpServerError",
    "McpStartError",
    "BudgetReached",
    "ProviderError",
    "ProviderHTTPError",
    "ProviderStreamError",
    "ToolError",
    "ToolLoadError",
]


class AgentError(Exception):
    """Base of the agent handler's own errors."""


class ProviderError(AgentError):
    """The LLM provider could not produce a completion."""


class ProviderHTTPError(ProviderError):
    def __init__(self, status: int, message: str, hint: str = "") -> None:
        text = f"provider answered HTTP {status}: {message}"
        super().__init__(f"{text} ({hint})" if hint else text)
        self.status = status
        # The server's own words, without our hint (to look for a parameter name).
        self.detail = message


class ProviderStreamError(ProviderError):
    """The response stream ended early, stalled, or was not understood."""


class BudgetReached(AgentError):
    """Raised at the one place an LLM request is made, before making it."""

    def __init__(self, ceiling: str, used: int, limit: int, unit: str, unknown: bool = False) -> None:
        super().__init__(f"{ceiling} = {limit} {unit}: {used} {unit} spent")
        self.ceiling, self.used, self.limit, self.unit = ceiling, used, limit, unit
        # A session ceiling of a session imported without its figures.
        self.unknown = unknown


class ToolLoadError(AgentError):
    """A configured tool cannot be set up (unknown name, bad signature)."""


class ToolError(AgentError):
    """A tool call failed in a way the model should be told about."""


class McpServerError(ToolError):
    """An MCP server failed as a server, not as a tool: the call's connection is lost."""


class McpStartError(McpServerError):
    """An MCP server could not be started or did not answer its handshake."""
