"""An HTTP MCP server, as the SDK's transport: streamable HTTP, or the
legacy HTTP+SSE transport (`type = "sse"`).

Runs in the worker (and in `session_worker.mcplist`).  Imported with
`_mcpclient`, only when a server is connected.  The server is reached by
the worker, outside the sandbox, at the operator's URL only: no proxy from
the environment, a redirect followed only within that origin (the SDK's
rule), answers bounded as a stdio server's lines are.  Its headers are the
operator's (`headers`, `${VAR}` read from the daemon's environment, and
`headers_env`); each request that carries W3C trace context in its
`params._meta` (a traced tool call) carries it as a `traceparent` header
too, for a server whose HTTP stack reads it there.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import AsyncIterator, Mapping
import httpx2
from mcp.client._transport import TransportStreams

from session_worker.agent._errors import McpServerError
from ipc.mcp import expand
from ipc.settings import McpServer

__all__ = ["endpoint_of", "http_transport"]

_URL = re.compile(r"^https?://[^\s]+$")
_TRACEPARENT = re.compile(rb'"traceparent"\s*:\s*"(00-[0-9a-f]{32}-[0-9a-f]{16}-0[01])"')


def endpoint_of(server: McpServer, environ: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The server's URL and headers, `${VAR}` and `headers_env` read from
    `environ` (the daemon's)."""
    assert server.url is not None
    try:
        url = expand(server.url, environ)
        headers = {k: expand(v, environ) for k, v in server.headers.items()}
    except KeyError as exc:
        raise McpServerError(f"MCP server {server.name!r}: its url or headers name ${{{exc.args[0]}}}, "
                             "which is not set in sessiond's environment: set it where sessiond is started "
                             "and restart sessiond") from None
    if not _URL.match(url):
        raise McpServerError(f"MCP server {server.name!r}: its url is not an http:// or https:// URL "
                             "once its variables are read")
    for header, variable in server.headers_env.items():
        value = environ.get(variable)
        if not value:
            raise McpServerError(f"MCP server {server.name!r}: environment variable {variable} "
                                 f"(headers_env.{header}) is not set in sessiond's environment: set it "
                                 "where sessiond is started and restart sessiond")
        headers[header] = value
    return url, headers


@contextlib.asynccontextmanager
async def http_transport(server: McpServer, limit: int) -> AsyncIterator[TransportStreams]:
    url, headers = endpoint_of(server, os.environ)
    if server.transport == "sse":
        from mcp.client.sse import sse_client

        def factory(headers: dict[str, str] | None = None, timeout: httpx2.Timeout | None = None,
                    auth: httpx2.Auth | None = None) -> httpx2.AsyncClient:
            return _client(headers or {}, limit, timeout)

        async with sse_client(url, headers=headers, httpx_client_factory=factory, sse_read_timeout=300.0) as streams:
            yield streams
        return
    from mcp.client.streamable_http import streamable_http_client

    async with _client(headers, limit) as http:
        async with streamable_http_client(url, http_client=http, max_sse_event_size=limit) as streams:
            yield streams


def _client(headers: dict[str, str], limit: int, timeout: httpx2.Timeout | None = None) -> httpx2.AsyncClient:
    # trust_env off: the operator's URL is reached directly, not through
    # a proxy the worker's environment happens to name.
    transport = _CappedTransport(httpx2.AsyncHTTPTransport(trust_env=False), limit)
    return httpx2.AsyncClient(timeout=timeout or httpx2.Timeout(30.0, read=300.0), trust_env=False,
                              headers=headers, transport=transport)


class _CappedTransport(httpx2.AsyncBaseTransport):
    """An HTTP server's JSON answers cut off past `limit` bytes (the SDK
    reads a whole answer into memory before it parses it; over stdio a line
    has the same bound).  An event stream is left alone: the SDK bounds
    each of its events.  A request whose body carries trace context gets
    it as a header as well."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, limit: int) -> None:
        self._inner, self._limit = inner, limit

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.method == "POST" and b"traceparent" in (body := _body(request)):
            found = _TRACEPARENT.search(body)
            if found is not None:
                request.headers["traceparent"] = found.group(1).decode()
        response = await self._inner.handle_async_request(request)
        if "text/event-stream" not in response.headers.get("content-type", ""):
            assert isinstance(response.stream, httpx2.AsyncByteStream)
            response.stream = _CappedStream(response.stream, self._limit)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _body(request: httpx2.Request) -> bytes:
    try:
        return request.content
    except httpx2.RequestNotRead:
        return b""


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
