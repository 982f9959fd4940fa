"""One MCP server of one session, spoken to with the official SDK (`mcp`).

Runs in the worker.  Imported only when the operator lists MCP servers
(`_mcp` imports it at a session's first connection): the SDK and what it
brings (pydantic, anyio, httpx2) stay out of the zygote and of every worker
that has no MCP server.

A stdio server is started where the session's tools are started: by the
session's tool host, inside its sandbox (its uid, namespaces, Landlock,
seccomp, process limit; the memory sweep counts it with the worker's tree),
or by the worker itself when `sandbox.mode = "off"`.  So the SDK's own stdio
client, which starts the process itself, is not used: `_stdio_transport`
speaks the same newline-delimited JSON-RPC over three pipes of ours.  What
the server writes on stdout is hostile input: a line over the size bound or
one that is not JSON-RPC ends the connection (the server is stopped) with
that reason; its stderr is kept only as a short tail for the error message.

A streamable-HTTP server is reached by the worker, outside the sandbox, at
the operator's URL (the SDK follows a redirect only within that origin).

Each connection lives in a task of its own (`McpConnection._own`): the SDK's
client is an async context that must be entered and left by one task, while
calls come from the turns' tasks.  A connection that failed (the process
exited, a garbage line, a call that timed out, the HTTP link broke) is
closed and made again at the next call; nothing is retried within a call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types
from mcp import Client
from mcp.client._transport import TransportStreams
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from session_worker import _spawn, sandbox
from session_worker.agent._bash import OutputCap, kill_tree, tool_environment
from session_worker.agent._errors import McpServerError, ToolError
from session_worker.errors import SandboxError
from ipc.settings import McpServer

__all__ = ["ListedTool", "McpConnection", "render_result"]

log = logging.getLogger("sessiond.mcp")
# The SDK logs every HTTP request at INFO and each parse failure with a
# traceback: the server's own failures reach the model and the log through
# our messages instead.
for _name in ("mcp", "httpx2"):
    logging.getLogger(_name).setLevel(logging.CRITICAL)

# One JSON-RPC message from a stdio server: past it the server is stopped.
_MAX_MESSAGE_BYTES = 8 << 20
_STDERR_TAIL_BYTES = 2048
_MAX_PAGES = 16
_CLOSE_GRACE_SECS = 0.5
_EXIT_WAIT_SECS = 0.5


@dataclass(frozen=True, slots=True)
class ListedTool:
    """A tool as the server listed it: still hostile input (see `_mcp`)."""

    name: str
    description: str
    schema: Any


class _Process:
    """A stdio server process and the worker's ends of its pipes."""

    def __init__(self, stdin: int, stdout: int, stderr: int) -> None:
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.tail = bytearray()
        self._kill: Any = None

    def kill(self) -> None:
        if self._kill is not None and not self.exited.done():
            self._kill()

    async def exit_code(self) -> int | None:
        with contextlib.suppress(TimeoutError, SandboxError, asyncio.CancelledError):
            return await asyncio.wait_for(asyncio.shield(self.exited), _EXIT_WAIT_SECS)
        return None


async def _start_process(server: McpServer, workspace: Path) -> _Process:
    assert server.command is not None
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    proc = _Process(in_w, out_r, err_r)
    host = sandbox.current()
    env = {**tool_environment(workspace), **server.env}
    try:
        if host is not None:
            env.setdefault("TMPDIR", host.plan.tmp)
            command = await host.spawn(list(server.command), env, (in_r, out_w, err_w))
            _settle(proc.exited, command.exited)
            proc._kill = lambda: host.kill(command)
        else:
            child = _spawn.spawn(server.command, cwd=workspace, env=env, stdin=in_r, stdout=out_w, stderr=err_w)
            _settle(proc.exited, asyncio.ensure_future(child.wait()))
            proc._kill = lambda: kill_tree(child.pid)
    except BaseException:
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    return proc


