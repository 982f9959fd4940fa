"""The control socket: one connection per client, served from its callbacks.

Each client first says `Hello`; a wrong protocol version is answered with
`Error{protocol_mismatch}` and the connection closed, and so is silence
past the handshake timeout.  Then requests are answered as they are
decoded, in `data_received`: the quick ones (ls, status, stats, ping,
attach, interrupt, answers) there and then; the ones that wait on a worker
or the disk (create, send, stop, restart, rm) in a task of their own, so
an `interrupt` is never stuck behind a `stop` on the same connection.  (A
task per connection awaiting each request cost a future and a task wake-up
per request: a third of a daemon ping's CPU in bench/ipc.py.)

Who may connect is decided once, when the connection is made (see
`ClientConn.start`): root, the daemon's own user, `admin_uids`,
`allowed_uids` and members of `allowed_gids` or of the socket's group;
never a process inside a session (its worker or tools, which descend from
the zygote: see supervisor/api/peer.py), whatever its uid; and at most
`max_connections_per_uid` connections per non-admin uid.

One client can only hold a bounded amount of the daemon's memory: a client
that stops reading is cut off once `stream_buffer_size` frames went out
while it took none (ipc.connection: `STALL_SECS`), or once it is
`client_buffer_bytes` bytes behind (told with `Lagged`; the session it
watched is untouched), and a frame that has begun to arrive must be whole
within `frame_timeout_secs`.  All connections of one non-admin uid
together hold at most `client_buffer_bytes_per_uid` (partial frames and
unread replies): the connection that goes over is told `capacity` and
closed.  A connection's buffers are freed when it ends.  A malformed frame is answered with
`Error{bad_request}` and the connection survives; an oversized length
prefix or a frame that never completes is answered and the connection
closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import psutil

from ipc import messages as m
from ipc import operator as op
from ipc.connection import FramedProtocol, SharedBudget
from ipc.errors import FrameTimeout, FrameTooLarge, OverBudget, ProtocolError
from ipc.logfields import escape
from supervisor import __version__
from supervisor.api import listing, peer, transfer
from supervisor.api.accept import Acceptor
from supervisor.errors import BadRequest, Conflict, PermissionDenied, SessiondError
from supervisor.core.manager import SessionManager
from supervisor.core.fdbudget import out_of_fds
from supervisor.core.recorder import NO_METRICS, Recorder
from supervisor.core.tracer import NO_TRACER, Tracer, TurnTrace
from ipc.traceparent import parse_traceparent
from supervisor.api.ratelog import RateLimitedLog

__all__ = ["ControlServer"]

log = logging.getLogger("sessiond.server")
# What a peer can make us say again and again: at most a burst per uid a minute.
peer_log = RateLimitedLog(log)

_request_decoder = msgspec.msgpack.Decoder(op.AnyRequest)
_HANDSHAKE_TIMEOUT_SECS = 10.0
_LAGGED_GRACE_SECS = 1.0
# Refused connections kept open (for at most _LAGGED_GRACE_SECS) until
# their client has read why: a flood of them costs at most this many fds.
_REFUSED_LINGERING = 64
_LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
_CLIENT_NAME_CHARS = 64
# (history, export and import work off the loop: supervisor.api.transfer)
_SLOW = (m.Create, m.Send, m.Stop, m.Restart, m.Remove, m.Repair, op.Drain, op.History, op.Export, op.Import,
         op.Reload)
# Data-plane requests: through the pacer.  The rest (ping, status, ls,
# interrupt, stop...) is answered in the pass that reads it.
_PACED = (m.Send, m.Create, m.Restart, m.Remove, m.Repair, op.Export, op.Import)
# Requests that change sessions: once read, each runs to its end whatever
# its client does (a client gone mid-`rm` must not leave the session half
# stopped, nor have the delete come back after a restart).  Only the reply
# is lost.  (An input the pacer still holds is dropped with its client: it
# was never acknowledged.)
_ACTIONS = (m.Create, m.Stop, m.Restart, m.Remove, m.Repair, op.Import, op.Drain, op.Reload)


class ClientConn:
    def __init__(self, server: ControlServer, proto: FramedProtocol[op.AnyRequest],
                 cred: peer.PeerCredentials) -> None:
        self.server = server
        self.proto = proto
        self.cred = cred
        self.uid, self.gid, self.pid = cred.uid, cred.gid, cred.pid
        self.name = f"client pid={self.pid} uid={self.uid}"
        self.client = ""  # the name its Hello gave, made printable
        self.said_hello = False
        # Error codes newer than protocol 1 that this client said it decodes.
        self.error_codes: frozenset[str] = frozenset()
        # Event tags newer than protocol 1 that this client asked for.
        self.event_tags: frozenset[str] = frozenset()
        self.counted = False  # toward max_connections_per_uid
        self._hello_timer: asyncio.TimerHandle | None = None
        self._pacer = server.manager.pacer
        self._queued = 0  # requests of this connection the pacer holds

    # Subscriber protocol: called by the manager for every event.
    def deliver(self, frame: bytes | bytearray) -> None:
        self.proto.send_frame(frame)

    def on_lagged(self, backlog: int) -> None:
        cfg = self.server.manager.config
        log.warning(
            "%s fell behind (%d frames sent while it took none / %d bytes unsent; [agent] "
            "stream_buffer_size = %d, [daemon] client_buffer_bytes = %d, client_buffer_bytes_per_uid = %d); "
            "disconnecting it",
            self.name, backlog, self.proto.queued_bytes, cfg.agent.stream_buffer_size,
            cfg.daemon.client_buffer_bytes, cfg.daemon.client_buffer_bytes_per_uid,
        )
        transport = self.proto.transport
        if transport is not None and not transport.is_closing():
            # Past the backlog check on purpose: this is the last frame it gets.
            self.proto.drop_queued()
            transport.write(self.proto.encode(m.Lagged(dropped=backlog)))
        self.server.manager.detach(self)
        self.proto.close()
        # close() waits for the buffer to drain, which a reader that never
        # reads never lets happen: give it a moment to take the Lagged
        # notice, then drop the connection and its buffer.
        asyncio.get_running_loop().call_later(_LAGGED_GRACE_SECS, self.proto.abort)

    def on_bad_frame(self, exc: ProtocolError) -> None:
        if isinstance(exc, FrameTooLarge):
            peer_log.warning(self.uid, "%s sent a frame of %d bytes (limit %d); closing",
                             self.name, exc.length, exc.limit)
            message = f"bad frame: {exc} ([daemon] max_frame_bytes)"
        elif isinstance(exc, FrameTimeout):
            peer_log.warning(self.uid, "%s left a frame unfinished for %.0fs; closing", self.name, exc.timeout)
            message = f"bad frame: {exc} ([daemon] frame_timeout_secs)"
        elif isinstance(exc, OverBudget):
            peer_log.warning(self.uid, "%s: its uid's connections hold %d bytes (limit %d); closing",
                             self.name, exc.held, exc.limit)
            error = m.Error(code=m.ErrorCode.CAPACITY,
                            message=f"uid {self.uid}'s connections hold more than {exc.limit} bytes of "
                                    "partly sent frames and unread replies ([daemon] "
                                    "client_buffer_bytes_per_uid); closing this connection")
            self.proto.send(error)
            self.server.metrics.request("invalid", error.code)
            asyncio.get_running_loop().call_later(_LAGGED_GRACE_SECS, self.proto.abort)
            return
        elif not self.said_hello:  # (a hello that does not decode is no hello: see _hello)
            message = f"the first message must be a valid hello: {exc}"
        else:
            message = f"bad frame: {exc}"
        self.proto.send(m.Error(code=m.ErrorCode.BAD_REQUEST, message=message))
        self.server.metrics.request("invalid", m.ErrorCode.BAD_REQUEST)
        if not self.said_hello:
            self.proto.close()
        elif isinstance(exc, (FrameTooLarge, FrameTimeout)):
            # The connection is being closed; one that does not read would
            # keep it (and its buffers) open forever, so it gets a moment.
            asyncio.get_running_loop().call_later(_LAGGED_GRACE_SECS, self.proto.abort)

    # ---------------------------------------------------------------- lifecycle

    def start(self, sock: Any) -> None:
        """Called once the connection is made: admit it, or answer why not
        and close."""
        refusal = self.server.refusal(self, sock)
        if refusal is not None:
            self.server.refuse(self, refusal)
            return
        self._hello_timer = asyncio.get_running_loop().call_later(
            _HANDSHAKE_TIMEOUT_SECS, self._hello_timeout
        )

    def _hello_timeout(self) -> None:
        if not self.said_hello:
            self.proto.send(m.Error(code=m.ErrorCode.BAD_REQUEST, message="no hello within 10s"))
            self.proto.close()

    def closed(self, exc: BaseException | None) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.server.refused.discard(self)
        # Its request tasks are not cancelled (see _ACTIONS): the server
        # holds them until they end; an input's turn goes on, unwatched.
        self.server.manager.detach(self)
        self.server.clients.discard(self)
        if self.counted:
            self.counted = False
            self.server.uncount(self.uid)

    # ---------------------------------------------------------------- requests

    def on_message(self, msg: op.AnyRequest) -> None:
        """From data_received.  A control request is answered now (and,
        under load, its reply written now), unless requests of this
        connection are still queued: replies keep the order of requests.  The data plane
        (inputs, creates...) waits for the pacer (see ipc.pacing)."""
        if self._queued or isinstance(msg, _PACED):
            self._queued += 1
            # An input's trace starts here: its time in the pacer's queue counts.
            self._pacer.now_or_later(self._paced, msg, time.time_ns() if self.server.tracer.enabled else 0)
            return
        self._handle(msg)
        if len(self._pacer):
            # A slice is ahead of the end-of-pass write: do not wait for it.
            # (Without queued work, replies of one read still share a write.)
            self.proto.flush()

    def _paced(self, msg: op.AnyRequest, received_ns: int = 0) -> None:
        self._queued -= 1
        if not self.proto.is_closed or (self.said_hello and isinstance(msg, _ACTIONS)):
            self._handle(msg, received_ns)

    def _handle(self, msg: op.AnyRequest, received_ns: int = 0) -> None:
        trace: TurnTrace | None = None
        if self.said_hello and isinstance(msg, m.Send):
            try:
                trace = self._trace(msg, received_ns)
            except BadRequest as exc:
                reply = self._error_reply(msg, exc)
                self.proto.send(reply)
                self._count(msg, reply)
                return
        if not self.said_hello:
            self._hello(msg)
        elif isinstance(msg, m.Send) and self._send_now(msg, trace):
            pass
        elif isinstance(msg, _SLOW) or (isinstance(msg, m.List) and self.server.manager.loading is not None):
            self.server.track(asyncio.get_running_loop().create_task(self._answer_later(msg, trace)))
        else:
            try:
                reply = self._handle_now(msg)
            except Exception as exc:
                reply = self._error_reply(msg, exc)
            if reply is not None:
                self.proto.send(reply)
            if reply is not None or not isinstance(msg, m.Ping):  # a session's pong counts when it comes
                self._count(msg, reply)

    def _trace(self, msg: m.Send, received_ns: int) -> TurnTrace | None:
        """The input's trace (None: tracing is off); its `traceparent`
        is checked whether or not tracing is on: it is a field of the
        protocol, and a client's mistake should show at once."""
        parent = None
        if msg.traceparent:
            try:
                parent = parse_traceparent(msg.traceparent)
            except ValueError as exc:
                raise BadRequest(f"invalid traceparent: {exc}") from None
        return self.server.tracer.request(parent, received_ns or time.time_ns())

    def _send_now(self, msg: m.Send, trace: TurnTrace | None = None) -> bool:
        """An input to an idle session, started here rather than in a task
        of its own (a task's first step would run outside the pacer's
        slice).  This is `SessionManager.send` for the one case where it
        would not wait: no lock held, the session idle.  False: take the
        task."""
        mgr = self.server.manager
        try:
            session = mgr.get(msg.session, self.uid)
        except SessiondError:
            return False  # the task answers with the error
        rid = msg.id

        def on_accepted(accepted: m.Accepted) -> None:
            accepted.id = rid
            self.proto.send(accepted)

        def done(fut: asyncio.Future[m.Accepted]) -> None:
            if fut.cancelled():
                return
            exc = fut.exception()
            reply = None
            if exc is not None:
                reply = self._error_reply(msg, exc if isinstance(exc, Exception) else Exception(exc))
            if reply is not None:
                self.proto.send(reply)
            self._count(msg, reply)

        try:
            durable = mgr.send_now(session, msg.text, self, on_accepted, trace)
        except Exception as exc:
            reply = self._error_reply(msg, exc)
            self.proto.send(reply)
            self._count(msg, reply)
            return True
        if durable is None:
            return False
        durable.add_done_callback(done)
        return True

    def _count(self, msg: op.AnyRequest, reply: Any) -> None:
        code = reply.code if isinstance(reply, m.Error) else "ok"
        self.server.metrics.request(str(type(msg).__struct_config__.tag), code)

    def _hello(self, msg: op.AnyRequest) -> None:
        if not isinstance(msg, m.Hello):
            refusal = m.Error(code=m.ErrorCode.BAD_REQUEST, message="the first message must be hello")
            self.proto.send(refusal)
            self.proto.close()
            self._count(msg, refusal)
            return
        if msg.protocol != m.PROTOCOL_VERSION:
            refusal = m.Error(
                code=m.ErrorCode.PROTOCOL_MISMATCH,
                message=f"this daemon speaks protocol {m.PROTOCOL_VERSION}, the client {msg.protocol}",
            )
            self.proto.send(refusal)
            self.proto.close()
            self._count(msg, refusal)
            return
        self.said_hello = True
        self.error_codes = frozenset(msg.error_codes) & m.NEW_ERROR_CODES
        self.event_tags = frozenset(msg.events) & m.NEW_EVENT_TAGS
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if msg.client:
            # The name goes into log lines: a newline in it would forge one.
            self.client = _printable(msg.client)
            self.name = f"{self.client} pid={self.pid} uid={self.uid}"
        self.proto.send(
            m.Welcome(protocol=m.PROTOCOL_VERSION, server_version=__version__, pid=os.getpid())
        )
        self._count(msg, None)

    def _error_reply(self, msg: op.AnyRequest, exc: Exception) -> m.Error:
        """The answer to a request that raised: its code for our errors,
        `internal` (and the traceback in the log) for anything else."""
        rid = getattr(msg, "id", 0)
        if isinstance(exc, SessiondError):
            code = exc.code
            if code in m.NEW_ERROR_CODES and code not in self.error_codes:
                code = m.ErrorCode.INTERNAL  # an older client would fail to decode it
            return m.Error(id=rid, code=code, message=exc.message)
        if (refusal := out_of_fds(exc)) is not None:  # whatever opened a file: a refusal, not a bug
            return m.Error(id=rid, code=refusal.code, message=refusal.message)
        log.error("request %s from %s failed", type(msg).__name__, self.name, exc_info=exc)
        return m.Error(id=rid, code=m.ErrorCode.INTERNAL, message=f"internal error: {exc}")

    async def _answer_later(self, msg: op.AnyRequest, trace: TurnTrace | None = None) -> None:
        try:
            reply = await self._handle_later(msg, trace)
        except Exception as exc:
            reply = self._error_reply(msg, exc)
        if isinstance(reply, transfer.Encoded):  # (a large reply, encoded off the loop)
            self.proto.send_frame(reply.frame)
        elif reply is not None:
            self.proto.send(reply)
        if self.proto.is_closed:
            self.server.manager.detach(self)  # a `send` that subscribed a client gone meanwhile
        self._count(msg, reply)

    def _handle_now(self, msg: op.AnyRequest) -> Any:
        mgr = self.server.manager
        match msg:
            case m.Ping(id=rid, session=None):
                return m.Pong(id=rid, pid=os.getpid())
            case m.Ping(id=rid, session=sid) if sid is not None:
                # Answered from the worker's pong callback: no task, no timer.
                pid = 0

                def answer(err: SessiondError | None) -> None:
                    reply = (m.Pong(id=rid, session=sid, pid=pid) if err is None
                             else m.Error(id=rid, code=err.code, message=err.message))
                    self.proto.send(reply)
                    self._count(msg, reply)

                pid = mgr.ping(mgr.get(sid, self.uid), answer)
                return None
            case m.Attach(id=rid, session=sid, from_seq=from_seq):
                session = mgr.get(sid, self.uid)
                self.proto.send(m.Attached(id=rid, session=sid, next_seq=session.seq + 1))
                mgr.attach(session, self, from_seq)
                return None
            case m.Detach(id=rid, session=sid):
                mgr.detach(self, mgr.get(sid, self.uid))
                return m.Ok(id=rid)
            case m.Interrupt(id=rid, session=sid):
                mgr.interrupt(mgr.get(sid, self.uid))
                return m.Ok(id=rid)
            case m.Status(id=rid, session=sid):
                return m.StatusReply(id=rid, session=mgr.info(mgr.get(sid, self.uid)))
            case m.List():
                return self._list(msg)
            case m.Stats(id=rid):
                return self.server.stats(rid, self.uid)
            case op.Top(id=rid):
                return self.server.top(rid, self.uid)
            case op.Logs(id=rid, session=sid, limit=limit):
                session = mgr.get(sid, self.uid)
                entries = [op.LogEntry(at=at, event=ev) for at, ev in mgr.events.lifecycle(session)]
                if limit is not None:
                    entries = entries[len(entries) - max(limit, 0):] if limit > 0 else []
                return op.LogsReply(id=rid, session=sid, entries=entries, last_exit=session.last_exit,
                                   next_seq=session.seq + 1)
            case m.Answer(id=rid, session=sid, request_id=request_id, allow=allow):
                mgr.answer(mgr.get(sid, self.uid), request_id, allow, self.uid, self.client)
                return m.Ok(id=rid)
            case m.Hello():
                raise BadRequest("hello was already said")
        raise BadRequest(f"unsupported request {type(msg).__name__}")

    def _list(self, msg: m.List) -> m.SessionList:
        mgr = self.server.manager
        chosen, after = listing.select(mgr.visible(self.uid), msg)
        return m.SessionList(id=msg.id, sessions=[mgr.info(s) for s in chosen], next=after,
                             loading=listing.loading(mgr.loading, mgr.is_admin(self.uid)))

    async def _handle_later(self, msg: op.AnyRequest, trace: TurnTrace | None = None) -> Any:
        mgr = self.server.manager
        match msg:
            case m.List():  # while the start-up load runs: a moment for it to end
                await mgr.settled()
                return self._list(msg)
            case m.Create(id=rid, session=sid, handler=handler, settings=settings):
                session = await mgr.create(self.uid, sid, handler, dict(settings))
                return m.Created(id=rid, session=mgr.info(session, with_rss=False))
            case m.Send(id=rid, session=sid, text=text):
                # Written the moment the input is durable, before the turn's
                # later events (which may already be on their way).
                def on_accepted(accepted: m.Accepted) -> None:
                    accepted.id = rid
                    self.proto.send(accepted)

                await mgr.send(mgr.get(sid, self.uid), text, self, on_accepted, trace)
                return None
            case m.Stop(id=rid, session=sid):
                await mgr.stop(mgr.get(sid, self.uid))
                return m.Ok(id=rid)
            case m.Restart(id=rid, session=sid):
                await mgr.restart(mgr.get(sid, self.uid))
                return m.Ok(id=rid)
            case m.Remove(id=rid, session=sid):
                await mgr.remove(mgr.get(sid, self.uid))
                return m.Ok(id=rid)
            case m.Repair(id=rid, session=sid, mode=mode):
                session, result = await mgr.repair(mgr.get(sid, self.uid), mode)
                return m.Repaired(
                    id=rid, session=mgr.info(session, with_rss=False),
                    kept_records=result.kept_records, dropped_records=result.dropped_records,
                    dropped_bytes=result.dropped_bytes,
                )
            case op.Drain():
                return await self.server.drain(msg, self.uid)
            case op.Reload(id=rid):
                if not mgr.is_admin(self.uid):
                    raise PermissionDenied("only an admin may reload the daemon's config "
                                           "(root, [daemon] admin_uids)")
                reloaded = self.server.reload()
                reloaded.id = rid
                return reloaded
            case op.History(id=rid, session=sid, limit=limit):
                reply = await transfer.history(mgr.get(sid, self.uid), limit, mgr.damage)
                reply.id = rid
                return await transfer.encoded(reply)
            case op.Export(id=rid, session=sid):
                cfg = mgr.config.daemon
                limit = min(cfg.max_document_bytes, cfg.max_frame_bytes - 4096)
                document = await transfer.export_document(mgr.get(sid, self.uid), limit, mgr.budgets.spent,
                                                          mgr.damage)
                return await transfer.encoded(op.ExportReply(id=rid, session=sid, document=document))
            case op.Import(id=rid, document=document, session=sid):
                session = await transfer.import_session(mgr, self.uid, document, sid)
                return m.Created(id=rid, session=mgr.info(session, with_rss=False))
        raise BadRequest(f"unsupported request {type(msg).__name__}")


