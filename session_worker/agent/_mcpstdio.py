"""A stdio MCP server's process and its pipes, as the SDK's transport.

Runs in the worker (and in `session_worker.mcplist`, the daemon's lister).
Imported with `_mcpclient`, only when a server is connected.

The server is started where the session's tools are started: by the
session's tool host, inside its sandbox (its uid, namespaces, Landlock,
seccomp, process limit; the memory sweep counts it with the worker's tree),
or by the worker itself when `sandbox.mode = "off"`.  So the SDK's own stdio
client, which starts the process itself, is not used: `stdio_transport`
speaks the same newline-delimited JSON-RPC over three pipes of ours.  What
the server writes on stdout is hostile input: a line over the size bound or
one that is not JSON-RPC ends the connection (the server is stopped) with
that reason; its stderr is kept only as a short tail for the error message.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import mcp_types
from mcp.client._transport import TransportStreams
from mcp.shared.message import SessionMessage

from session_worker.worker import _spawn, sandbox
from session_worker.agent._bash import kill_tree, tool_environment
from session_worker.agent._errors import McpServerError
from session_worker.errors import SandboxError
from ipc.logfields import escape
from ipc.mcp import expand
from ipc.settings import McpServer

__all__ = ["MAX_MESSAGE_BYTES", "StdioProcess", "describe_exit", "quote", "stdio_transport"]

# One JSON-RPC message from a server: past it the server is stopped.
MAX_MESSAGE_BYTES = 8 << 20
_STDERR_TAIL_BYTES = 2048
_CLOSE_GRACE_SECS = 0.5
_EXIT_WAIT_SECS = 0.5


class StdioProcess:
    """A stdio server process and the worker's ends of its pipes."""

    def __init__(self, stdin: int, stdout: int, stderr: int) -> None:
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.tail = bytearray()
        # Why the connection was cut when we know better than "it ended"
        # (a garbage line); `ended`: its stdout is done.
        self.lost = ""
        self.ended = False
        self._kill: Any = None

    def kill(self) -> None:
        if self._kill is not None and not self.exited.done():
            self._kill()

    def fail(self, why: str) -> None:
        self.lost = why
        self.kill()

    async def exit_code(self) -> int | None:
        with contextlib.suppress(TimeoutError, SandboxError, asyncio.CancelledError):
            return await asyncio.wait_for(asyncio.shield(self.exited), _EXIT_WAIT_SECS)
        return None

    def last_words(self) -> str:
        """Its stderr's tail, quoted for an error message ('' if none)."""
        return f"; its last words on stderr: {quote(bytes(self.tail), last=True)}" if self.tail.strip() else ""

    def read_stderr(self) -> None:
        while True:
            try:
                data = os.read(self.stderr, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(ValueError, OSError, RuntimeError):
                    asyncio.get_running_loop().remove_reader(self.stderr)
                return
            self.tail += data
            del self.tail[:-_STDERR_TAIL_BYTES]


def command_of(server: McpServer, environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The server's argv and extra environment, `${VAR}` read from `environ`."""
    assert server.command is not None
    try:
        return [expand(a, environ) for a in server.command], {k: expand(v, environ) for k, v in server.env.items()}
    except KeyError as exc:
        raise McpServerError(f"MCP server {server.name!r} cannot be started: its command or env names "
                             f"${{{exc.args[0]}}}, which is not set in the daemon's environment") from None


async def _start_process(server: McpServer, workspace: Path) -> StdioProcess:
    argv, extra = command_of(server, os.environ)
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    proc = StdioProcess(in_w, out_r, err_r)
    host = sandbox.current()
    env = {**tool_environment(workspace), **extra}
    try:
        if host is not None:
            env.setdefault("TMPDIR", host.plan.tmp)
            command = await host.spawn(argv, env, (in_r, out_w, err_w))
            _settle(proc.exited, command.exited)
            proc._kill = lambda: host.kill(command)
        else:
            child = _spawn.spawn(argv, cwd=workspace, env=env, stdin=in_r, stdout=out_w, stderr=err_w)
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


def describe_exit(code: int | None) -> str:
    if code is None:
        return "closed its stdout"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


@contextlib.asynccontextmanager
async def stdio_transport(server: McpServer, workspace: Path,
                          started: Any) -> AsyncIterator[TransportStreams]:
    """The server started (`started(proc)` is told its process) and spoken
    to over its stdin and stdout until the context ends."""
    try:
        proc = await _start_process(server, workspace)
    except SandboxError as exc:
        raise McpServerError(f"MCP server {server.name!r} cannot start in the session's sandbox: {exc}") from None
    except OSError as exc:
        raise McpServerError(f"MCP server {server.name!r} cannot be started: {exc}") from None
    started(proc)
    loop = asyncio.get_running_loop()
    incoming, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, outgoing = anyio.create_memory_object_stream[SessionMessage](0)
    reader = asyncio.StreamReader(limit=MAX_MESSAGE_BYTES)
    out_transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(proc.stdout, "rb", 0))
    in_transport, in_protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(proc.stdin, "wb", 0))
    writer = asyncio.StreamWriter(in_transport, in_protocol, None, loop)
    os.set_blocking(proc.stderr, False)
    loop.add_reader(proc.stderr, proc.read_stderr)
    tasks = [asyncio.ensure_future(_pump_out(reader, incoming, proc)),
             asyncio.ensure_future(_pump_in(outgoing, writer, incoming, proc))]
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
            proc.read_stderr()  # what it said before it went: the error message's
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(proc.stderr)
            os.close(proc.stderr)
            for stream in (incoming, read_stream, write_stream, outgoing):
                stream.close()


async def _pump_out(reader: asyncio.StreamReader, incoming: Any, proc: StdioProcess) -> None:
    """The server's stdout, one message a line, to the SDK."""
    try:
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as end:
                if end.partial.strip():
                    proc.fail(f"wrote something that is not JSON-RPC on stdout: {quote(end.partial)}")
                return
            except asyncio.LimitOverrunError:
                proc.fail(f"wrote a message over {MAX_MESSAGE_BYTES} bytes on stdout")
                return
            if not line.strip():
                continue
            try:
                message = mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
            except ValueError:
                proc.fail(f"wrote something that is not JSON-RPC on stdout: {quote(line)}")
                return
            await incoming.send(SessionMessage(message))
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        pass
    finally:
        # The end of the stream: the SDK fails every call still waiting.
        proc.ended = True
        incoming.close()


async def _pump_in(outgoing: Any, writer: asyncio.StreamWriter, incoming: Any, proc: StdioProcess) -> None:
    try:
        async for item in outgoing:
            data = item.message.model_dump_json(by_alias=True, exclude_unset=True).encode() + b"\n"
            writer.write(data)
            await writer.drain()
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        proc.ended = True
        incoming.close()


def quote(data: bytes, *, last: bool = False) -> str:
    """Bytes of the server's, shown escaped: the first (or `last`) 300 characters."""
    text = escape(data.decode("utf-8", "replace").strip())
    if len(text) > 300:
        text = "..." + text[-300:] if last else text[:300] + "..."
    return f'"{text}"'
