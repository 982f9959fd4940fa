"""A real worker forked from the test process (no loop, no thread here,
as in the zygote), spoken to over a socketpair: for tests that drive the
worker protocol frame by frame (tests/test_fuzz.py, test_worker_idle.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import threading
import traceback
from typing import Any

import msgspec

from ipc import messages as m
from ipc.framing import encode_frame

__all__ = ["ForkedWorker"]

_from_worker = msgspec.msgpack.Decoder(m.FromWorker)


class ForkedWorker:
    def __init__(self, timeout: float = 10.0) -> None:
        assert threading.active_count() == 1, "never fork a process with threads"
        # What the zygote preloads before it forks a worker
        # (session_worker.zygote.server._preload): imported once here, not
        # again in each child (~0.1 s a fork; the fuzz test forks 80).
        import session_worker.echo  # noqa: F401
        from session_worker.worker.main import run_worker

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                ours.close()
                # Only what a worker the zygote forks has: an epoll or a
                # file this process (pytest, an earlier test) left open
                # is not the worker's.
                keep = theirs.fileno()
                os.closerange(3, keep)
                os.closerange(keep + 1, 65536)
                from ipc.linux import set_pdeathsig

                set_pdeathsig(signal.SIGKILL)
                code = run_worker(theirs)
            except BaseException:
                with contextlib.suppress(Exception):
                    traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        self.pid = pid
        self.sock = ours
        self.sock.settimeout(timeout)
        self.status: int | None = None

    def send(self, *msgs: Any) -> None:
        self.sock.sendall(b"".join(encode_frame(msg) for msg in msgs))

    def recv(self) -> m.FromWorker:
        """The next frame; EOFError once the worker closed its end."""
        def exact(n: int) -> bytes:
            buf = b""
            while len(buf) < n:
                chunk = self.sock.recv(n - len(buf))
                if not chunk:
                    raise EOFError
                buf += chunk
            return buf

        msg: m.FromWorker = _from_worker.decode(exact(struct.unpack(">I", exact(4))[0]))
        return msg

    def exited(self) -> bool:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
        return self.status is not None

    def close(self) -> None:
        self.sock.close()
        if not self.exited():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
