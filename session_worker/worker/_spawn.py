"""Starting a process from the worker with only the descriptors it is given.

Runs in the worker.  uvloop's `subprocess_exec` ignores `close_fds`: a
process it starts inherits every descriptor of the worker that is not
close-on-exec, and the worker inherits what the zygote and the daemon had
(a log pipe, a file a service manager left open).  A tool reached the
daemon's log and a root-only file that way.  So the worker starts processes
here, with the standard library's `subprocess.Popen`, whose child closes
every descriptor but 0, 1, 2 and `pass_fds` before exec (close_range), and
waits for them through a pidfd on the running loop, never `waitpid(-1)`:
the process is this module's child and nobody else's to reap.

`seal_inherited` marks every descriptor the worker inherited close-on-exec
as well, so that code we do not start (a handler's or a custom tool's own
subprocess under uvloop) does not hand them on either.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Sequence

__all__ = ["Child", "seal_inherited", "spawn"]

_SYS_CLOSE_RANGE = 436  # the same number on every architecture
_CLOSE_RANGE_CLOEXEC = 1 << 2
_FIRST_NON_STDIO = 3


class Child:
    """A process started by `spawn`: its exit seen on the loop, its kill
    through its pidfd (a reused pid is never hit)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stderr = popen.stderr
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd = -1
        try:
            self._pidfd = os.pidfd_open(popen.pid)
        except OSError:
            # No pidfds (a kernel before 5.3): a thread waits instead.
            waiting = asyncio.ensure_future(asyncio.to_thread(popen.wait))
            waiting.add_done_callback(lambda _: self._settle())
            return
        loop.add_reader(self._pidfd, self._settle)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def _settle(self) -> None:
        code = self._popen.poll()
        if code is None:
            return
        if self._pidfd >= 0:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        if not self._exited.done():
            self._exited.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        if self._popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            else:
                self._popen.kill()


def spawn(argv: Sequence[str], *, cwd: str | os.PathLike[str], env: dict[str, str],
          stdout: int, stderr: int, pass_fds: Sequence[int] = (),
          stdin: int = subprocess.DEVNULL) -> Child:
    """Start `argv` with stdin from /dev/null (or `stdin`), `stdout`/`stderr`
    as given (a descriptor, or `subprocess.PIPE`/`DEVNULL`), and no
    descriptor but those and `pass_fds`.  Call on the running loop."""
    popen = subprocess.Popen(
        list(argv), cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
        close_fds=True, pass_fds=tuple(pass_fds),
    )
    return Child(popen)


def seal_inherited() -> None:
    """Mark every descriptor above 2 close-on-exec (in this process they
    stay open: the worker's own sockets are among them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    done = libc.syscall(_SYS_CLOSE_RANGE, ctypes.c_uint(_FIRST_NON_STDIO), ctypes.c_uint(0xFFFFFFFF),
                        ctypes.c_uint(_CLOSE_RANGE_CLOEXEC))
    if done == 0:
        return
    # Before Linux 5.11: one at a time.
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd >= _FIRST_NON_STDIO:
                with contextlib.suppress(OSError):
                    os.set_inheritable(fd, False)
