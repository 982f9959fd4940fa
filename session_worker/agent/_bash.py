"""The `bash` tool: the command run by `/bin/bash` in the workspace.

The command is not in any process's arguments (`ps` and /proc/PID/cmdline
show every user a process's arguments): bash is started as
`/bin/bash -c READ_AND_RUN` (`_READ_AND_RUN`, the same for every command)
with the command on its stdin, a pipe holding it and a NUL; bash reads it
up to the NUL, points its stdin at /dev/null and runs it with `eval`, as
`bash -c` would (the command's processes get /dev/null as stdin, as before).

With a sandbox (the default), the session's tool host starts the command
inside it (`session_worker.worker.sandbox`), in a process group of its own that a
timeout or an interrupt kills.  With `sandbox.mode = "off"` the worker starts
it itself, in the worker's process group (the supervisor's `killpg` reaches
it), so killing "the command and its children" walks its descendants.

The environment is built from nothing (an allowlist), so no provider key,
SESSIOND_* variable or systemd socket variable can reach a tool; nor does
any descriptor but stdin (/dev/null once the command is read), stdout and
stderr, on either path.  Output
(stdout and stderr merged, in order) is capped while it is read: the head and
the tail are kept in memory, the middle is only counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
from pathlib import Path
from typing import NamedTuple

import psutil

from session_worker.worker import _spawn, sandbox
from session_worker.errors import SandboxError
from session_worker.agent import _traced
from session_worker.agent._errors import ToolError

__all__ = ["Captured", "OutputCap", "kill_tree", "run_bash", "run_captured", "tool_environment"]

_PATH = "/usr/local/bin:/usr/bin:/bin"
# bash's own program, the same for every command: read the command from
# stdin up to its NUL (`read` takes one byte at a time from a pipe: never
# past it), stdin to /dev/null, run it.  The variable is unset by the
# command's first words, so the command does not see itself in it.
_READ_AND_RUN = 'IFS= read -r -d "" __sessiond_command; exec </dev/null; ' \
                'eval "unset __sessiond_command; $__sessiond_command"'
_ARGV = ["/bin/bash", "-c", _READ_AND_RUN]
# A pipe holds this much at most (fs.pipe-max-size, its default): a longer
# command is refused (as arguments, bash -c took 128 KiB).
_COMMAND_MAX_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031
# After the shell exits, how long a background child holding the output pipe
# may keep us reading before we stop and report.  Background children are
# left running (they are in the session's process group, so stopping the
# session ends them); only a timeout or an interrupt kills them.
_DRAIN_GRACE_SECS = 0.5


def tool_environment(workspace: Path) -> dict[str, str]:
    return {
        "PATH": _PATH,
        "HOME": str(workspace),
        "PWD": str(workspace),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
    }


class Captured(NamedTuple):
    """A command's end: its (capped) output, the status line the model
    reads after it, its exit code (None: killed)."""

    output: str
    status: str
    exit_code: int | None

    @property
    def text(self) -> str:
        """What the model reads: the output, then the status line."""
        sep = "\n" if self.output and not self.output.endswith("\n") else ""
        return f"{self.output}{sep}{self.status}"


class OutputCap:
    """Keeps the first and last `limit // 2` bytes of a stream."""

    def __init__(self, limit: int) -> None:
        self._half = max(1, limit // 2)
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self._half - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._tail += data
            if len(self._tail) > 2 * self._half:
                del self._tail[: len(self._tail) - self._half]

    @property
    def cut(self) -> bool:
        """Some of the output was not kept."""
        return self.total > len(self._head) + min(len(self._tail), self._half)

    def text(self) -> str:
        tail = bytes(self._tail[-self._half :]) if self._tail else b""
        cut = self.total - len(self._head) - len(tail)
        head = self._head.decode("utf-8", "replace")
        if cut <= 0:
            return head + tail.decode("utf-8", "replace")
        return (
            head
            + f"\n[... {cut} bytes of output cut (output_limit_bytes); "
            + f"showing the first {len(self._head)} and last {len(tail)} of {self.total} ...]\n"
            + tail.decode("utf-8", "replace")
        )


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every descendant (twice over, for forks in flight)."""
    for _ in range(2):
        try:
            root = psutil.Process(pid)
            victims = root.children(recursive=True) + [root]
        except psutil.Error:
            return
        for proc in victims:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)


class _Local:
    """A command run by the worker itself (sandbox.mode = off)."""

    def __init__(self, proc: _spawn.Child) -> None:
        self.proc = proc

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        return await self.proc.wait()

    def kill(self) -> None:
        kill_tree(self.proc.pid)


class _Hosted:
    """A command run by the session's tool host, inside its sandbox."""

    def __init__(self, host: sandbox.ToolHost, command: sandbox.HostCommand) -> None:
        self.host, self.command = host, command
        self.lost = ""  # why the host went away while the command ran

    @property
    def returncode(self) -> int | None:
        if self.lost:
            return -signal.SIGKILL
        return self.command.returncode

    async def wait(self) -> int:
        try:
            return await asyncio.shield(self.command.exited)
        except SandboxError as exc:
            # A tool killed the host (its parent), or the host died: its
            # namespace, and the command, went with it.
            self.lost = str(exc)
            return -signal.SIGKILL

    def kill(self) -> None:
        self.host.kill(self.command)


