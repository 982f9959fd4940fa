"""Length-prefixed msgpack framing: a 4-byte unsigned big-endian length, then
that many bytes of msgpack.

The length is checked against the limit as soon as its four bytes arrive, so
a hostile prefix (4 GiB) costs nothing: no buffer of that size is ever made.
Encoders and decoders are built once per (link, direction) and reused.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

from ipc.errors import BadMessage, FrameTooLarge

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "HEADER", "FrameEncoder", "FrameParser", "encode_frame"]

DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
HEADER = struct.Struct(">I")
_HEADER_SIZE = HEADER.size

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


class FrameEncoder:
    """Encodes messages into complete frames (prefix included) in one buffer."""

    __slots__ = ("_encoder",)

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, msg: Any) -> bytearray:
        # A fresh buffer per frame: transports may keep a reference to what
        # they were given until it is sent, so a shared buffer is not safe.
        buf = bytearray(_HEADER_SIZE)
        self._encoder.encode_into(msg, buf, _HEADER_SIZE)
        HEADER.pack_into(buf, 0, len(buf) - _HEADER_SIZE)
        return buf


def encode_frame(msg: Any) -> bytes:
    """One-off encoding, for tests and tools; hot paths keep a FrameEncoder."""
    body = _encoder.encode(msg)
    return HEADER.pack(len(body)) + body


class FrameParser(Generic[T]):
    """Push parser: `feed()` bytes as they arrive, get decoded messages back.

    A frame that decodes badly yields a `BadMessage` in the output list (the
    stream is still in sync, so the caller may answer and carry on); a length
    over the limit raises `FrameTooLarge` (the caller must close) and drops
    whatever was decoded in the same call: the connection is going anyway.
    """

    __slots__ = ("_buf", "_decode", "_max")

    def __init__(self, decoder: msgspec.msgpack.Decoder[T], max_frame_bytes: int) -> None:
        self._buf = bytearray()
        self._decode: Callable[[Any], T] = decoder.decode
        self._max = max_frame_bytes

    def feed(self, data: bytes | bytearray | memoryview) -> list[T | BadMessage]:
        buf = self._buf
        if buf:
            buf += data
            src: bytes | bytearray | memoryview = buf
        else:
            src = data
        out: list[T | BadMessage] = []
        end = len(src)
        pos = 0
        decode = self._decode
        limit = self._max
        too_large = 0
        with memoryview(src) as view:
            while end - pos >= _HEADER_SIZE:
                (length,) = HEADER.unpack_from(view, pos)
                if length > limit:
                    too_large = length
                    break
                stop = pos + _HEADER_SIZE + length
                if stop > end:
                    break
                try:
                    out.append(decode(view[pos + _HEADER_SIZE : stop]))
                except Exception as exc:
                    # Whatever the decoder makes of hostile bytes (a
                    # DecodeError, but also UnicodeDecodeError for a bad
                    # str, RecursionError for deep nesting) is a bad message,
                    # and the stream is still in sync.
                    out.append(BadMessage(f"{type(exc).__name__}: {exc}"))
                pos = stop
            rest = bytes(view[pos:]) if pos < end and src is not buf else None
        if too_large:
            # Outside the memoryview: a buffer cannot be resized while exported.
            buf.clear()
            raise FrameTooLarge(too_large, limit)
        if src is buf:
            del buf[:pos]
        elif rest is not None:
            buf += rest
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def clear(self) -> None:
        """Drop a partial frame (the connection is being failed): its memory
        goes now, not when the transport is finally gone."""
        self._buf = bytearray()
