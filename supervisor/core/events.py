"""A session's observable history: its states, its event numbers, what is
retained for clients that attach later, and the fan-out to attached clients.

Runs in the daemon's loop.  Every state change is an event (`StateChanged`),
so the state machine is applied here and nowhere else.  Seq numbers are
reserved in blocks and the reservation persisted (a `Mark` record) before a
number of the block is handed out, so a daemon killed mid-turn never hands
out a seq a client has already seen.  Retention is bounded per session
(`event_retention`, `event_retention_bytes`) and for all sessions together
(`event_retention_total_bytes`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping

import msgspec

from ipc import messages as m
from ipc.contract import LimitKind
from ipc.framing import FrameEncoder
from supervisor.config import DaemonSettings
from supervisor.errors import Conflict
from supervisor.ops.logtag import tagged
from supervisor.ops.tracing import NO_TRACER, Tracer
from supervisor.core.session import Session, Subscriber
from supervisor.core.states import State, Trigger, transition
from supervisor.store.state_store import Mark, StoreError

__all__ = ["EventLog"]

log = logging.getLogger("sessiond.manager")

_SEQ_BLOCK = 4096


class EventLog:
    def __init__(
        self, settings: Callable[[], DaemonSettings], sessions: Mapping[str, Session],
        tracer: Tracer = NO_TRACER,
    ) -> None:
        self._settings = settings
        self._sessions = sessions
        # Told every transition: a restart's span, a worker boot's.
        self._tracer = tracer
        self._encoder = FrameEncoder()
        self.retained_bytes = 0  # all sessions' rings together

    # ---------------------------------------------------------------- events

    def emit(self, session: Session, event: m.Event) -> None:
        if isinstance(event, (m.StateChanged, m.LimitExceeded, m.TurnFailed)):
            session.lifecycle.append((time.time(), event))  # `sessionctl logs`
        frame = self._encoder.encode(event)
        ring = session.ring
        if len(ring) == ring.maxlen:
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
        for sub in list(session.subscribers):
            sub.deliver(frame)

    def emit_live(self, session: Session, event: m.ReasoningDelta) -> None:
        """An event of NEW_EVENT_TAGS: to the subscribers that asked for its
        tag, not retained (see `ReasoningDelta`)."""
        tag = type(event).__struct_config__.tag
        frame: bytes | bytearray | None = None
        for sub in list(session.subscribers):
            if tag in sub.event_tags:
                frame = frame or self._encoder.encode(event)
                sub.deliver(frame)

    def emit_limit(self, session: Session, kind: LimitKind, value: float, limit: float) -> None:
        self.emit(
            session,
            m.LimitExceeded(session=session.id, seq=self.next_seq(session), kind=kind,
                            value=round(value, 3), limit=limit),
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

    def subscribe(self, session: Session, subscriber: Subscriber) -> None:
        session.subscribers.add(subscriber)

    def add_subscribers(self, session: Session, subscribers: set[Subscriber]) -> None:
        """Clients that followed a session's stand-in (a repaired session)."""
        session.subscribers |= subscribers

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
        self._tracer.state_changed(session.id, old, new, reason, session.trace)
        # A failed session needs an operator: say so where they look.
        level = logging.WARNING if new is State.FAILED else logging.DEBUG
        tagged(log, session.id).log(level, "%s -> %s (%s)", old, new, reason or trigger)
        self.emit(
            session,
            m.StateChanged(session=session.id, seq=self.next_seq(session), old=old, new=new, reason=reason),
        )
        waiters, session.state_waiters = session.state_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_state(self, session: Session, states: Iterable[State], timeout: float) -> None:
        wanted = set(states)
        deadline = time.monotonic() + timeout
        while session.state not in wanted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Conflict(f"session {session.id} is still {session.state}; try again shortly")
            fut = asyncio.get_running_loop().create_future()
            session.state_waiters.append(fut)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fut, remaining)

    # ---------------------------------------------------------------- clients

    def attach(self, session: Session, subscriber: Subscriber, from_seq: int | None) -> int:
        """Subscribe; replay retained events from `from_seq`.  Returns next seq."""
        session.subscribers.add(subscriber)
        if from_seq is not None:
            oldest = session.ring[0][0] if session.ring else session.seq + 1
            if from_seq < oldest:
                subscriber.deliver(
                    self._encoder.encode(m.Gap(session=session.id, seq=oldest, from_seq=from_seq))
                )
            for seq, frame in session.ring:
                if seq >= from_seq:
                    subscriber.deliver(frame)
        return session.seq + 1

    def detach(self, subscriber: Subscriber, sessions: Iterable[Session]) -> None:
        for session in sessions:
            session.subscribers.discard(subscriber)

    # ---------------------------------------------------------------- retention

    def new_ring(self) -> collections.deque[tuple[int, bytes | bytearray]]:
        return collections.deque(maxlen=self._settings().event_retention)

    def resize(self, session: Session) -> None:
        """After a reload: the ring under the new `event_retention`."""
        self.retained_bytes -= session.ring_bytes
        session.ring = collections.deque(session.ring, maxlen=self._settings().event_retention)
        session.ring_bytes = sum(len(frame) for _, frame in session.ring)
        self.retained_bytes += session.ring_bytes

    def forget(self, session: Session) -> None:
        self._tracer.forget(session.id)
        self.retained_bytes -= session.ring_bytes
        session.ring.clear()
        session.ring_bytes = 0
        session.subscribers.clear()

    def trim(self) -> None:
        """Over event_retention_total_bytes (sessions that emitted before
        others grew): every ring down to its share, newest event kept."""
        if self.retained_bytes <= self._settings().event_retention_total_bytes:
            return
        share = self._fair_share()
        for session in self._sessions.values():
            while session.ring_bytes > share and len(session.ring) > 1:
                self._drop_oldest(session)

    def _drop_oldest(self, session: Session) -> None:
        size = len(session.ring.popleft()[1])
        session.ring_bytes -= size
        self.retained_bytes -= size

    def _fair_share(self) -> int:
        return self._settings().event_retention_total_bytes // max(len(self._sessions), 1)