def _settle(target: asyncio.Future[int], source: asyncio.Future[int]) -> None:
    def done(fut: asyncio.Future[int]) -> None:
        if target.done():
            return
        if fut.cancelled():
            target.cancel()
        elif (exc := fut.exception()) is not None:
            target.set_exception(exc)
            target.exception()  # whoever waits sees it; nobody need
        else:
            target.set_result(fut.result())

    source.add_done_callback(done)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "closed its stdout"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class McpConnection:
    """One server for one session: connected on first use, kept until it
    fails or the session closes it."""

    def __init__(self, server: McpServer, workspace: Path) -> None:
        self.server = server
        self._workspace = workspace
        self._client: Client | None = None
        self._owner: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._process: _Process | None = None
        # The connection ended (the server's stdout, the HTTP link, a close);
        # `_lost`: why, when we know better than "it ended" (a garbage line).
        self._ended = False
        self._lost = ""

    @property
    def name(self) -> str:
        return self.server.name

    # -- connecting --------------------------------------------------------

    async def connect(self, timeout: float) -> Client:
        if self._client is not None and not self._ended:
            return self._client
        await self.close()
        self._ended = False
        self._lost = ""
        self._stop = asyncio.Event()
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._owner = asyncio.ensure_future(self._own(ready))
        try:
            async with asyncio.timeout(timeout):
                client = await asyncio.shield(ready)
        except TimeoutError:
            await self.close()
            raise McpServerError(
                f"MCP server {self.name!r} did not start and answer within {timeout:g} s "
                "(mcp.start_timeout_secs)") from None
        except McpServerError:
            await self.close()
            raise
        except Exception as exc:
            await self.close()
            raise McpServerError(f"MCP server {self.name!r} could not be started: {self._why(exc)}") from None
        self._client = client
        return client

    async def _own(self, ready: asyncio.Future[Client]) -> None:
        """The task that enters and leaves the SDK's client."""
        try:
            transport = (self._stdio_transport() if self.server.command is not None
                         else self._http_transport())
            async with Client(transport, cache=None) as client:
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
    async def _http_transport(self) -> AsyncIterator[TransportStreams]:
        from mcp.client.streamable_http import streamable_http_client

        assert self.server.url is not None
        headers: dict[str, str] = {}
        for header, variable in self.server.headers_env.items():
            value = os.environ.get(variable)
            if not value:
                raise McpServerError(f"MCP server {self.name!r}: environment variable {variable} "
                                     f"(headers_env.{header}) is not set in sessiond's environment: set it "
                                     "where sessiond is started and restart sessiond")
            headers[header] = value
        # trust_env off: the operator's URL is reached directly, not through
        # a proxy the worker's environment happens to name.
        transport = _CappedTransport(httpx2.AsyncHTTPTransport(trust_env=False), _MAX_MESSAGE_BYTES)
        async with httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=300.0), trust_env=False,
                                      headers=headers, transport=transport) as http:
            async with streamable_http_client(self.server.url, http_client=http,
                                              max_sse_event_size=_MAX_MESSAGE_BYTES) as streams:
                yield streams

    @contextlib.asynccontextmanager
    async def _stdio_transport(self) -> AsyncIterator[TransportStreams]:
        try:
            proc = await _start_process(self.server, self._workspace)
        except SandboxError as exc:
            raise McpServerError(f"MCP server {self.name!r} cannot start in the session's sandbox: {exc}") from None
        except OSError as exc:
            raise McpServerError(f"MCP server {self.name!r} cannot be started: {exc}") from None
        self._process = proc
        loop = asyncio.get_running_loop()
        incoming, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        write_stream, outgoing = anyio.create_memory_object_stream[SessionMessage](0)
        reader = asyncio.StreamReader(limit=_MAX_MESSAGE_BYTES)
        out_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(proc.stdout, "rb", 0))
        in_transport, in_protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(proc.stdin, "wb", 0))
        writer = asyncio.StreamWriter(in_transport, in_protocol, None, loop)
        os.set_blocking(proc.stderr, False)
        loop.add_reader(proc.stderr, self._read_stderr, proc)
        tasks = [asyncio.ensure_future(self._pump_out(reader, incoming, proc)),
                 asyncio.ensure_future(self._pump_in(outgoing, writer, incoming))]
        try:
            yield read_stream, write_stream
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                writer.close()
            try:
                # The spec's shutdown: stdin closed, a moment, then the kill
                # (which a second cancellation must not skip).
                with contextlib.suppress(TimeoutError, SandboxError):
                    await asyncio.wait_for(asyncio.shield(proc.exited), _CLOSE_GRACE_SECS)
            finally:
                proc.kill()
                out_transport.close()
                loop.remove_reader(proc.stderr)
                os.close(proc.stderr)
                for stream in (incoming, read_stream, write_stream, outgoing):
                    stream.close()

    async def _pump_out(self, reader: asyncio.StreamReader, incoming: Any, proc: _Process) -> None:
        """The server's stdout, one message a line, to the SDK."""
        try:
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError as end:
                    if end.partial.strip():
                        self._fail(f"wrote something that is not JSON-RPC on stdout: {_quote(end.partial)}", proc)
                    return
                except asyncio.LimitOverrunError:
                    self._fail(f"wrote a message over {_MAX_MESSAGE_BYTES} bytes on stdout", proc)
                    return
                if not line.strip():
                    continue
                try:
                    message = mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValueError:
                    self._fail(f"wrote something that is not JSON-RPC on stdout: {_quote(line)}", proc)
                    return
                await incoming.send(SessionMessage(message))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            pass
        finally:
            # The end of the stream: the SDK fails every call still waiting.
            self._ended = True
            incoming.close()

    async def _pump_in(self, outgoing: Any, writer: asyncio.StreamWriter, incoming: Any) -> None:
        try:
            async for item in outgoing:
                data = item.message.model_dump_json(by_alias=True, exclude_unset=True).encode() + b"\n"
                writer.write(data)
                await writer.drain()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            self._ended = True
            incoming.close()

    def _read_stderr(self, proc: _Process) -> None:
        try:
            data = os.read(proc.stderr, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(proc.stderr)
            return
        proc.tail += data
        del proc.tail[:-_STDERR_TAIL_BYTES]

    def _fail(self, why: str, proc: _Process) -> None:
        self._lost = why
        proc.kill()

    # -- using it ----------------------------------------------------------

    async def list_tools(self, timeout: float) -> list[ListedTool]:
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
        return tools

    async def call(self, tool: str, arguments: dict[str, Any], timeout: float, start_timeout: float) -> Any:
        client = await self.connect(start_timeout)
        try:
            async with asyncio.timeout(timeout):
                return await client.call_tool(tool, arguments)
        except TimeoutError:
            await self.close()
            raise McpServerError(
                f"MCP server {self.name!r} did not answer {tool} within {timeout:g} s (mcp.call_timeout_secs); "
                "it was stopped and starts again at the next call") from None
        except MCPError as exc:
            if exc.code != mcp_types.CONNECTION_CLOSED:
                raise ToolError(f"MCP server {self.name!r} refused the call to {tool}: {exc.message}") from None
            raise await self._failed(f"the call to {tool}", exc) from None
        except Exception as exc:
            raise await self._failed(f"the call to {tool}", exc) from None

    async def _failed(self, during: str, exc: Exception) -> McpServerError:
        """The connection is lost: why, in words; closed, so that the next
        call makes a new one."""
        why = self._lost
        proc = self._process
        if not why and proc is not None:
            why = _describe_exit(await proc.exit_code())
        if not why:
            why = f"failed: {self._why(exc)}"
        tail = ""
        if proc is not None and proc.tail.strip():
            tail = f"; its last words on stderr: {_quote(bytes(proc.tail), last=True)}"
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


class _CappedTransport(httpx2.AsyncBaseTransport):
    """An HTTP server's JSON answers cut off past `limit` bytes (the SDK
    reads a whole answer into memory before it parses it; over stdio a line
    has the same bound).  An event stream is left alone: the SDK bounds
    each of its events."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, limit: int) -> None:
        self._inner, self._limit = inner, limit

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        if "text/event-stream" not in response.headers.get("content-type", ""):
            assert isinstance(response.stream, httpx2.AsyncByteStream)
            response.stream = _CappedStream(response.stream, self._limit)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _CappedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, limit: int) -> None:
        self._inner, self._limit = inner, limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._limit:
                raise httpx2.ReadError(f"the server's answer is over {self._limit} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def _quote(data: bytes, *, last: bool = False) -> str:
    """Bytes of the server's, shown escaped: the first (or `last`) 300 characters."""
    text = sandbox.escape(data.decode("utf-8", "replace").strip())
    if len(text) > 300:
        text = "..." + text[-300:] if last else text[:300] + "..."
    return f'"{text}"'


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
