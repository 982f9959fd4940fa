"""Real MCP servers for the tests, built with the official SDK (`mcp`).

One server, three transports:

    python mcp_servers.py stdio             # a stdio server (the session's
                                            # sandbox starts it, or the worker)
    with http_server() as url: ...          # streamable HTTP on 127.0.0.1 at
                                            # url/mcp/, the legacy HTTP+SSE
                                            # transport at url/legacy/sse, in
                                            # a thread of the test process

Its tools: `echo{text}`, `add{a, b}`, `read_file{path}` (for bench/mcp.py), `authorization{}` (the
header an HTTP call came with), `big{n}` (n bytes of text), `whoami{}` (the uid, pid namespace's
view of itself and the working directory it runs in), `crash{}` (the
process exits mid-call: stdio), `hang{}` (never answers), `garbage{}`
(writes a line that is not JSON-RPC on stdout: stdio), `traceparent{}` (the
W3C trace context the call came with: in `_meta`, and over HTTP in a
header), `grow{}` (adds a tool `grown` and says so: tools/list_changed), a
resource `test://greeting`, and two hostile ones: a name no provider takes
(`bad name/ünï`) and a long description.  Its version is what a file
`version` in its working directory says, else $MCP_TEST_VERSION, else "1";
past 1 it has a tool `newer`.  Over HTTP, `/garbage` answers every
request with a body that is not JSON.

The stdio server is started by a bare interpreter inside the sandbox: argv[2]
(when given) is put in front of sys.path, so the SDK can be found there.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator

if __name__ == "__main__" and len(sys.argv) > 2:
    sys.path.insert(0, sys.argv[2])

TYPE_CHECKING = False
if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

__all__ = ["LONG_DESCRIPTION", "build", "http_server"]

LONG_DESCRIPTION = "Describes itself at length. " * 2000


def build() -> MCPServer:
    # Imported here, not at the top: the tests that only import this module
    # (for http_server) would pay the SDK's import at collection.  The
    # tools' `ctx: Context` is resolved in this module's globals.
    global Context
    from mcp.server.mcpserver import Context, MCPServer

    server = MCPServer("sessiond-test", version=_version())

    @server.tool()
    def echo(text: str) -> str:
        """Say the text back."""
        return f"echo: {text}"

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def read_file(path: str) -> str:
        """Read a text file of the working directory (what the built-in read_file does)."""
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()

    @server.tool()
    def authorization(ctx: Context) -> str:
        """The Authorization header this call came with (HTTP)."""
        return (ctx.headers or {}).get("authorization", "none")

    @server.tool()
    def big(n: int) -> str:
        """A text of n bytes."""
        return "x" * n

    @server.tool()
    def whoami() -> str:
        """Where this server runs."""
        return f"uid={os.getuid()} pid={os.getpid()} cwd={os.getcwd()}"

    @server.tool()
    def crash() -> str:
        """Exit the process in the middle of the call."""
        sys.stderr.write("Traceback: the test server crashes on purpose\n")
        sys.stderr.flush()
        os._exit(3)

    @server.tool()
    async def hang() -> str:
        """Never answer (with MCP_TEST_MARK set, a file `hanging` in the
        working directory says it was called)."""
        import anyio

        if os.environ.get("MCP_TEST_MARK"):
            with open("hanging", "w") as mark:
                mark.write(str(os.getpid()))
        await anyio.sleep(3600)
        return "unreachable"

    @server.tool()
    def garbage() -> str:
        """Write a line that is not JSON-RPC where the protocol goes."""
        os.write(_wire(), b"<html>this is not JSON-RPC</html>\n")
        return "sent"

    @server.tool()
    def traceparent(ctx: Context) -> str:
        """The W3C trace context this call came with."""
        meta = ctx.request_context.meta or {}
        header = (ctx.headers or {}).get("traceparent", "")
        return json.dumps({"meta": meta.get("traceparent", ""), "header": header})

    @server.tool()
    async def grow(ctx: Context) -> str:
        """Add a tool, `grown`, and tell the client its tools changed."""
        server.add_tool(lambda: "grown", name="grown", description="A tool added while running.")
        await ctx.request_context.session.send_tool_list_changed()
        return "grew"

    @server.resource("test://greeting")
    def greeting() -> str:
        return "hello from a resource"

    if server.version != "1":
        server.add_tool(lambda: "newer", name="newer", description="Only in versions after 1.")

    def hostile(x: str) -> str:
        return x

    server.add_tool(hostile, name="bad name/\u00fcn\u00ef", description="A name providers refuse.")
    server.add_tool(hostile, name="verbose", description=LONG_DESCRIPTION)
    return server


def _version() -> str:
    """A file `version` in the working directory, else $MCP_TEST_VERSION, else "1"."""
    try:
        with open("version") as f:
            return f.read().strip()
    except OSError:
        return os.environ.get("MCP_TEST_VERSION", "1")


def _wire() -> int:
    """The descriptor the SDK speaks on: it moves the protocol off fd 1 (a
    stray print goes to stderr) onto a private pipe-writing duplicate."""
    import fcntl
    import stat

    err = os.fstat(2).st_ino
    for fd in range(3, 256):
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            info = os.fstat(fd)
        except OSError:
            continue
        if flags & os.O_ACCMODE == os.O_WRONLY and stat.S_ISFIFO(info.st_mode) and info.st_ino != err:
            return fd
    return 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _app() -> object:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    mcp_app = build().streamable_http_app(streamable_http_path="/")
    sse_app = build().sse_app()

    async def garbage(request: object) -> PlainTextResponse:
        return PlainTextResponse("<html>not JSON at all</html>", media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        async with mcp_app.router.lifespan_context(mcp_app):
            yield

    return Starlette(
        routes=[Route("/garbage", garbage, methods=["GET", "POST", "DELETE"]), Mount("/mcp", app=mcp_app),
                Mount("/legacy", app=sse_app)],
        lifespan=lifespan,
    )


@contextlib.contextmanager
def http_server() -> Iterator[str]:
    """The server over streamable HTTP on 127.0.0.1, in a thread; yields its
    base URL (`/mcp` is the server, `/garbage` answers with garbage)."""
    import uvicorn

    app = _app()
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="mcp-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the MCP HTTP test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:  # (bench/mcp.py: a process of its own) http SITE PORT
        import uvicorn

        uvicorn.run(_app(), host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")  # type: ignore[arg-type]
        sys.exit(0)
    if sys.argv[1:2] != ["stdio"]:
        sys.exit("usage: mcp_servers.py stdio [SITE_PACKAGES] | http SITE_PACKAGES PORT")
    build().run("stdio")
