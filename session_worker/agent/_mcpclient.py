"""One MCP server of one session, spoken to with the official SDK (`mcp`).

Runs in the worker, and in `session_worker.mcplist` (the process the daemon
lists its servers' tools with).  Imported only when a server is connected
(`_mcp` imports it on a thread at the first connection): the SDK and what
it brings (pydantic, anyio, httpx2) stay out of the zygote and of every
worker that never calls an MCP tool.  The transports: `_mcpstdio` (a
process in the session's sandbox, over its stdin and stdout) and
`_mcphttp` (streamable HTTP, or the legacy HTTP+SSE).

Each connection lives in a task of its own (`McpConnection._own`): the SDK's
client is an async context that must be entered and left by one task, while
calls come from the turns' tasks.  A connection that failed (the process
exited, a garbage line, a call that timed out, the HTTP link broke) is
closed and made again at the next call; nothing is retried within a call.
A server that could not be started says why: its exit code and the last
words of its stderr.

Traced turns get a span for the start (`initialize SERVER`), for a listing
(`tools/list SERVER`) and for each call (`tools/call TOOL`), as
OpenTelemetry's MCP conventions name them; a call carries the W3C trace
context of its span in `params._meta.traceparent` (and over HTTP in a
`traceparent` header), so a server that traces joins the turn's trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import mcp_types
from mcp import Client
from mcp.client._transport import TransportStreams
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError

from session_worker import tracing
from session_worker.agent._bash import OutputCap
from session_worker.agent._errors import McpServerError, McpStartError, ToolError
from session_worker.agent._mcphttp import http_transport
from session_worker.agent._mcpstdio import MAX_MESSAGE_BYTES, StdioProcess, describe_exit, stdio_transport
from ipc.settings import McpServer

__all__ = ["ListedTool", "McpConnection", "render_resource", "render_result"]

log = logging.getLogger("sessiond.mcp")
# The SDK logs every HTTP request at INFO and each parse failure with a
# traceback: the server's own failures reach the model and the log through
# our messages instead.
for _name in ("mcp", "httpx2"):
    logging.getLogger(_name).setLevel(logging.CRITICAL)

_MAX_PAGES = 16
_CLOSE_GRACE_SECS = 0.5
_LIST_CHANGED = frozenset({"notifications/tools/list_changed", "notifications/resources/list_changed"})


@dataclass(frozen=True, slots=True)
class ListedTool:
    """A tool as the server listed it: still hostile input (see `_mcp`)."""

    name: str
    description: str
    schema: Any


class McpConnection:
    """One server for one session: connected on first use, kept until it
    fails or the session closes it.  `on_change(server)`: the server said
    its tools or resources changed (`notifications/*/list_changed`)."""

    def __init__(self, server: McpServer, workspace: Path,
                 on_change: Callable[[str], None] | None = None) -> None:
        self.server = server
        self._workspace = workspace
        self._on_change = on_change
        self._client: Client | None = None
        self._owner: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._stop = asyncio.Event()
        self._process: StdioProcess | None = None
        # The connection ended (the server's stdout, the HTTP link, a close).
        self._ended = False
        # What the running server said of itself at the handshake.
        self.version = ""
        self.resources = False
        self.starts = 0

    @property
    def name(self) -> str:
        return self.server.name

    @property
    def connected(self) -> bool:
        return self._client is not None and not self._ended and not (
            self._process is not None and self._process.ended)

    # -- connecting --------------------------------------------------------

    async def connect(self, timeout: float) -> Client:
        if self.connected:
            assert self._client is not None
            return self._client
        async with self._connecting:  # calls side by side: one start, which the others wait for
            if self.connected:
                assert self._client is not None
                return self._client
            return await self._connect(timeout)

    async def _connect(self, timeout: float) -> Client:
        await self.close()
        self._ended = False
        self._stop = asyncio.Event()
        self.starts += 1
        transport = "pipe" if self.server.command is not None else "tcp"
        attributes = {"mcp.method.name": "initialize", "sessiond.mcp.server": self.name,
                      "network.transport": transport}
        with tracing.span(f"initialize {self.name}", tracing.CLIENT, attributes) as span:
            ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
            self._owner = asyncio.ensure_future(self._own(ready))
            try:
                async with asyncio.timeout(timeout):
                    client = await asyncio.shield(ready)
            except TimeoutError:
                failure = await self._start_failed(f"did not start and answer within {timeout:g} s "
                                                   "(mcp.start_timeout_secs)")
                span.fail(str(failure))
                raise failure from None
            except McpServerError as exc:
                await self.close()
                span.fail(str(exc))
                raise McpStartError(str(exc)) from None
            except Exception as exc:
                failure = await self._start_failed(None, exc)
                span.fail(str(failure))
                raise failure from None
            info = client.server_info
            self.version = (info.version or "")[:128] if info is not None else ""
            capabilities = client.server_capabilities
            self.resources = capabilities.resources is not None
            span.set("mcp.protocol.version", client.protocol_version)
            if self.version:
                span.set("sessiond.mcp.server.version", self.version)
        self._client = client
        return client

    async def _start_failed(self, why: str | None, exc: BaseException | None = None) -> McpStartError:
        """Why the server did not come up, with its exit code and the last
        words of its stderr when it is a process."""
        proc = self._process
        if proc is not None and why is None:
            code = await proc.exit_code()
            why = proc.lost or (f"{describe_exit(code)} before it answered the handshake" if code is not None
                                else f"could not be started: {self._why(exc) if exc else 'it stopped answering'}")
        elif why is None:
            why = f"could not be started: {self._why(exc) if exc else 'unknown'}"
        await self.close()
        tail = proc.last_words() if proc is not None else ""
        return McpStartError(f"MCP server {self.name!r} {why}{tail}")

    async def _own(self, ready: asyncio.Future[Client]) -> None:
        """The task that enters and leaves the SDK's client."""
        try:
            async with Client(self._transport(), cache=None, message_handler=self._on_message) as client:
                if not ready.done():
                    ready.set_result(client)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else McpServerError("cancelled"))
                ready.exception()
            if not isinstance(exc, (Exception, asyncio.CancelledError)):
                raise
            if not isinstance(exc, asyncio.CancelledError):
                log.debug("MCP server %s: connection ended: %r", self.name, exc)
        finally:
            self._ended = True

    @contextlib.asynccontextmanager
    async def _transport(self) -> AsyncIterator[TransportStreams]:
        if self.server.command is None:
            async with http_transport(self.server, MAX_MESSAGE_BYTES) as streams:
                yield streams
            return

        def started(proc: StdioProcess) -> None:
            self._process = proc

        async with stdio_transport(self.server, self._workspace, started) as streams:
            yield streams

    async def _on_message(self, message: Any) -> None:
        if getattr(message, "method", None) in _LIST_CHANGED and self._on_change is not None:
            self._on_change(self.name)

    # -- using it ----------------------------------------------------------

    async def list_tools(self, timeout: float) -> list[ListedTool]:
        attributes = {"mcp.method.name": "tools/list", "sessiond.mcp.server": self.name}
        with tracing.span(f"tools/list {self.name}", tracing.CLIENT, attributes) as span:
            client = await self.connect(timeout)
            tools: list[ListedTool] = []
            cursor: str | None = None
            try:
                async with asyncio.timeout(timeout):
                    for _ in range(_MAX_PAGES):
                        page = await client.list_tools(cursor=cursor)
                        tools += [ListedTool(t.name, t.description or "", t.input_schema) for t in page.tools]
                        cursor = page.next_cursor
                        if cursor is None:
                            break
            except TimeoutError:
                await self.close()
                raise McpServerError(f"MCP server {self.name!r} did not list its tools within {timeout:g} s "
                                     "(mcp.start_timeout_secs)") from None
            except Exception as exc:
                raise await self._failed("tools/list", exc) from None
            span.set("sessiond.mcp.tools", len(tools))
            return tools

    async def call(self, tool: str, arguments: dict[str, Any], timeout: float, start_timeout: float) -> Any:
        attributes = {"mcp.method.name": "tools/call", "gen_ai.tool.name": tool, "sessiond.mcp.server": self.name,
                      "gen_ai.operation.name": "execute_tool"}
        with tracing.span(f"tools/call {tool}", tracing.CLIENT, attributes):
            return await self._request(tool, f"the call to {tool}", timeout, start_timeout,
                                       lambda client: client.call_tool(tool, arguments, meta=_trace_meta()))

    async def resources_page(self, cursor: str | None, timeout: float, start_timeout: float) -> Any:
        """One page of resources/list."""
        return await self._request("resources/list", "resources/list", timeout, start_timeout,
                                   lambda client: client.list_resources(cursor=cursor))

    async def read(self, uri: str, timeout: float, start_timeout: float) -> Any:
        """resources/read of one URI."""
        attributes = {"mcp.method.name": "resources/read", "sessiond.mcp.server": self.name}
        with tracing.span("resources/read", tracing.CLIENT, attributes):
            return await self._request(f"resources/read of {uri!r}", f"resources/read of {uri!r}", timeout,
                                       start_timeout, lambda client: client.read_resource(uri, meta=_trace_meta()))

    async def _request(self, what: str, during: str, timeout: float, start_timeout: float,
                       send: Callable[[Client], Awaitable[Any]]) -> Any:
        """One request of a tool's (connected first if need be): its answer,
        or why not, in words the model reads.  A timeout or a lost
        connection closes the connection (made again at the next call); the
        server's own refusal leaves it be."""
        client = await self.connect(start_timeout)
        try:
            async with asyncio.timeout(timeout):
                return await send(client)
        except TimeoutError:
            await self.close()
            raise McpServerError(
                f"MCP server {self.name!r} did not answer {what} within {timeout:g} s (mcp.call_timeout_secs); "
                "it was stopped and starts again at the next call") from None
        except MCPError as exc:
            if exc.code != mcp_types.CONNECTION_CLOSED:
                raise ToolError(f"MCP server {self.name!r} refused {during}: {exc.message}") from None
            raise await self._failed(during, exc) from None
        except Exception as exc:
            raise await self._failed(during, exc) from None

    async def _failed(self, during: str, exc: Exception) -> McpServerError:
        """The connection is lost: why, in words; closed, so that the next
        call makes a new one."""
        proc = self._process
        why = proc.lost if proc is not None else ""
        if not why and proc is not None:
            why = describe_exit(await proc.exit_code())
        if not why:
            why = f"failed: {self._why(exc)}"
        tail = proc.last_words() if proc is not None else ""
        await self.close()
        return McpServerError(f"MCP server {self.name!r} {why} during {during}{tail}; "
                              "it starts again at the next call")

    def _why(self, exc: BaseException) -> str:
        """`exc` in a line for the model (the SDK's messages can carry a
        whole pydantic report)."""
        text = self._explain(exc).strip().splitlines()
        line = text[0] if text else type(exc).__name__
        return line[:300] + ("..." if len(line) > 300 else "")

    def _explain(self, exc: BaseException) -> str:
        if isinstance(exc, MCPError):
            return exc.message
        if isinstance(exc, ValidationError):
            return f"it answered with something that is not valid MCP ({exc.error_count()} problem(s))"
        if isinstance(exc, httpx2.HTTPError):
            return f"HTTP: {exc}"
        if isinstance(exc, BaseExceptionGroup):
            return "; ".join(self._explain(e) for e in exc.exceptions)
        return f"{type(exc).__name__}: {exc}"

    async def close(self) -> None:
        owner, self._owner = self._owner, None
        self._client = None
        self._process = None
        if owner is None:
            return
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(owner), 2 * _CLOSE_GRACE_SECS + 1.0)
        except (TimeoutError, asyncio.CancelledError, Exception):
            owner.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(owner, 1.0)


