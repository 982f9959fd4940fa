"""A sessiond client written from docs/protocol.md alone: the standard
library and the `msgpack` package, nothing of this project (the
conformance test checks that it imports nothing else).  It is what someone
porting the protocol to another language would write first: framing, the
handshake, requests matched by id, events kept aside in arrival order.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

PROTOCOL = 1
_LEN = struct.Struct(">I")


class Closed(Exception):
    """The daemon closed the connection."""


class WireClient:
    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.next_id = 1
        self.frames: list[dict[str, Any]] = []  # everything received, in order

    def close(self) -> None:
        self.sock.close()

    # ---------------------------------------------------------------- framing

    def send_raw(self, body: bytes) -> None:
        self.sock.sendall(_LEN.pack(len(body)) + body)

    def send(self, msg: dict[str, Any]) -> None:
        self.send_raw(msgpack.packb(msg, use_bin_type=True))

    def _read_exactly(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self.sock.recv(n)
            if not chunk:
                raise Closed("connection closed by the daemon")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def recv(self) -> dict[str, Any]:
        (length,) = _LEN.unpack(self._read_exactly(4))
        msg = msgpack.unpackb(self._read_exactly(length), raw=False)
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ValueError(f"not a message: {msg!r}")
        self.frames.append(msg)
        return msg

    # ---------------------------------------------------------------- protocol

    def hello(self, **extra: Any) -> dict[str, Any]:
        self.send({"type": "hello", "protocol": PROTOCOL, "client": "wire_client", **extra})
        return self.recv()

    def request(self, type_: str, **fields: Any) -> int:
        rid = self.next_id
        self.next_id += 1
        self.send({"type": type_, "id": rid, **fields})
        return rid

    def reply(self, rid: int) -> dict[str, Any]:
        """The reply to request `rid` (events and other replies on the way
        stay in `frames`)."""
        while True:
            msg = self.recv()
            if "seq" not in msg and msg.get("id") == rid:
                return msg

    def call(self, type_: str, **fields: Any) -> dict[str, Any]:
        return self.reply(self.request(type_, **fields))

    def until(self, done: Any) -> list[dict[str, Any]]:
        """Frames from now until (and with) the first for which done(frame)."""
        got = []
        while True:
            msg = self.recv()
            got.append(msg)
            if done(msg):
                return got
