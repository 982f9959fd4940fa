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
replies are matched to requests by id, events are routed by session.  When
the daemon goes away, the connection is made again (supervisor.ctl.dial)
and each stream goes on from the last event it saw (`AsyncClient`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

from ipc import messages as m
from ipc import operator as op
from ipc.connection import FramedProtocol
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
from ipc.paths import default_socket_path
from supervisor.ctl.dial import open_connection
# Re-exported: applications catch them as supervisor.client's (and this module's).
from supervisor.ctl.errors import DaemonUnavailable, InputUnacknowledged, RequestError, TurnFailedError
from supervisor.ctl.link import CONNECT_TIMEOUT_SECS, RECONNECT_SECS

__all__ = [
    "AsyncClient",
    "Client",
    "DaemonUnavailable",
    "InputUnacknowledged",
    "RequestError",
    "TurnFailedError",
]

R = TypeVar("R")
_END = object()
# Turns of the session's recent history a client reads back after a
# reconnect to learn how its turn ended, when its end was not retained.
_HISTORY_TURNS = 16


def stored_end(history: op.HistoryReply, session: str, turn: int) -> Event | None:
    """How `turn` ended, as the session's log has it: its TurnDone or
    TurnFailed as read back (seq 0: not an event the daemon sent), or None
    while it is still open.  DaemonUnavailable when the log no longer says
    (folded into a snapshot, or more turns since than were read)."""
    for t in history.turns:
        if t.turn != turn:
            continue
        if t.outcome == "done":
            return TurnDone(session=session, seq=0, turn=turn, reply=t.reply, interrupted=t.interrupted,
                            stop_reason=t.stop_reason, stop_detail=t.stop_detail, usage=t.usage)
        if t.outcome == "aborted":
            return TurnFailed(session=session, seq=0, turn=turn, reason=t.reason)
        return None
    raise DaemonUnavailable(f"turn {turn} of {session} ended while the connection was lost, and its end is "
                            f"no longer kept event by event: `sessionctl history {session}` shows what is")


# One page of a listing: the sessions, and where the next page starts ("": none).
Page = tuple[list[SessionInfo], str]


class AsyncClient:
    """One connection to the daemon, made again when it is lost: a stream
    (`send`'s turn, `attach`) that loses it reconnects with backoff for up
    to `reconnect_secs`, attaches again from the last event it saw, and goes
    on to the end it would have had (docs/protocol.md, "When the daemon
    goes away").  A request in flight when the connection dropped fails with
    DaemonUnavailable (carried out or not, nobody knows: it is not sent
    again); a request made while it is down waits for the reconnection."""

    def __init__(
        self, path: str, *, client_name: str = "sessiond-python", reasoning: bool = False,
        timeout: float = CONNECT_TIMEOUT_SECS, reconnect_secs: float = RECONNECT_SECS,
        on_reconnect: Callable[[str], None] | None = None,
    ) -> None:
        """Not connected: use `AsyncClient.connect`."""
        self.path = path
        self._name = client_name
        self._reasoning = reasoning
        self._timeout = timeout
        self.reconnect_secs = max(reconnect_secs, 0.0)
        # Told, in words, when the connection is lost and when it is back.
        self._on_reconnect = on_reconnect
        self._proto: FramedProtocol[op.AnyReply] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[str, list[asyncio.Queue[Any]]] = {}
        self._redialing: asyncio.Future[None] | None = None
        self._shut = False
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
        reconnect_secs: float = RECONNECT_SECS,
        on_reconnect: Callable[[str], None] | None = None,
    ) -> AsyncClient:
        """`reasoning`: also receive `ReasoningDelta` events (the model's
        reasoning, live only); off, the daemon sends none, as to clients
        older than them.  `reconnect_secs`: how long a stream that lost the
        daemon tries to reconnect before it raises DaemonUnavailable (0:
        not at all); `on_reconnect` is told, in words, when it does."""
        client = cls(str(socket_path or default_socket_path()), client_name=client_name, reasoning=reasoning,
                     timeout=timeout, reconnect_secs=reconnect_secs, on_reconnect=on_reconnect)
        await client._dial()
        return client

    async def _dial(self) -> None:
        proto, welcome = await open_connection(self.path, client_name=self._name, reasoning=self._reasoning,
                                     timeout=self._timeout, on_message=self._dispatch, on_close=self._lost)
        self._proto = proto
        self.server_pid = welcome.pid
        self.server_version = welcome.server_version

    @property
    def connected(self) -> bool:
        return self._proto is not None and not self._proto.is_closed

    async def close(self) -> None:
        self._shut = True
        if self._redialing is not None:
            self._redialing.cancel()
        if self._proto is None:
            return
        self._proto.close()
        if not self._proto.closed.done():
            await asyncio.wait([self._proto.closed], timeout=1.0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _dispatch(self, msg: op.AnyReply) -> None:
        if isinstance(msg, m.EVENT_TYPES):
            if isinstance(msg, Lagged):
                # The daemon cut us off for falling behind; it closes the
                # connection after this: close it now, and the streams
                # attach again from where they were (see `send`).
                if self._proto is not None:
                    self._proto.abort()
                return
            for q in self._streams.get(getattr(msg, "session", ""), ()):
                q.put_nowait(msg)
            return
        req_id = getattr(msg, "id", 0)
        fut = self._pending.pop(req_id, None)
        if fut is None or fut.done():
            return
        if isinstance(msg, m.Error):
            fut.set_exception(RequestError(str(msg.code), msg.message))
        else:
            fut.set_result(msg)

    def _lost(self, proto: FramedProtocol[op.AnyReply], exc: BaseException | None) -> None:
        if proto is not self._proto:
            return  # a connection already replaced
        err = DaemonUnavailable(f"connection to sessiond lost{f': {exc}' if exc else ''}")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        for queues in self._streams.values():
            for q in queues:
                q.put_nowait(_END)

    async def _reconnected(self) -> None:
        """Connected again (at once if the connection is up): one
        reconnection shared by every stream and request waiting on it.
        DaemonUnavailable when the wait is over, or reconnecting is off."""
        if self.connected:
            return
        if self._shut:
            raise DaemonUnavailable("this client was closed")
        if self.reconnect_secs <= 0:
            raise DaemonUnavailable("connection to sessiond lost (reconnect_secs = 0: not waiting for it)")
        if self._redialing is None or self._redialing.done():
            self._redialing = asyncio.ensure_future(self._redial())
        await asyncio.shield(self._redialing)

    async def _redial(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reconnect_secs
        delay = 0.05
        self._say(f"connection to sessiond lost; reconnecting for up to {self.reconnect_secs:g}s")
        while True:
            try:
                await self._dial()
            except DaemonUnavailable as exc:
                why = str(exc)
            except RequestError as exc:
                if exc.code != m.ErrorCode.CAPACITY:  # (too many connections: it may pass)
                    raise
                why = exc.message
            else:
                self._say(f"reconnected to sessiond (pid {self.server_pid})")
                return
            if loop.time() + delay >= deadline:
                raise DaemonUnavailable(f"sessiond did not come back within {self.reconnect_secs:g}s ({why})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _say(self, line: str) -> None:
        if self._on_reconnect is not None:
            self._on_reconnect(line)

    async def _request(self, msg: Any, expect: type[R]) -> R:
        if not self.connected:
            await self._reconnected()
        assert self._proto is not None
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
        when the daemon traces turns.

        Once the input is acknowledged (durable), the turn is followed to
        its end across a daemon restart: reconnected, attached again from
        the last event seen (a `Gap` says what was not retained), and, if
        its end was not retained, ended with the TurnDone or TurnFailed read
        back from the session's history (seq 0).  Lost before the
        acknowledgement: InputUnacknowledged, and the input is not re-sent."""
        q = self._follow(session)
        try:
            try:
                accepted = await self._request(
                    m.Send(id=self._next_id(), session=session, text=text, traceparent=traceparent), m.Accepted)
            except DaemonUnavailable as exc:
                raise InputUnacknowledged(session, "the connection to sessiond was lost") from exc
            last, turn = accepted.seq, accepted.turn
            stored: Event | None = None  # its end as the log has it (after a reconnect)
            while True:
                if stored is not None and q.empty():
                    # Every event the daemon still had is in: the end was not retained.
                    yield stored
                    return
                ev = await q.get()
                if ev is _END:
                    self._unfollow(session, q)
                    q, stored = await self._refollow(session, last, turn)
                    continue
                if ev.seq <= last:
                    continue
                last = ev.seq - 1 if isinstance(ev, m.Gap) else ev.seq
                yield ev
                if isinstance(ev, (TurnDone, TurnFailed)) and ev.turn == turn:
                    return
        finally:
            self._unfollow(session, q)

    async def _refollow(self, session: str, last: int, turn: int) -> tuple[asyncio.Queue[Any], Event | None]:
        """The connection was lost while following `turn`: reconnect,
        attach from the event after `last`, and read back how the turn
        ended if it did (None: still open; its end comes as an event)."""
        while True:
            try:
                await self._reconnected()
            except DaemonUnavailable as exc:
                raise DaemonUnavailable(f"{exc}; turn {turn} of {session} goes on in the daemon if it comes "
                                        f"back: `sessionctl history {session}` tells how it ended") from None
            q = self._follow(session)
            try:
                await self._request(m.Attach(id=self._next_id(), session=session, from_seq=last + 1), m.Attached)
                # After the attach: what the history read misses comes as events.
                history = await self.history(session, _HISTORY_TURNS)
            except DaemonUnavailable:
                self._unfollow(session, q)
                continue  # lost again: once more
            except BaseException:
                self._unfollow(session, q)
                raise
            return q, stored_end(history, session, turn)

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
        try:
            return await self._request(m.Send(id=self._next_id(), session=session, text=text), m.Accepted)
        except DaemonUnavailable as exc:
            raise InputUnacknowledged(session, "the connection to sessiond was lost") from exc

    async def attach(self, session: str, from_seq: int | None = None) -> AsyncIterator[Event]:
        """Yield the session's events (retained ones from `from_seq` first)
        until the session is deleted.  A lost connection is made again (see
        `send`) and the events go on from the last one seen; a session gone
        when the daemon is back raises RequestError (not_found)."""
        q = self._follow(session)
        try:
            attached = await self._request(m.Attach(id=self._next_id(), session=session, from_seq=from_seq),
                                           m.Attached)
            last = attached.next_seq - 1 if from_seq is None else from_seq - 1
            asked: set[int] = set()
            while True:
                ev = await q.get()
                if ev is _END:
                    self._unfollow(session, q)
                    q = await self._reattach(session, last)
                    continue
                if isinstance(ev, m.PermissionRequest) and ev.seq <= last:
                    # One still waiting: the daemon sends it first whatever
                    # the seq asked from; shown once across reconnections.
                    if ev.seq not in asked:
                        asked.add(ev.seq)
                        yield ev
                    continue
                if ev.seq <= last and not isinstance(ev, m.Gap):
                    continue
                last = ev.seq - 1 if isinstance(ev, m.Gap) else ev.seq
                if isinstance(ev, m.PermissionRequest):
                    asked.add(ev.seq)
                yield ev
                if isinstance(ev, m.StateChanged) and ev.new == "deleted":
                    return
        finally:
            self._unfollow(session, q)

    async def _reattach(self, session: str, last: int) -> asyncio.Queue[Any]:
        while True:
            await self._reconnected()
            q = self._follow(session)
            try:
                await self._request(m.Attach(id=self._next_id(), session=session, from_seq=last + 1), m.Attached)
            except DaemonUnavailable:
                self._unfollow(session, q)
                continue
            except BaseException:
                self._unfollow(session, q)
                raise
            return q

    def _follow(self, session: str) -> asyncio.Queue[Any]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._streams.setdefault(session, []).append(q)
        return q

    def _unfollow(self, session: str, q: asyncio.Queue[Any]) -> None:
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
        reply = await self.list_reply(states=states, owners=owners, handlers=handlers, limit=limit, after=after)
        return reply.sessions, reply.next

    async def list_reply(self, *, states: Sequence[str] = (), owners: Sequence[int] = (),
                         handlers: Sequence[str] = (), limit: int = 0, after: str = "") -> m.SessionList:
        """`list_page` as the daemon answered it: also `loading`, set while
        a daemon just started still loads the sessions on disk (the list
        then holds those loaded so far)."""
        return await self._request(m.List(id=self._next_id(), states=list(states), owners=list(owners),
                                          handlers=list(handlers), limit=limit, after=after), m.SessionList)

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
        reasoning: bool = False, reconnect_secs: float = RECONNECT_SECS,
        on_reconnect: Callable[[str], None] | None = None,
    ) -> None:
        """See AsyncClient.connect."""
        self._loop = new_event_loop()
        try:
            self._client = self._loop.run_until_complete(
                AsyncClient.connect(socket_path, client_name=client_name, reasoning=reasoning,
                                    reconnect_secs=reconnect_secs, on_reconnect=on_reconnect)
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

    def list_reply(self, *, states: Sequence[str] = (), owners: Sequence[int] = (),
                   handlers: Sequence[str] = (), limit: int = 0, after: str = "") -> m.SessionList:
        result: m.SessionList = self._run(self._client.list_reply(
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
