"""A session's observable history: its states, its event numbers, what is
retained for clients that attach later, and the fan-out to attached clients.

Runs in the daemon's loop.  Every state change is an event (`StateChanged`),
so the state machine is applied here and nowhere else.  Seq numbers are
reserved in blocks and the reservation persisted (a `Mark` record) before a
number of the block is handed out, so a daemon killed mid-turn never hands
out a seq a client has already seen.  Retention is bounded per session
(`event_retention`, `event_retention_bytes`) and for all sessions together
(`event_retention_total_bytes`).

A session at rest costs little here: its ring is made at its first
retained event and let go of when it hibernates (a client that attaches
from a seq after that is told the `gap` and reads `history`, as after a
daemon restart: docs/protocol.md), its lifecycle is packed into bytes
(compressed past a hundred), and its subscribers, held events and state
waiters exist only while there are any.  Which sessions a client follows
is kept both ways, so that a client's going costs its own sessions, not a
walk of them all.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterable

import msgspec

from ipc import messages as m
from ipc.contract import LimitKind
from ipc.framing import FrameEncoder
from supervisor.config import DaemonSettings
from supervisor.errors import Conflict
from supervisor.logtag import tagged
from supervisor.core.registry import Registry
from supervisor.core.session import LIFECYCLE_KEEP, Session, Subscriber
from supervisor.core.tracer import NO_TRACER, Tracer
from supervisor.core.states import AT_REST, State, Trigger, transition
from supervisor.store.state_store import LIFE_EVENTS_KEPT, LifeEvent, Mark, StoreError

__all__ = ["EventLog"]

log = logging.getLogger("sessiond.manager")

_SEQ_BLOCK = 4096

_Lifecycle = m.StateChanged | m.LimitExceeded | m.TurnFailed
_Kept = collections.deque[tuple[float, _Lifecycle]]
_lifecycle_decoder: msgspec.msgpack.Decoder[_Lifecycle] = msgspec.msgpack.Decoder(_Lifecycle)
_packed_decoder: msgspec.msgpack.Decoder[list[tuple[float, _Lifecycle]]] = msgspec.msgpack.Decoder(
    list[tuple[float, _Lifecycle]])
_packer = msgspec.msgpack.Encoder()
# A packed lifecycle longer than this is compressed (about 15 µs at each
# hibernation): its events repeat the same words (ids, states), 2x for a
# few, 10x and more for hundreds.  A msgpack array never begins with a
# zlib header (0x78: a positive fixint), which tells the two apart.
_COMPRESS_PAST = 128
_ZLIB_HEADER = 0x78
_TURN_STATES = frozenset({State.RUNNING, State.INTERRUPTING})


def _per_turn(event: m.StateChanged) -> bool:
    """A turn's own state changes: idle -> running (-> interrupting) -> idle."""
    return event.new in _TURN_STATES or (event.old in _TURN_STATES and event.new == State.IDLE)


def _pack(events: Iterable[tuple[float, _Lifecycle | msgspec.Raw]]) -> bytes:
    packed = _packer.encode(list(events))
    return zlib.compress(packed) if len(packed) > _COMPRESS_PAST else packed


def _unpack(packed: bytes) -> _Kept:
    kept: _Kept = collections.deque(maxlen=LIFECYCLE_KEEP)
    if packed:
        kept.extend(_packed_decoder.decode(zlib.decompress(packed) if packed[0] == _ZLIB_HEADER else packed))
    return kept


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()  # a failed flush is the next commit's to report


