"""Framed message connections on asyncio, used by the daemon, the worker and
the client library alike.

`FramedProtocol` is an `asyncio.Protocol` (protocols cost less per message
than streams: no StreamReader buffer copy, no task wake-up per read).  Two
ways to consume what arrives:

* callback: pass `on_message`; it is called synchronously for each decoded
  message, in order, from `data_received`.  The daemon uses this for worker
  links, where each message is a small state change.
* pull: leave `on_message` unset and `await recv()`.

With a `pacer` (ipc.pacing), what one read decoded is handed to
`on_message` through the pacer (at once or in a later slice), as one
batch, in order: the
daemon's worker links, whose messages are data-plane work that must not
delay a control request read in the same pass.

Writes never block.  When the peer reads slower than we write, the
transport buffers up to its high-water mark and then pauses us.  A peer
that then takes none of our bytes while `max_backlog` frames are sent and
for at least `STALL_SECS` has stopped reading; one that takes any resets
both, however long it stays paused.  (Counting every frame sent while
paused cut off readers that kept up: at a few dozen bytes a frame, a
thousand go out in a millisecond, and the buffer between the marks holds
more.)  Bytes count too, toward `max_backlog_bytes`: those queued for
the next write (a burst in one pass of the loop, e.g. a replay of retained
events, is never paused) plus those the paused transport holds, reading or
not.  Past either `on_lagged` is called (the daemon tells the client it
lagged and cuts it off), so one slow reader can never make the daemon hold
an unbounded queue or wait on it.  One frame always fits: an empty queue
takes any frame.

With `frame_timeout`, a frame that has begun to arrive must be whole within
that many seconds, or the connection fails with `FrameTimeout` (a peer that
sends half of a 16 MiB frame must not hold 8 MiB forever).  There is no
timer per frame: the time is noted when a read leaves a new partial frame
behind, and one timer per connection, armed then, looks again when it fires.

With a `SharedBudget` (`use_budget`), what this connection holds for its
peer (a partial frame, and bytes a paused transport holds) counts toward
a total shared with other connections (the daemon: all of one uid's):
past it a read fails the connection with `OverBudget`, a write is treated
as a lag.  Everything is given back when the connection ends, and a
partial frame is dropped then, whatever else still refers to us.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

from ipc.errors import BadMessage, ConnectionClosed, FrameTimeout, FrameTooLarge, OverBudget, ProtocolError
from ipc.framing import DEFAULT_MAX_FRAME_BYTES, FrameEncoder, FrameParser
from ipc.pacing import Pacer

__all__ = ["FramedProtocol", "STALL_SECS", "SharedBudget", "open_unix_connection"]

# A peer that took none of our bytes for `max_backlog` frames is cut off
# only once it has also taken nothing for this long: a reader busy for a
# moment while a burst of frames goes out (a thousand small ones take a
# millisecond) has not stopped reading.
STALL_SECS = 1.0

log = logging.getLogger(__name__)

In = TypeVar("In")


class SharedBudget:
    """Bytes that several connections may hold together; each connection
    adds what it holds beyond what it held (see FramedProtocol.use_budget)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0


