"""A connection to the control socket, opened and greeted: `hello`, then
the daemon's `welcome` or its refusal.  Runs in the client's process (the
client library, supervisor.ctl.client, for its first connection and each
reconnection).  Imports only ipc/ and the client side's errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from ipc import messages as m
from ipc import operator as op
from ipc.connection import FramedProtocol
from ipc.errors import ProtocolError
from ipc.paths import socket_trust_problem
from supervisor.ctl.errors import DaemonUnavailable, RequestError
from supervisor.ctl.link import MAX_REPLY_FRAME_BYTES, START_HINT

__all__ = ["open_connection"]

_decoders: list[msgspec.msgpack.Decoder[op.AnyReply]] = []


def _reply_decoder() -> msgspec.msgpack.Decoder[op.AnyReply]:
    """Built at the first connection, not at import: ~5 ms here (the whole
    reply union), which `sessionctl --help` and other importers that never
    connect need not pay."""
    if not _decoders:
        _decoders.append(msgspec.msgpack.Decoder(op.AnyReply))
    return _decoders[0]


async def open_connection(
    path: str, *, client_name: str, reasoning: bool, timeout: float,
    on_message: Callable[[op.AnyReply], None],
    on_close: Callable[[FramedProtocol[op.AnyReply], BaseException | None], None],
) -> tuple[FramedProtocol[op.AnyReply], m.Welcome]:
    """Connect to `path` and say hello: the connection and the daemon's
    welcome.  Until the welcome, what arrives answers the hello (a refusal,
    the daemon's `error`, is raised as RequestError); from then on messages
    go to `on_message` and the connection's end to `on_close`."""
    if problem := socket_trust_problem(path):
        # Before a byte is sent: a squatter must not see the Hello either.
        raise DaemonUnavailable(f"refusing to connect to sessiond at {path}: {problem}")
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[m.Welcome] = loop.create_future()
    welcomed: list[FramedProtocol[op.AnyReply]] = []

    def got(msg: op.AnyReply) -> None:
        if welcomed:
            on_message(msg)
        elif isinstance(msg, m.Welcome) and not answer.done():
            welcomed.append(proto)
            answer.set_result(msg)
        elif isinstance(msg, m.Error) and not answer.done():
            answer.set_exception(RequestError(str(msg.code), msg.message))

    def lost(exc: BaseException | None) -> None:
        if welcomed:
            on_close(welcomed[0], exc)
        elif not answer.done():
            answer.set_exception(DaemonUnavailable(
                f"sessiond at {path} closed the connection before answering hello{f': {exc}' if exc else ''}"))

    def bad(exc: ProtocolError) -> None:
        proto.abort()  # a frame we cannot read: this connection is done (lost, then, is told)

    # (The daemon may answer, a refusal, and close before our hello: the
    # callbacks exist from the first byte.)
    proto: FramedProtocol[op.AnyReply] = FramedProtocol(
        _reply_decoder(), on_message=got, on_close=lost, on_bad_message=bad,
        max_frame_bytes=MAX_REPLY_FRAME_BYTES)
    try:
        await asyncio.wait_for(loop.create_unix_connection(lambda: proto, path), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "timed out"
        hint = START_HINT if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)) else ""
        raise DaemonUnavailable(f"cannot connect to sessiond at {path}: {reason}{hint}") from None
    proto.send(m.Hello(protocol=m.PROTOCOL_VERSION, client=client_name, error_codes=sorted(m.NEW_ERROR_CODES),
                       events=["reasoning"] if reasoning else []))
    try:
        welcome = await asyncio.wait_for(asyncio.shield(answer), timeout)
    except asyncio.TimeoutError:
        answer.cancel()  # (else the close fails it, and nobody reads that)
        proto.close()
        raise DaemonUnavailable(f"sessiond at {path} did not answer hello") from None
    except BaseException:
        answer.cancel()
        proto.close()
        raise
    return proto, welcome