class EventLog:
    def __init__(
        self, settings: Callable[[], DaemonSettings], sessions: Registry,
        tracer: Tracer = NO_TRACER,
    ) -> None:
        self._settings = settings
        self._sessions = sessions  # told every state change (Registry.relive)
        # The sessions each client follows (the other way round: Session.subscribers).
        self._following: dict[Subscriber, set[Session]] = {}
        self._ringed: set[Session] = set()  # the sessions whose ring exists (trim, the fair share)
        # Told every transition: a restart's span, a worker boot's.
        self._tracer = tracer
        self._encoder = FrameEncoder()
        self.retained_bytes = 0  # all sessions' rings together

    # ---------------------------------------------------------------- events

    def emit(self, session: Session, event: m.Event, why: str = "") -> None:
        frame = self._encoder.encode(event)
        if isinstance(event, (m.StateChanged, m.LimitExceeded, m.TurnFailed)):
            self._lifecycle(session, event, frame, why)
        ring = session.ring
        if ring is None:
            ring = session.ring = collections.deque(maxlen=self._settings().event_retention)
            self._ringed.add(session)
        elif len(ring) == ring.maxlen:
            self._drop_oldest(session)
        ring.append((event.seq, frame))
        session.ring_bytes += len(frame)
        self.retained_bytes += len(frame)
        cfg = self._settings()
        limit = cfg.event_retention_bytes
        if self.retained_bytes > cfg.event_retention_total_bytes:
            limit = min(limit, self._fair_share())
        while session.ring_bytes > limit and len(ring) > 1:
            self._drop_oldest(session)
        if not session.subscribers:
            return
        held = session.held
        for sub in list(session.subscribers):
            if held and sub in held:
                self._hold(session, sub, frame)
            else:
                sub.deliver(frame)

    def _lifecycle(self, session: Session, event: m.StateChanged | m.LimitExceeded | m.TurnFailed,
                   frame: bytes | bytearray, why: str) -> None:
        """`sessionctl logs`: kept in memory, and in the session's log unless
        it is a turn's own running and back (the turns are in the log
        already) or the session's end; logged with its fields for journald."""
        at = time.time()
        if isinstance(session.lifecycle, bytes):
            session.lifecycle = _unpack(session.lifecycle)
        session.lifecycle.append((at, event))
        per_turn = isinstance(event, m.StateChanged) and _per_turn(event)
        if not per_turn and not (isinstance(event, m.StateChanged) and event.new == State.DELETED):
            try:
                session.store.append(LifeEvent(at=at, seq=event.seq, event=bytes(frame[4:])), durable=False)
                session.store.sync_soon().add_done_callback(_retrieve)
            except StoreError as exc:  # (a damaged log, one another daemon holds): memory only
                log.debug("session=%s: lifecycle event not kept: %s", session.id, exc)
        if isinstance(event, m.StateChanged):
            # A failed session needs an operator: say so where they look.
            level = (logging.WARNING if event.new == State.FAILED else
                     logging.DEBUG if per_turn else logging.INFO)
        else:
            level = logging.INFO
        if not log.isEnabledFor(level):
            return  # (a turn's own states, at the default level: nothing to build)
        uid = session.meta.run_uid
        if uid is None and not self._settings().worker_user:
            uid = os.geteuid()  # its worker runs as the daemon's user
        line = tagged(log, session.id, uid=uid, owner_uid=session.meta.owner_uid)
        if isinstance(event, m.StateChanged):
            line.event(level, "state", {"session_state": event.new}, "%s -> %s (%s)",
                       event.old, event.new, event.reason or why)
        elif isinstance(event, m.LimitExceeded):
            line.event(level, "limit", {"sessiond_limit": event.kind}, "limit %s: %g over %g",
                       event.kind, event.value, event.limit)
        else:
            line.event(level, "turn_failed", {}, "aborted turn %d: %s", event.turn, event.reason)

    @staticmethod
    def lifecycle(session: Session) -> list[tuple[float, _Lifecycle]]:
        """`sessionctl logs`: the lifecycle events kept, oldest first."""
        kept = session.lifecycle
        return list(_unpack(kept) if isinstance(kept, bytes) else kept)

    def lifecycle_kept(self, session: Session) -> list[LifeEvent]:
        """What a snapshot keeps of `logs` (its log's records go)."""
        kept = [LifeEvent(at=at, seq=ev.seq, event=bytes(self._encoder.encode(ev)[4:]))
                for at, ev in self.lifecycle(session) if not (isinstance(ev, m.StateChanged) and _per_turn(ev))]
        return kept[-LIFE_EVENTS_KEPT:]

    @staticmethod
    def restored_lifecycle(kept: Iterable[LifeEvent]) -> bytes:
        """`Session.lifecycle` from what the store kept (at load), packed:
        each event checked as it decodes, kept as the store has it."""
        out: list[tuple[float, msgspec.Raw]] = []
        for rec in kept:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                _lifecycle_decoder.decode(rec.event)
                out.append((rec.at, msgspec.Raw(rec.event)))
        return _pack(out[-LIFECYCLE_KEEP:])

    def adopt_lifecycle(self, session: Session, kept: Iterable[LifeEvent]) -> None:
        """Claimed back from another daemon: what the shared store kept,
        this daemon's earlier events and the other's, over what it knew."""
        session.lifecycle = self.restored_lifecycle(kept)

    def emit_live(self, session: Session, event: m.ReasoningDelta) -> None:
        """An event of NEW_EVENT_TAGS: to the subscribers that asked for its
        tag, not retained (see `ReasoningDelta`)."""
        tag = type(event).__struct_config__.tag
        frame: bytes | bytearray | None = None
        for sub in list(session.subscribers or ()):
            if tag in sub.event_tags:
                frame = frame or self._encoder.encode(event)
                if session.held and sub in session.held:
                    self._hold(session, sub, frame)
                else:
                    sub.deliver(frame)

    def emit_limit(self, session: Session, kind: LimitKind, value: float, limit: float, ceiling: str = "") -> None:
        """`ceiling`: the setting that set `limit`, where it is not the kind's own."""
        self.emit(
            session,
            m.LimitExceeded(session=session.id, seq=self.next_seq(session), kind=kind,
                            value=round(value, 3), limit=limit, ceiling=ceiling),
        )

    def next_seq(self, session: Session) -> int:
        session.seq += 1
        if session.seq > session.reserved_seq:
            session.reserved_seq = session.seq + _SEQ_BLOCK
            self.write_mark(session, durable=False)
        return session.seq

    def advance_seq(self, session: Session) -> int:
        """The next number for a record written before the session serves
        (an abort found at load or claim): no reservation is written."""
        session.seq += 1
        return session.seq

    def raise_seq(self, session: Session, seq: int) -> None:
        """Numbers only go up: a session claimed back from another daemon
        goes on from the larger of its numbering and the holder's."""
        session.seq = max(session.seq, seq)
        session.reserved_seq = max(session.reserved_seq, seq)

    def hold(self, session: Session, subscriber: Subscriber) -> None:
        """Subscribe a client that is sending an input, holding the events
        for it until `release`: its `Accepted` goes first, and the turn's
        events (its `state` running included) follow, as docs/protocol.md
        promises.  Other subscribers get them at once."""
        self._subscribe(session, subscriber)
        if session.held is None:
            session.held = {}
        session.held[subscriber] = []

    def release(self, session: Session, only: Iterable[Subscriber] | None = None) -> None:
        """The held events, delivered: called once the sender's `Accepted`
        (or its `Error`) is written."""
        for sub in list(session.held or ()) if only is None else only:
            for frame in self._unhold(session, sub) or ():
                sub.deliver(frame)

    @staticmethod
    def _unhold(session: Session, sub: Subscriber) -> list[bytes | bytearray] | None:
        held = session.held
        if held is None:
            return None
        frames = held.pop(sub, None)
        if not held:
            session.held = None
        return frames

    def _subscribe(self, session: Session, subscriber: Subscriber) -> None:
        if session.subscribers is None:
            session.subscribers = set()
        session.subscribers.add(subscriber)
        self._following.setdefault(subscriber, set()).add(session)

    def _unsubscribe(self, session: Session, subscriber: Subscriber) -> None:
        subs = session.subscribers
        if subs is not None:
            subs.discard(subscriber)
            if not subs:
                session.subscribers = None
        following = self._following.get(subscriber)
        if following is not None:
            following.discard(session)
            if not following:
                del self._following[subscriber]

    def _hold(self, session: Session, sub: Subscriber, frame: bytes | bytearray) -> None:
        assert session.held is not None  # (`sub in session.held`: the callers asked)
        frames = session.held[sub]
        frames.append(frame)
        # A hold lasts one group commit; a disk that stalls it while the turn
        # streams on must not make us keep unbounded frames for a client:
        # past the session's retention the events flow without waiting.
        if len(frames) >= self._settings().event_retention:
            self.release(session, (sub,))

    def add_subscribers(self, session: Session, subscribers: set[Subscriber]) -> None:
        """Clients that followed a session's stand-in (a repaired session)."""
        for sub in subscribers:
            self._subscribe(session, sub)

    def write_mark(self, session: Session, durable: bool) -> None:
        """What must survive a daemon restart besides the turns: the seq
        reservation, stopped/failed, restarts and the last exit."""
        last = msgspec.to_builtins(session.last_exit) if session.last_exit else None
        mark = Mark(
            state=session.persisted_state, seq=session.reserved_seq,
            restarts=session.restarts, last_exit=last,
        )
        try:
            session.store.append(mark, durable=durable)
        except StoreError as exc:
            tagged(log, session.id).error("%s", exc)

    # ---------------------------------------------------------------- states

    def set_state(self, session: Session, trigger: Trigger, reason: str = "") -> None:
        old = session.state
        new = transition(old, trigger)
        session.state = new
        self._sessions.relive(session)  # (a live slot: starting, or a worker)
        if (new in AT_REST) != (old in AT_REST):
            # A session without a worker holds no files open (a loaded
            # one starts so); its next write takes them again.
            session.store.at_rest(new in AT_REST)
        self._tracer.state_changed(session.id, old, new, reason, session.trace)
        self.emit(  # (logged there, with the session's fields)
            session,
            m.StateChanged(session=session.id, seq=self.next_seq(session), old=old, new=new, reason=reason),
            why=trigger,
        )
        if new in AT_REST:
            self._rest(session)
        waiters, session.state_waiters = session.state_waiters, None
        for fut in waiters or ():
            if not fut.done():
                fut.set_result(None)

    def _rest(self, session: Session) -> None:
        """At rest, what serves only a live session goes: the lifecycle is
        packed, and a hibernated session's ring is let go of (a stopped or
        failed one keeps its last events for whoever comes to see why)."""
        if not isinstance(session.lifecycle, bytes):
            session.lifecycle = _pack(session.lifecycle)
        if session.state is State.HIBERNATED and session.ring is not None:
            self._drop_ring(session)

    def _drop_ring(self, session: Session) -> None:
        self.retained_bytes -= session.ring_bytes
        session.ring, session.ring_bytes = None, 0
        self._ringed.discard(session)

    async def wait_state(self, session: Session, states: Iterable[State], timeout: float) -> None:
        wanted = set(states)
        deadline = time.monotonic() + timeout
        while session.state not in wanted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Conflict(f"session {session.id} is still {session.state}; try again shortly")
            fut = asyncio.get_running_loop().create_future()
            session.state_waiters = [*(session.state_waiters or ()), fut]
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fut, remaining)

    # ---------------------------------------------------------------- clients

    def oldest_retained(self, session: Session) -> int:
        """The seq of the oldest event a replay can still send."""
        return session.ring[0][0] if session.ring else session.seq + 1

    def attach(self, session: Session, subscriber: Subscriber, from_seq: int | None,
               first: Iterable[m.Event] = ()) -> int:
        """Subscribe; replay retained events from `from_seq`, after `first`
        (older events the client must see all the same: the permission
        requests still waiting, supervisor.core.asks).  Returns next seq."""
        self._subscribe(session, subscriber)
        held = self._unhold(session, subscriber)
        if held and from_seq is None:
            for frame in held:  # (a replay would send them again)
                subscriber.deliver(frame)
        oldest = self.oldest_retained(session)
        # Seqs start at 1: asking from 0 (or below) misses nothing that was ever sent.
        if from_seq is not None and max(from_seq, 1) < oldest:
            subscriber.deliver(self._encoder.encode(m.Gap(session=session.id, seq=oldest, from_seq=from_seq)))
        for event in first:
            subscriber.deliver(self._encoder.encode(event))
        if from_seq is not None:
            for seq, frame in session.ring or ():
                if seq >= from_seq:
                    subscriber.deliver(frame)
        return session.seq + 1

    def detach(self, subscriber: Subscriber, sessions: Iterable[Session] | None = None) -> None:
        """From `sessions`, or (None) from every session it follows."""
        for session in list(self._following.get(subscriber, ())) if sessions is None else sessions:
            self._unsubscribe(session, subscriber)
            self._unhold(session, subscriber)

    # ---------------------------------------------------------------- retention

    def resize(self, session: Session) -> None:
        """After a reload: the ring under the new `event_retention`."""
        if session.ring is None:
            return
        self.retained_bytes -= session.ring_bytes
        session.ring = collections.deque(session.ring, maxlen=self._settings().event_retention)
        session.ring_bytes = sum(len(frame) for _, frame in session.ring)
        self.retained_bytes += session.ring_bytes

    def forget(self, session: Session) -> None:
        self._tracer.forget(session.id)
        self._drop_ring(session)
        for sub in list(session.subscribers or ()):
            self._unsubscribe(session, sub)
        session.held = None

    def trim(self) -> None:
        """Over event_retention_total_bytes (sessions that emitted before
        others grew): every ring down to its share, newest event kept."""
        if self.retained_bytes <= self._settings().event_retention_total_bytes:
            return
        share = self._fair_share()
        for session in list(self._ringed):
            while session.ring_bytes > share and session.ring is not None and len(session.ring) > 1:
                self._drop_oldest(session)

    def _drop_oldest(self, session: Session) -> None:
        assert session.ring is not None
        size = len(session.ring.popleft()[1])
        session.ring_bytes -= size
        self.retained_bytes -= size

    def _fair_share(self) -> int:
        # (shared by the sessions that retain events: not the hibernated ones)
        return self._settings().event_retention_total_bytes // max(len(self._ringed), 1)
