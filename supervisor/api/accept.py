"""Accepting control connections, with file descriptors kept in reserve.

Runs in the daemon's loop.  The loop's own server (libuv) meets EMFILE by
accepting and at once closing every pending connection: a client then
sees "connection lost", not why.  Here the daemon accepts itself, and
keeps `RESERVE_FDS` descriptors open on /dev/null.  When accept() fails
with EMFILE or ENFILE it lets the reserve go, accepts each waiting client,
tells it `Error{capacity}` (one small frame, written into the new socket's
empty buffer: it cannot block) and closes it, then takes the reserve back.
If the reserve cannot be taken back (something else took the fds), the
listener rests for `_REST_SECS` instead of spinning on a readable socket
it cannot accept from.

An accepted socket is handed to the loop (`connect_accepted_socket`), so
a connection is served exactly as the loop's own server would serve it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections.abc import Callable

from ipc import messages as m
from ipc.framing import encode_frame

__all__ = ["Acceptor", "RESERVE_FDS"]

log = logging.getLogger("sessiond.server")

RESERVE_FDS = 4
_BATCH = 16  # connections accepted per wake-up: their checks and the loop's other work go on
_REST_SECS = 0.1

_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)
_CAPACITY = encode_frame(m.Error(
    code=m.ErrorCode.CAPACITY,
    message="the daemon is out of file descriptors (RLIMIT_NOFILE, LimitNOFILE= in the unit); "
            "try again later"))


class Acceptor:
    def __init__(self, sock: socket.socket, protocol: Callable[[], asyncio.Protocol]) -> None:
        self._sock = sock
        self._protocol = protocol
        self._reserve: list[int] = []
        self._tasks: set[asyncio.Task[object]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rest: asyncio.TimerHandle | None = None
        self.refused = 0  # told capacity for want of fds, since start

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._take_reserve()
        self._loop.add_reader(self._sock.fileno(), self._ready)

    def close(self) -> None:
        """Stop accepting and close the listening socket."""
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        if self._rest is not None:
            self._rest.cancel()
        self._sock.close()
        self._free_reserve()

    def _take_reserve(self) -> bool:
        while len(self._reserve) < RESERVE_FDS:
            try:
                self._reserve.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                return False
        return True

    def _free_reserve(self) -> None:
        for fd in self._reserve:
            os.close(fd)
        self._reserve.clear()

    def _ready(self) -> None:
        for _ in range(_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self._out_of_fds()
                elif exc.errno != errno.ECONNABORTED:
                    log.warning("accepting a control connection failed: %s", exc)
                    self._pause()
                return
            self._hand_over(conn)

    def _hand_over(self, conn: socket.socket) -> None:
        assert self._loop is not None
        try:
            conn.setblocking(False)
            task = self._loop.create_task(self._loop.connect_accepted_socket(self._protocol, conn))
        except BaseException:
            conn.close()
            raise
        self._tasks.add(task)
        task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("a control connection could not be set up: %s", exc)

    def _out_of_fds(self) -> None:
        """Accept and refuse, with the reserve's fds, whoever is waiting."""
        self._free_reserve()
        told = 0
        try:
            for _ in range(_BATCH):
                try:
                    conn, _ = self._sock.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    if exc.errno != errno.ECONNABORTED:
                        break
                    continue
                with contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(_CAPACITY)
                conn.close()
                told += 1
        finally:
            if not self._take_reserve():
                self._pause()
        if told:
            self.refused += told
            log.warning("out of file descriptors: %d client(s) told `capacity` (%d since start); "
                        "raise LimitNOFILE= (RLIMIT_NOFILE)", told, self.refused)
        else:
            self._pause()  # not even the reserve was enough: rest, do not spin

    def _pause(self) -> None:
        assert self._loop is not None
        if self._rest is not None:
            return
        self._loop.remove_reader(self._sock.fileno())
        self._rest = self._loop.call_later(_REST_SECS, self._resume)

    def _resume(self) -> None:
        assert self._loop is not None
        self._rest = None
        self._take_reserve()
        if self._sock.fileno() >= 0:
            self._loop.add_reader(self._sock.fileno(), self._ready)