def _command_pipe(command: str) -> int:
    """The read end of a pipe that holds `command` and its NUL, whole (its
    write end closed): bash's stdin."""
    data = command.encode("utf-8", "surrogateescape") + b"\0"
    if b"\0" in data[:-1]:
        raise ToolError("the command holds a NUL character, which no shell command can")
    if len(data) > _COMMAND_MAX_BYTES:
        raise ToolError(f"the command is {len(data)} bytes; at most {_COMMAND_MAX_BYTES} are run")
    rfd, wfd = os.pipe2(os.O_CLOEXEC)
    try:
        if len(data) > 65536:
            fcntl.fcntl(wfd, _F_SETPIPE_SZ, len(data))
        view = memoryview(data)
        while view:
            view = view[os.write(wfd, view):]
    except OSError as exc:
        os.close(rfd)
        raise ToolError(f"cannot pass the command to bash: {exc.strerror}") from None
    finally:
        os.close(wfd)
    return rfd


async def _start(command: str, workspace: Path, wfd: int) -> _Local | _Hosted:
    host = sandbox.current()
    stdin = _command_pipe(command)
    try:
        if host is not None:
            env = {**tool_environment(workspace), "TMPDIR": host.plan.tmp}
            started = await host.spawn(_ARGV, env, wfd, stdin=stdin)
            return _Hosted(host, started)
        # Not asyncio's subprocess: under uvloop it hands the worker's
        # inherited descriptors on (close_fds is ignored).
        try:
            proc = _spawn.spawn(_ARGV, cwd=workspace, env=tool_environment(workspace),
                                stdout=wfd, stderr=wfd, stdin=stdin)
        except OSError as exc:
            raise ToolError(f"cannot start bash: {exc}") from None
        return _Local(proc)
    finally:
        os.close(stdin)


async def run_bash(command: str, workspace: Path, timeout_secs: float, limit: int) -> str:
    """The `bash` tool's result: the output, then its status line."""
    return (await run_captured(command, workspace, timeout_secs, limit)).text


async def run_captured(command: str, workspace: Path, timeout_secs: float, limit: int) -> Captured:
    """Run `command` as the `bash` tool does (the sandbox's tool host, or
    the worker itself with `sandbox.mode = "off"`): its output capped at
    `limit`, killed past `timeout_secs`."""
    # Our own pipe rather than asyncio's PIPE: asyncio's Process.wait() only
    # returns once every pipe is closed, so a background child (`server &`)
    # that inherited stdout would keep us waiting after the shell exited,
    # and after it is orphaned no tree walk can find it.  With our own read
    # end, the exit is seen at once and we decide when to stop reading.
    loop = asyncio.get_running_loop()
    rfd, wfd = os.pipe()
    starting = asyncio.ensure_future(_start(command, workspace, wfd))
    try:
        # The command runs before the start returns: an interrupt in that
        # window must still find it and kill it.
        proc = await asyncio.shield(starting)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            (await starting).kill()
        os.close(rfd)
        raise
    except SandboxError as exc:
        os.close(rfd)
        raise ToolError(str(exc)) from None
    except BaseException:
        os.close(rfd)
        raise
    finally:
        os.close(wfd)
    cap = OutputCap(limit)
    eof: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            data = os.read(rfd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            cap.feed(data)
        else:
            loop.remove_reader(rfd)
            if not eof.done():
                eof.set_result(None)

    os.set_blocking(rfd, False)
    loop.add_reader(rfd, readable)
    timed_out = False
    try:
        try:
            async with asyncio.timeout(timeout_secs):
                await proc.wait()
                await _drain(eof)
        except TimeoutError:
            timed_out = True
            proc.kill()
            await proc.wait()
            await _drain(eof)
    except BaseException:
        # Interrupt (cancellation) or a bug: the command must not outlive it.
        if proc.returncode is None:
            proc.kill()
        raise
    finally:
        loop.remove_reader(rfd)
        os.close(rfd)
    output = cap.text()
    if timed_out:
        status = f"[timed out after {timeout_secs:g} s; the command and its children were killed]"
    elif isinstance(proc, _Hosted) and proc.lost:
        status = f"[{proc.lost} while the command ran; the next command starts a new one]"
    elif proc.returncode is not None and proc.returncode < 0:
        status = f"[killed by signal {-proc.returncode}]"
    else:
        status = f"[exit code: {proc.returncode}]"
    lost = proc.lost if isinstance(proc, _Hosted) else ""
    _traced.bash_exit(proc.returncode, timed_out, lost, cap.total, cap.cut)
    if not eof.done():
        status += "\n[a background process still holds the output open; it was not waited for]"
    code = proc.returncode
    return Captured(output, status, code if code is not None and code >= 0 and not timed_out and not lost else None)


async def _drain(eof: asyncio.Future[None]) -> None:
    """Wait briefly for the end of output once the shell has exited."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(eof), _DRAIN_GRACE_SECS)