def _trace_meta() -> Any:
    """The request's `_meta`: W3C trace context of the open span (the
    call's), or None when the turn is not traced."""
    parent = tracing.traceparent()
    return {"traceparent": parent} if parent else None


def render_resource(result: Any, limit: int) -> str:
    """A ReadResourceResult as text for the model, cut to `limit` bytes."""
    parts: list[str] = []
    for item in result.contents or ():
        text = getattr(item, "text", None)
        if isinstance(text, str):
            parts.append(text)
        else:
            parts.append(f"[{item.uri}: binary ({item.mime_type or 'unknown type'}), not shown]")
    cap = OutputCap(limit)
    cap.feed("\n".join(parts).encode("utf-8", "replace"))
    return cap.text()


def render_result(result: Any, limit: int) -> tuple[bool, str]:
    """A CallToolResult as text for the model, cut to `limit` bytes (the
    tools' output cap): (is_error, text)."""
    parts: list[str] = []
    for block in result.content or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {block.mime_type}, {len(block.data) * 3 // 4} bytes: not shown]")
        elif kind == "resource":
            inner = block.resource
            text = getattr(inner, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource {inner.uri}: binary, not shown]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {block.uri}]")
    if not parts and result.structured_content is not None:
        import json

        parts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    cap = OutputCap(limit)
    cap.feed("\n".join(parts).encode("utf-8", "replace"))
    return bool(result.is_error), cap.text()