class _ClientProtocol(FramedProtocol[op.AnyRequest]):
    def __init__(self, server: ControlServer) -> None:
        super().__init__(
            _request_decoder,
            max_frame_bytes=server.manager.config.daemon.max_frame_bytes,
            max_backlog=server.manager.config.agent.stream_buffer_size,
            max_backlog_bytes=server.manager.config.daemon.client_buffer_bytes,
            frame_timeout=server.manager.config.daemon.frame_timeout_secs,
        )
        self._server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        try:
            cred = peer.credentials(sock)
        except OSError as exc:
            log.warning("cannot read a client's credentials: %s", exc)
            self.abort()
            return
        client = ClientConn(self._server, self, cred)
        self._on_message = client.on_message
        self._on_bad_message = client.on_bad_frame
        self._on_lagged = client.on_lagged
        self._on_close = client.closed
        self._server.clients.add(client)
        client.start(sock)


class ControlServer:
    def __init__(
        self,
        manager: SessionManager,
        *,
        metrics: Recorder = NO_METRICS,
        drain: Callable[[op.Drain, int], Awaitable[op.DrainReply]] | None = None,
        reload: Callable[[], op.ReloadReply] | None = None,
        tracer: Tracer = NO_TRACER,
    ) -> None:
        self.manager = manager
        # An input's trace begins where it arrives (supervisor.core.tracer).
        self.tracer = tracer
        # `sessionctl drain` (supervisor.cluster.drain.Drainer.handle, given by the daemon).
        self.drain = drain or _no_drain
        self.clients: set[ClientConn] = set()
        self.started = time.monotonic()
        self._acceptor: Acceptor | None = None
        self._connections: dict[int, int] = {}  # admitted, by non-exempt uid
        self.refused: set[ClientConn] = set()  # lingering until their client read why (`refuse`)
        self._budgets: dict[int, SharedBudget] = {}  # by the same uids
        self.metrics = metrics
        # `sessionctl reload` (supervisor.ops.reload.Reloader.reload, given by the daemon).
        self.reload = reload or _no_reload
        # Request tasks of every connection, held here so that one whose
        # client has gone still runs to its end (see _ACTIONS).
        self.requests: set[asyncio.Task[None]] = set()

    def track(self, task: asyncio.Task[None]) -> None:
        self.requests.add(task)
        task.add_done_callback(self.requests.discard)

    async def settle(self, timeout: float) -> None:
        """At shutdown: let the requests in flight end (an `rm` half done
        would come back after the restart), for up to `timeout`."""
        if self.requests:
            await asyncio.wait(set(self.requests), timeout=timeout)

    def refuse(self, client: ClientConn, refusal: m.Error) -> None:
        """Tell a refused client why so that it reads it (closed at once, its
        hello's write failed, EPIPE, before it read us): our side is shut
        for writing and what it sends dropped until it closes, for at most
        a grace.  Past _REFUSED_LINGERING such, one is closed at once."""
        client.proto.send(refusal)
        if len(self.refused) >= _REFUSED_LINGERING:
            client.proto.close()
            return
        self.refused.add(client)
        client.proto.shut_write()
        asyncio.get_running_loop().call_later(_LAGGED_GRACE_SECS, client.proto.abort)

    def admits(self, cred: peer.PeerCredentials) -> bool:
        """Whoever the operator let through the socket's mode: the core's one
        policy (supervisor.core.admission), also asked of every stored owner."""
        return self.manager.admission.admits(cred.uid, cred.gid, cred.groups)

    def refusal(self, client: ClientConn, sock: Any) -> m.Error | None:
        """Why `client` may not use this daemon, as the error it is told
        (and logged); None to admit it, counted toward its uid's quota."""
        cred = client.cred
        cfg = self.manager.config.daemon
        if not self.admits(cred):
            peer_log.warning(cred.uid, "refused %s: not in allowed_uids/allowed_gids", client.name)
            return m.Error(
                code=m.ErrorCode.PERMISSION_DENIED,
                message=f"uid {cred.uid} may not use this daemon ([daemon] allowed_uids / allowed_gids)",
            )
        # Read at each check: the zygote may have been re-executed.
        roots, uids = self.manager.session_origins()
        try:
            inside = peer.in_session(sock, cred, roots, uids)
        except OSError as exc:
            # Typically EMFILE: we cannot tell, and must not guess either way.
            log.warning("cannot check where %s comes from: %s", client.name, exc)
            return m.Error(
                code=m.ErrorCode.CAPACITY,
                message=f"the daemon cannot check this connection now ({exc.strerror or exc}); "
                        "it is probably out of file descriptors (RLIMIT_NOFILE, LimitNOFILE= "
                        "in the unit): try again",
            )
        except peer.AncestryChanged as exc:
            log.warning("refused %s: %s", client.name, exc)
            return m.Error(code=m.ErrorCode.PERMISSION_DENIED,
                           message=f"refused: {exc}; try again")
        if inside:
            peer_log.warning(cred.uid, "refused %s: it runs inside a session (%s)", client.name, inside)
            return m.Error(
                code=m.ErrorCode.PERMISSION_DENIED,
                message="connections from inside a session (its worker or tools) are refused: "
                        "a session may not control the daemon",
            )
        if not self.manager.is_admin(cred.uid):
            held = self._connections.get(cred.uid, 0)
            if held >= cfg.max_connections_per_uid:
                log.warning("refused %s: uid %d already holds %d connections",
                            client.name, cred.uid, held)
                return m.Error(
                    code=m.ErrorCode.CAPACITY,
                    message=f"uid {cred.uid} already holds {held} connections to this daemon "
                            f"([daemon] max_connections_per_uid = {cfg.max_connections_per_uid})",
                )
            self._connections[cred.uid] = held + 1
            client.counted = True
            budget = self._budgets.get(cred.uid)
            if budget is None:
                budget = self._budgets[cred.uid] = SharedBudget(cfg.client_buffer_bytes_per_uid)
            budget.limit = cfg.client_buffer_bytes_per_uid  # (a reload may have changed it)
            client.proto.use_budget(budget)
        return None

    def uncount(self, uid: int) -> None:
        left = self._connections.get(uid, 0) - 1
        if left > 0:
            self._connections[uid] = left
        else:
            self._connections.pop(uid, None)
            self._budgets.pop(uid, None)  # its last connection gave back what it held

    async def start(self, sock: socket.socket) -> None:
        # The backlog is set again here: whoever made the socket may have
        # asked for less, and a burst of connections would then be refused.
        sock.listen(_LISTEN_BACKLOG)
        # Our own accept, not the loop's server: out of fds, a client is
        # told `capacity` rather than dropped (supervisor.api.accept).
        self._acceptor = Acceptor(sock, lambda: _ClientProtocol(self))
        self._acceptor.start()

    def stop_accepting(self) -> None:
        if self._acceptor is not None:
            self._acceptor.close()
            self._acceptor = None

    def close_clients(self) -> None:
        for client in list(self.clients):
            client.proto.close()

    def top(self, rid: int, uid: int) -> op.TopReply:
        """`sessionctl top`: every session's info and its worker's CPU time.
        One psutil call per live worker (~10 µs), at the rate a client asks."""
        entries = []
        for s in self.manager.visible(uid):
            info = self.manager.info(s)
            cpu: float | None = None
            if info.pid is not None:
                with contextlib.suppress(psutil.Error):
                    t = psutil.Process(info.pid).cpu_times()
                    cpu = t.user + t.system + t.children_user + t.children_system
            entries.append(op.TopEntry(session=info, cpu_secs=cpu))
        stats = self.stats(rid, uid)
        return op.TopReply(id=rid, at=time.time(), uptime_secs=stats.uptime_secs, rss_bytes=stats.rss_bytes,
                          clients=stats.clients, entries=entries)

    def stats(self, rid: int, uid: int) -> m.StatsReply:
        """The daemon's figures.  Counts (sessions, states, live workers,
        clients) are the asker's own unless it is an admin: how many
        sessions other users hold, and when, is theirs to know."""
        by_state: dict[str, int] = {}
        rss = 0
        admin = self.manager.is_admin(uid)
        sessions = self.manager.visible(uid)
        for s in sessions:
            by_state[s.state.value] = by_state.get(s.state.value, 0) + 1
        with contextlib.suppress(psutil.Error):
            rss = psutil.Process().memory_info().rss
        clients = len(self.clients) if admin else sum(1 for c in self.clients if c.uid == uid)
        return m.StatsReply(
            id=rid, pid=os.getpid(), version=__version__,
            uptime_secs=time.monotonic() - self.started, sessions=len(sessions),
            by_state=by_state, live_workers=sum(1 for s in sessions if s.worker is not None),
            clients=clients, rss_bytes=rss, sandbox=self.manager.host_report(),
            tracing=self.tracer.stats() if admin else {},
            mcp={x.name: {"state": x.state, "tools": len(x.tools), "version": x.version,
                          **({"error": x.error} if admin and x.error else {})} for x in self.manager.config.mcp.listed},
            loading=listing.loading(self.manager.loading, admin),
        )


async def _no_drain(msg: op.Drain, uid: int) -> op.DrainReply:
    raise Conflict("this daemon cannot drain nodes")


def _no_reload() -> op.ReloadReply:
    raise Conflict("this daemon was started without a way to reload its config")


def _printable(name: str) -> str:
    """A client-chosen name made safe for one log line: bounded, and with
    control characters (newlines above all) escaped."""
    return escape(name[:_CLIENT_NAME_CHARS]) + ("..." if len(name) > _CLIENT_NAME_CHARS else "")
