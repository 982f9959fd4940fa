"""Python client for sessiond's control socket.  `sessionctl` is built on it.

Async use:

    async with await AsyncClient.connect() as client:
        info = await client.create(handler="echo")
        async for event in client.send(info.id, "hello"):
            if isinstance(event, TextDelta):
                print(event.text, end="", flush=True)

Sync use (a private event loop per client; not for use inside a running loop):

    with Client() as client:
        sid = client.create().id
        print(client.send_text(sid, "hello"))

One connection multiplexes any number of requests and attached sessions:
replies are matched to requests by id, events are routed by session.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, TypeVar

import msgspec

from ipc import messages as m
from ipc import operator as op
from ipc.connection import FramedProtocol
from ipc.errors import ProtocolError
from ipc.loop import new_event_loop
from ipc.messages import (
    Event,
    Lagged,
    SessionInfo,
    StatsReply,
    TextDelta,
    TurnDone,
    TurnFailed,
)
from ipc.paths import default_socket_path, socket_trust_problem
# Re-exported: applications catch them as supervisor.client's (and this module's).
from supervisor.ctl.errors import DaemonUnavailable, RequestError, TurnFailedError
from supervisor.ctl.link import CONNECT_TIMEOUT_SECS, MAX_REPLY_FRAME_BYTES

__all__ = [
    "AsyncClient",
    "Client",
    "DaemonUnavailable",
    "RequestError",
    "TurnFailedError",
]

R = TypeVar("R")
_decoders: list[msgspec.msgpack.Decoder[op.AnyReply]] = []


def _reply_decoder() -> msgspec.msgpack.Decoder[op.AnyReply]:
    """Built at the first connection, not at import: ~5 ms here (the whole
    reply union), which `sessionctl --help` and other importers that never
    connect need not pay."""
    if not _decoders:
        _decoders.append(msgspec.msgpack.Decoder(op.AnyReply))
    return _decoders[0]


_END = object()


# One page of a listing: the sessions, and where the next page starts ("": none).
Page = tuple[list[SessionInfo], str]


class AsyncClient:
    def __init__(self, proto: FramedProtocol[op.AnyReply]) -> None:
        self._proto = proto
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[str, list[asyncio.Queue[Any]]] = {}
        self.server_pid = 0
        self.server_version = ""

    # ---------------------------------------------------------------- connection

    @classmethod
    async def connect(
        cls,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        client_name: str = "sessiond-python",
        timeout: float = CONNECT_TIMEOUT_SECS,
        reasoning: bool = False,
    ) -> AsyncClient:
        """`reasoning`: also receive `ReasoningDelta` events (the model's
        reasoning, live only); off, the daemon sends none, as to clients
        older than them."""
        path = str(socket_path or default_socket_path())
        if problem := socket_trust_problem(path):
            # Before a byte is sent: a squatter must not see the Hello either.
            raise DaemonUnavailable(f"refusing to connect to sessiond at {path}: {problem}")
        loop = asyncio.get_running_loop()
        client: AsyncClient | None = None
        # The daemon may answer (a refusal) and close before our Hello, even
        # before create_unix_connection returns: keep that for the client.
        early: list[op.AnyReply] = []
        early_close: list[BaseException | None] = []

        def on_message(msg: op.AnyReply) -> None:
            if client is None:
                early.append(msg)
            else:
                client._dispatch(msg)

        def on_close(exc: BaseException | None) -> None:
            if client is None:
                early_close.append(exc)
            else:
                client._closed(exc)

        def on_bad(exc: ProtocolError) -> None:
            on_close(exc)

        try:
            _, proto = await asyncio.wait_for(
                loop.create_unix_connection(
                    lambda: FramedProtocol(
                        _reply_decoder(), on_message=on_message, on_close=on_close,
                        on_bad_message=on_bad, max_frame_bytes=MAX_REPLY_FRAME_BYTES,
                    ),
                    path,
                ),
                timeout,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "timed out"
            raise DaemonUnavailable(f"cannot connect to sessiond at {path}: {reason}") from None
        client = cls(proto)
        fut = loop.create_future()
        client._pending[0] = fut
        proto.send(m.Hello(protocol=m.PROTOCOL_VERSION, client=client_name,
                           error_codes=sorted(m.NEW_ERROR_CODES),
                           events=["reasoning"] if reasoning else []))
        for msg in early:
            client._dispatch(msg)
        if early_close:
            client._closed(early_close[0])
        try:
            welcome = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            proto.close()
            raise DaemonUnavailable(f"sessiond at {path} did not answer hello") from None
        except BaseException:
            proto.close()
            raise
        client.server_pid = welcome.pid
        client.server_version = welcome.server_version
        return client

    async def close(self) -> None:
        self._proto.close()
        if not self._proto.closed.done():
            await asyncio.wait([self._proto.closed], timeout=1.0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _dispatch(self, msg: op.AnyReply) -> None:
        if isinstance(msg, m.EVENT_TYPES):
            for q in self._streams.get(getattr(msg, "session", ""), ()):
                q.put_nowait(msg)
            if isinstance(msg, Lagged):
                for queues in self._streams.values():
                    for q in queues:
                        q.put_nowait(msg)
            return
        req_id = 0 if isinstance(msg, m.Welcome) else getattr(msg, "id", 0)
        fut = self._pending.pop(req_id, None)
        if fut is None or fut.done():
            return
        if isinstance(msg, m.Error):
            fut.set_exception(RequestError(str(msg.code), msg.message))
        else:
            fut.set_result(msg)

    def _closed(self, exc: BaseException | None) -> None:
        err = DaemonUnavailable(f"connection to sessiond lost{f': {exc}' if exc else ''}")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        for queues in self._streams.values():
            for q in queues:
                q.put_nowait(_END)

    async def _request(self, msg: Any, expect: type[R]) -> R:
        if self._proto.is_closed:
            raise DaemonUnavailable("connection to sessiond is closed")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msg.id] = fut
        self._proto.send(msg)
        reply = await fut
        if not isinstance(reply, expect):
            raise RequestError("internal", f"unexpected reply {type(reply).__name__}")
        return reply

    def _next_id(self) -> int:
        return next(self._ids)

    # ---------------------------------------------------------------- requests

    async def create(
        self,
        session: str | None = None,
        handler: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> SessionInfo:
        reply = await self._request(
            m.Create(id=self._next_id(), session=session, handler=handler, settings=settings or {}),
            m.Created,
        )
        return reply.session

    async def send(self, session: str, text: str, traceparent: str = "") -> AsyncIterator[Event]:
        """Send an input and yield the events of its turn, ending with
        TurnDone or TurnFailed.  `traceparent` (W3C Trace Context, e.g. the
        caller's current span, `opentelemetry.propagate.inject(carrier)`
        then `carrier["traceparent"]`): the turn's trace continues it,
        when the daemon traces turns."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._streams.setdefault(session, []).append(q)
        try:
            accepted = await self._request(
                m.Send(id=self._next_id(), session=session, text=text, traceparent=traceparent), m.Accepted
            )
            while True:
                ev = await q.get()
                if ev is _END:
                    raise DaemonUnavailable("connection to sessiond lost during the turn")
                if isinstance(ev, Lagged):
                    raise DaemonUnavailable("this client fell behind and was disconnected")
                if ev.seq <= accepted.seq:
                    continue
                yield ev
                if isinstance(ev, (TurnDone, TurnFailed)) and ev.turn == accepted.turn:
                    return
        finally:
            self._drop_stream(session, q)

    async def send_text(self, session: str, text: str, traceparent: str = "") -> str:
        """Send an input and return the whole reply; raises TurnFailedError."""
        async for ev in self.send(session, text, traceparent):
            if isinstance(ev, TurnDone):
                return ev.reply
            if isinstance(ev, TurnFailed):
                raise TurnFailedError(ev)
        raise DaemonUnavailable("the turn ended without a result")

    async def send_input(self, session: str, text: str) -> m.Accepted:
        """Send an input without following its turn: returns once the input
        is durable.  The turn's events come to this connection too (the
        daemon attaches it), for whoever also `attach`es here; the turn goes
        on whatever becomes of this connection."""
        return await self._request(m.Send(id=self._next_id(), session=session, text=text), m.Accepted)

    async def attach(self, session: str, from_seq: int | None = None) -> AsyncIterator[Event]:
        """Yield the session's events (retained ones from `from_seq` first)
        until the session is deleted or the connection ends."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._streams.setdefault(session, []).append(q)
        try:
            await self._request(
                m.Attach(id=self._next_id(), session=session, from_seq=from_seq), m.Attached
            )
            while True:
                ev = await q.get()
                if ev is _END:
                    return
                if isinstance(ev, Lagged):
                    raise DaemonUnavailable("this client fell behind and was disconnected")
                yield ev
                if isinstance(ev, m.StateChanged) and ev.new == "deleted":
                    return
        finally:
            self._drop_stream(session, q)

    def _drop_stream(self, session: str, q: asyncio.Queue[Any]) -> None:
        queues = self._streams.get(session)
        if queues and q in queues:
            queues.remove(q)
            if not queues:
                del self._streams[session]

    async def status(self, session: str) -> SessionInfo:
        reply = await self._request(m.Status(id=self._next_id(), session=session), m.StatusReply)
        return reply.session

    async def list(self, *, states: Sequence[str] = (), owners: Sequence[int] = (),
                   handlers: Sequence[str] = ()) -> list[SessionInfo]:
        """The sessions this client may see; each sequence non-empty keeps
        only those matching one of its values (selected by the daemon)."""
        sessions, _ = await self.list_page(states=states, owners=owners, handlers=handlers)
        return sessions

    async def list_page(self, *, states: Sequence[str] = (), owners: Sequence[int] = (),
                        handlers: Sequence[str] = (), limit: int = 0,
                        after: str = "") -> Page:
        """One page of `list`: at most `limit` sessions (0: all), ordered
        by id, those after `after`; and the `after` of the next page ("":
        none).  A daemon older than pages answers every session at once."""
        reply = await self._request(m.List(id=self._next_id(), states=list(states), owners=list(owners),
                                           handlers=list(handlers), limit=limit, after=after),
                                    m.SessionList)
        return reply.sessions, reply.next

    async def stats(self) -> StatsReply:
        return await self._request(m.Stats(id=self._next_id()), m.StatsReply)

    async def history(self, session: str, limit: int | None = None) -> op.HistoryReply:
        return await self._request(op.History(id=self._next_id(), session=session, limit=limit),
                                   op.HistoryReply)

    async def logs(self, session: str, limit: int | None = None) -> op.LogsReply:
        return await self._request(op.Logs(id=self._next_id(), session=session, limit=limit), op.LogsReply)

    async def export(self, session: str) -> bytes:
        """The session as a JSON document (bytes), for `import_session`."""
        reply = await self._request(op.Export(id=self._next_id(), session=session), op.ExportReply)
        return reply.document

    async def import_session(self, document: bytes, session: str | None = None) -> SessionInfo:
        reply = await self._request(
            op.Import(id=self._next_id(), document=document, session=session), m.Created)
        return reply.session

    async def top(self) -> op.TopReply:
        return await self._request(op.Top(id=self._next_id()), op.TopReply)

    async def drain(self, node: str, timeout_secs: float | None = None, undo: bool = False) -> op.DrainReply:
        return await self._request(
            op.Drain(id=self._next_id(), node=node, timeout_secs=timeout_secs, undo=undo), op.DrainReply)

    async def reload(self) -> op.ReloadReply:
        """Re-read the daemon's config file, as SIGHUP does (admins only):
        whether it was taken, what changed, or why it was refused."""
        return await self._request(op.Reload(id=self._next_id()), op.ReloadReply)

    async def ping(self, session: str | None = None) -> m.Pong:
        return await self._request(m.Ping(id=self._next_id(), session=session), m.Pong)

    async def interrupt(self, session: str) -> None:
        await self._request(m.Interrupt(id=self._next_id(), session=session), m.Ok)

    async def stop(self, session: str) -> None:
        await self._request(m.Stop(id=self._next_id(), session=session), m.Ok)

    async def restart(self, session: str) -> None:
        await self._request(m.Restart(id=self._next_id(), session=session), m.Ok)

    async def remove(self, session: str) -> None:
        await self._request(m.Remove(id=self._next_id(), session=session), m.Ok)

    async def repair(self, session: str, mode: str) -> m.Repaired:
        """mode: "skip_bad" or "truncate" (see `sessionctl repair`)."""
        return await self._request(m.Repair(id=self._next_id(), session=session, mode=mode), m.Repaired)

    async def answer(self, session: str, request_id: str, allow: bool) -> None:
        await self._request(
            m.Answer(id=self._next_id(), session=session, request_id=request_id, allow=allow), m.Ok
        )


class Client:
    """Blocking wrapper around AsyncClient, with its own event loop."""

    def __init__(
        self, socket_path: str | os.PathLike[str] | None = None, *, client_name: str = "sessiond-python",
        reasoning: bool = False,
    ) -> None:
        self._loop = new_event_loop()
        try:
            self._client = self._loop.run_until_complete(
                AsyncClient.connect(socket_path, client_name=client_name, reasoning=reasoning)
            )
        except BaseException:
            self._loop.close()
            raise

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self._client.close())
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _iterate(self, agen: AsyncIterator[Event]) -> Iterator[Event]:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self._run(agen.aclose())  # type: ignore[attr-defined]

    def create(self, session: str | None = None, handler: str | None = None,
               settings: dict[str, Any] | None = None) -> SessionInfo:
        result: SessionInfo = self._run(self._client.create(session, handler, settings))
        return result

    def send(self, session: str, text: str, traceparent: str = "") -> Iterator[Event]:
        return self._iterate(self._client.send(session, text, traceparent))

    def send_text(self, session: str, text: str, traceparent: str = "") -> str:
        result: str = self._run(self._client.send_text(session, text, traceparent))
        return result

    def send_input(self, session: str, text: str) -> m.Accepted:
        result: m.Accepted = self._run(self._client.send_input(session, text))
        return result

    def attach(self, session: str, from_seq: int | None = None) -> Iterator[Event]:
        return self._iterate(self._client.attach(session, from_seq))

    def status(self, session: str) -> SessionInfo:
        result: SessionInfo = self._run(self._client.status(session))
        return result

    def list(self, *, states: Sequence[str] = (), owners: Sequence[int] = (),
             handlers: Sequence[str] = ()) -> list[SessionInfo]:
        result: list[SessionInfo] = self._run(self._client.list(states=states, owners=owners,
                                                                handlers=handlers))
        return result

    def list_page(self, *, states: Sequence[str] = (), owners: Sequence[int] = (),
                  handlers: Sequence[str] = (), limit: int = 0,
                  after: str = "") -> Page:
        result: Page = self._run(self._client.list_page(
            states=states, owners=owners, handlers=handlers, limit=limit, after=after))
        return result

    def stats(self) -> StatsReply:
        result: StatsReply = self._run(self._client.stats())
        return result

    def ping(self, session: str | None = None) -> m.Pong:
        result: m.Pong = self._run(self._client.ping(session))
        return result

    def interrupt(self, session: str) -> None:
        self._run(self._client.interrupt(session))

    def stop(self, session: str) -> None:
        self._run(self._client.stop(session))

    def restart(self, session: str) -> None:
        self._run(self._client.restart(session))

    def remove(self, session: str) -> None:
        self._run(self._client.remove(session))

    def repair(self, session: str, mode: str) -> m.Repaired:
        result: m.Repaired = self._run(self._client.repair(session, mode))
        return result

    def answer(self, session: str, request_id: str, allow: bool) -> None:
        self._run(self._client.answer(session, request_id, allow))


    def history(self, session: str, limit: int | None = None) -> op.HistoryReply:
        result: op.HistoryReply = self._run(self._client.history(session, limit))
        return result

    def logs(self, session: str, limit: int | None = None) -> op.LogsReply:
        result: op.LogsReply = self._run(self._client.logs(session, limit))
        return result

    def export(self, session: str) -> bytes:
        result: bytes = self._run(self._client.export(session))
        return result

    def import_session(self, document: bytes, session: str | None = None) -> SessionInfo:
        result: SessionInfo = self._run(self._client.import_session(document, session))
        return result

    def drain(self, node: str, timeout_secs: float | None = None, undo: bool = False) -> op.DrainReply:
        result: op.DrainReply = self._run(self._client.drain(node, timeout_secs, undo))
        return result

    def top(self) -> op.TopReply:
        result: op.TopReply = self._run(self._client.top())
        return result

    def reload(self) -> op.ReloadReply:
        result: op.ReloadReply = self._run(self._client.reload())
        return result