class FramedProtocol(asyncio.Protocol, Generic[In]):
    def __init__(
        self,
        decoder: msgspec.msgpack.Decoder[In],
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        on_message: Callable[[In], None] | None = None,
        on_bad_message: Callable[[ProtocolError], None] | None = None,
        on_close: Callable[[BaseException | None], None] | None = None,
        max_backlog: int | None = None,
        on_lagged: Callable[[int], None] | None = None,
        max_backlog_bytes: int | None = None,
        frame_timeout: float | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self._parser: FrameParser[In] = FrameParser(decoder, max_frame_bytes)
        self._encoder = FrameEncoder()
        self._on_message = on_message
        self._on_bad_message = on_bad_message
        self._on_close = on_close
        self._max_backlog = max_backlog
        self._on_lagged = on_lagged
        self.transport: asyncio.Transport | None = None
        self._inbox: collections.deque[In | BadMessage] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed_exc: BaseException | None = None
        self._is_closed = False
        self._paused = False
        self._backlog = 0  # frames sent while paused since the peer last took bytes
        self._written = 0  # bytes handed to the transport, ever
        self._taken = 0  # of them, those the peer had taken at the last look
        self._took_at = 0.0  # when it was seen to take some last (loop time)
        self._max_backlog_bytes = max_backlog_bytes
        self._wbuf_bytes = 0  # in _wbuf
        self._paused_bytes = 0  # in the paused transport's buffer, as of the last write
        self._frame_timeout = frame_timeout
        self._pacer = pacer
        self._partial_since: float | None = None
        self._frame_timer: asyncio.TimerHandle | None = None
        # Set by close()/abort(): whatever else already arrived is not handed
        # out (a refused or cut-off client's next requests are not served).
        self._stopping = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._loop = asyncio.get_running_loop()
        self._wbuf: list[bytes | bytearray] | None = None
        self._budget: SharedBudget | None = None
        self._charged = 0  # what we count in _budget.used
        self.closed: asyncio.Future[None] = self._loop.create_future()

    # ---------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses)
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._stopping:
            return  # closed by us: nothing more is handed out, so nothing is kept
        parser = self._parser
        try:
            messages = parser.feed(data)
        except FrameTooLarge as exc:
            self._fail(exc)
            return
        if self._budget is not None and not self._charge():
            self._fail(OverBudget(self._budget.used, self._budget.limit))
            return
        if self._frame_timeout is not None:
            if not parser.buffered:
                self._partial_since = None
            elif messages or self._partial_since is None:
                # Frames arrive in order: if this read completed any, what
                # is left is a frame that began just now.
                self._partial_began()
        if self._pacer is not None and messages:
            self._pacer.now_or_later(self._dispatch, messages)
        else:
            self._dispatch(messages)

    def _dispatch(self, messages: list[In | BadMessage]) -> None:
        for msg in messages:
            if self._stopping:
                return
            if isinstance(msg, BadMessage) and self._on_bad_message is not None:
                self._on_bad_message(msg)
            elif self._on_message is not None and not isinstance(msg, BadMessage):
                self._on_message(msg)
            else:
                self._inbox.append(msg)
                self._wake()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        # (Not _stopping: a batch a pacer still holds was sent before the
        # close, and is handed out; only our own close() drops one.)
        self._is_closed = True
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None
        if self._closed_exc is None:
            self._closed_exc = exc
        # A partial frame and unsent bytes go now.  The owner's callbacks
        # (its bound methods) and we refer to each other: such a cycle is
        # freed only by a full collection, which an idle daemon never runs,
        # so whatever the cycle holds must not be big.
        self._parser.clear()
        self.drop_queued()
        self._paused_bytes = 0
        if self._budget is not None:
            self._charge()
            self._budget = None
        self._wake()
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        self._drain_waiters.clear()
        if not self.closed.done():
            self.closed.set_result(None)
        if self._on_close is not None:
            cb, self._on_close = self._on_close, None
            cb(self._closed_exc)

    def pause_writing(self) -> None:
        self._paused = True
        self._took_at = self._loop.time()  # (what it had was taken: the stall counts from here)

    def resume_writing(self) -> None:
        self._paused = False
        self._backlog = 0
        self._paused_bytes = 0
        if self._budget is not None:
            self._charge()
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        self._drain_waiters.clear()

    # ---------------------------------------------------------------- API

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    @property
    def queued_bytes(self) -> int:
        """Bytes waiting to reach the peer that count toward max_backlog_bytes."""
        return self._wbuf_bytes + self._paused_bytes

    @property
    def close_reason(self) -> BaseException | None:
        return self._closed_exc

    def send(self, msg: Any) -> bool:
        """Queue one message; False if the connection is gone or lagging."""
        return self.send_frame(self._encoder.encode(msg))

    def send_frame(self, frame: bytes | bytearray) -> bool:
        """Like send() for a frame already encoded (one encoding, many readers)."""
        transport = self.transport
        if self._is_closed or transport is None or transport.is_closing():
            return False
        if self._paused and self._max_backlog is not None and self._stalled(transport):
            self._lagged()
            return False
        if self._max_backlog_bytes is not None:
            queued = self._wbuf_bytes + self._paused_bytes
            if queued and queued + len(frame) > self._max_backlog_bytes:
                self._lagged()
                return False
            self._wbuf_bytes += len(frame)
        # Frames sent during one pass of the loop go out in one write: a
        # streamed reply is many small frames, and a syscall per frame was
        # the daemon's and the worker's largest cost per token.
        pending = self._wbuf
        if pending is None:
            self._wbuf = [frame]
            self._loop.call_soon(self._flush)
        else:
            pending.append(frame)
        return True

    def _stalled(self, transport: asyncio.Transport) -> bool:
        """Whether the peer has taken none of our bytes for `max_backlog`
        frames and `STALL_SECS`: a look at what the transport has handed
        the kernel (which takes more only as the peer reads)."""
        taken = self._written - transport.get_write_buffer_size()
        if taken > self._taken:
            self._taken, self._backlog, self._took_at = taken, 0, self._loop.time()
        self._backlog += 1
        assert self._max_backlog is not None
        return self._backlog > self._max_backlog and self._loop.time() - self._took_at >= STALL_SECS

    def _lagged(self) -> None:
        if self._on_lagged is not None:
            lagged, self._on_lagged = self._on_lagged, None
            lagged(self._backlog)

    def _flush(self) -> None:
        pending, self._wbuf = self._wbuf, None
        self._wbuf_bytes = 0
        transport = self.transport
        if not pending or transport is None or transport.is_closing():
            return
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        self._written += len(data)
        transport.write(data)
        if self._paused and self._max_backlog_bytes is not None:
            # Asked only when paused: otherwise the buffer is under the
            # transport's high-water mark, small next to the bound.
            self._paused_bytes = transport.get_write_buffer_size()
        if self._paused and self._budget is not None and not self._charge():
            self._lagged()

    def flush(self) -> None:
        """Write what is queued now (before a close, or a blocking step)."""
        self._flush()

    def drop_queued(self) -> None:
        """Forget frames not yet written (a lagging reader being cut off)."""
        self._wbuf = None
        self._wbuf_bytes = 0

    def encode(self, msg: Any) -> bytearray:
        return self._encoder.encode(msg)

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its high-water mark."""
        if not self._paused or self._is_closed:
            return
        fut = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(fut)
        await fut

    async def recv(self) -> In | BadMessage:
        """Next message (or BadMessage); raises ConnectionClosed at the end."""
        while not self._inbox:
            if self._is_closed:
                reason = self._closed_exc
                if isinstance(reason, ProtocolError):
                    raise ConnectionClosed(str(reason)) from reason
                raise ConnectionClosed("connection closed")
            fut = asyncio.get_running_loop().create_future()
            self._waiter = fut
            try:
                await fut
            finally:
                self._waiter = None
        return self._inbox.popleft()

    def use_budget(self, budget: SharedBudget) -> None:
        """Count what this connection holds toward `budget` from now on."""
        self._budget = budget
        self._charge()

    def _charge(self) -> bool:
        """Bring our share of the budget up to date; False if the shared
        total is now over its limit because we hold more than before."""
        budget = self._budget
        assert budget is not None
        held = self._parser.buffered + self._paused_bytes
        delta = held - self._charged
        self._charged = held
        budget.used += delta
        return delta <= 0 or budget.used <= budget.limit

    def close(self) -> None:
        self._stopping = True
        if self.transport is not None and not self.transport.is_closing():
            self._flush()
            self.transport.close()

    def shut_write(self) -> None:
        """Send what is queued, then end our side of the stream (the peer
        reads EOF after it) and take nothing more from the peer: what it
        still sends is read and dropped, so its writes do not fail before
        it has read ours.  The connection ends when the peer closes."""
        self._stopping = True
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._flush()
        if transport.can_write_eof():
            transport.write_eof()
        else:
            transport.close()

    def abort(self) -> None:
        self._stopping = True
        if self.transport is not None:
            self.transport.abort()

    # ---------------------------------------------------------------- internals

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _partial_began(self) -> None:
        assert self._frame_timeout is not None
        self._partial_since = self._loop.time()
        if self._frame_timer is None:
            self._frame_timer = self._loop.call_later(self._frame_timeout, self._frame_deadline)

    def _frame_deadline(self) -> None:
        assert self._frame_timeout is not None
        self._frame_timer = None
        since = self._partial_since
        if since is None or self._stopping:
            return
        left = since + self._frame_timeout - self._loop.time()
        if left > 0:  # the frame pending now began after the timer was armed
            self._frame_timer = self._loop.call_later(left, self._frame_deadline)
            return
        self._partial_since = None
        exc = FrameTimeout(self._parser.buffered, self._frame_timeout)
        self._parser.clear()
        self._fail(exc)

    def _fail(self, exc: ProtocolError) -> None:
        self._closed_exc = exc
        if isinstance(exc, OverBudget):
            self._parser.clear()  # given back now: the peer may be slow to go
            assert self._budget is not None
            self._charge()
        if self._on_bad_message is not None:
            # Let the owner answer with an error frame before the close.
            self._on_bad_message(exc)
        self.close()


async def open_unix_connection(
    path: str,
    decoder: msgspec.msgpack.Decoder[In],
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> FramedProtocol[In]:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_unix_connection(
        lambda: FramedProtocol(decoder, max_frame_bytes=max_frame_bytes), path
    )
    return proto
