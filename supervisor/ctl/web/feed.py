"""What the console's page is told, as JSON-ready dicts (runs in the
`sessionctl web` process, on its event loop).

Two feeds, each a coroutine that calls `emit` with one dict at a time for as
long as the page listens, over a daemon connection of its own:

- `session_list`: the user's sessions (what `sessionctl ls` shows), sent
  again whenever a poll finds them changed.  The control protocol has no
  event for "a session was created", so the list is polled (LIST_POLL_SECS:
  a new session shows within a second; one short request a poll, and only
  while a page is open).
- `session_view`: one session's conversation: a snapshot (its stored
  history, and its kept lifecycle events: restarts, limit hits) and then
  its live events (each piece of a reply as it streams, tool calls and
  results, permission requests, state changes).

Both outlive the daemon: when the connection drops (the daemon restarted,
or this console fell behind and was cut off) they say so
(`{"type": "daemon", "up": false}`), reconnect with backoff, say that too,
and start again from a fresh snapshot, so the page never shows a hole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from ipc import messages as m
from supervisor.ctl.client import AsyncClient
from supervisor.ctl.errors import DaemonUnavailable, RequestError

__all__ = ["Connect", "Emit", "LIST_POLL_SECS", "event_dict", "plain", "session_list", "session_view"]

Emit = Callable[[dict[str, Any]], None]
Connect = Callable[[], Awaitable[AsyncClient]]

LIST_POLL_SECS = 0.25
RECONNECT_FIRST_SECS = 0.1
RECONNECT_MAX_SECS = 2.0
# Turns of stored history a view starts with; older ones are counted, not sent.
HISTORY_TURNS = 50


def plain(obj: Any) -> Any:
    """A Struct as a dict with every field (the wire leaves defaults out;
    the page should not have to know them)."""
    if isinstance(obj, msgspec.Struct):
        return {f: plain(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, list):
        return [plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def event_dict(ev: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"type": type(ev).__struct_config__.tag}
    data.update(plain(ev))
    return data


class _Link:
    """One feed's daemon connection: connect with backoff, and say when it
    goes down and comes back (once each, not once a retry)."""

    def __init__(self, connect: Connect, emit: Emit) -> None:
        self._connect = connect
        self._emit = emit
        self._down = False
        self._delay = RECONNECT_FIRST_SECS

    async def up(self) -> AsyncClient:
        while True:
            try:
                client = await self._connect()
            except (DaemonUnavailable, RequestError) as exc:
                self.lost(str(exc))
                await asyncio.sleep(self._delay)
                self._delay = min(self._delay * 2, RECONNECT_MAX_SECS)
                continue
            self._emit({"type": "daemon", "up": True, "reconnected": self._down,
                        "pid": client.server_pid, "version": client.server_version})
            self._down = False
            self._delay = RECONNECT_FIRST_SECS
            return client

    def lost(self, why: str) -> None:
        if not self._down:
            self._down = True
            self._emit({"type": "daemon", "up": False, "message": why})


async def session_list(connect: Connect, emit: Emit, poll_secs: float = LIST_POLL_SECS) -> None:
    link = _Link(connect, emit)
    while True:
        client = await link.up()
        last: Any = None
        try:
            while True:
                # Not the sandbox report: the page has no use for it, and
                # the list is sent again at every change of any figure.
                sessions = [{k: v for k, v in plain(s).items() if k != "sandbox"}
                            for s in await client.list()]
                if sessions != last:
                    emit({"type": "sessions", "sessions": sessions})
                    last = sessions
                await asyncio.sleep(poll_secs)
        except (DaemonUnavailable, RequestError) as exc:
            link.lost(str(exc))
        finally:
            await client.close()


async def session_view(connect: Connect, session: str, emit: Emit) -> None:
    """Until the session is deleted, or the daemon refuses to show it."""
    link = _Link(connect, emit)
    while True:
        client = await link.up()
        try:
            if await _follow(client, session, emit):
                return
            link.lost("connection to sessiond lost")
        except RequestError as exc:
            # The daemon answered: no use asking again (a session it cannot
            # show, such as a damaged one, says why and stays so).
            emit({"type": "gone" if exc.code == "not_found" else "error", "message": exc.message})
            return
        except DaemonUnavailable as exc:
            link.lost(str(exc))
        finally:
            await client.close()
        await asyncio.sleep(RECONNECT_FIRST_SECS)


async def _follow(client: AsyncClient, session: str, emit: Emit) -> bool:
    """The snapshot, then the live events.  True once the session is
    deleted; False when the connection ended first."""
    # Kept lifecycle events first, then the turns: a turn that ends between
    # the two reads is in the history as ended, and its replayed events are
    # skipped below as those of an ended turn.
    logs = await client.logs(session)
    history = await client.history(session, HISTORY_TURNS)
    ended = [t.turn for t in history.turns if t.outcome != "open"]
    last_ended = max([*ended, history.earlier_turns])
    told = plain(history)
    for turn, stored in zip(told["turns"], history.turns):
        turn["events"] = [event_dict(e) for e in stored.events]  # (tagged, as live events are)
    emit({"type": "snapshot", "session": session, "history": told,
          "logs": [{"at": e.at, "event": event_dict(e.event)} for e in logs.entries],
          "last_exit": plain(logs.last_exit)})
    # From 0: what the daemon still keeps of the open turn (the reply so far,
    # its tool calls, a permission request waiting for an answer), then live.
    async for ev in client.attach(session, from_seq=0):
        if isinstance(ev, m.Gap):
            continue  # older than the ring: the history above has it
        turn = getattr(ev, "turn", None)
        if turn is not None and turn <= last_ended:
            continue  # an ended turn: in the history
        if isinstance(ev, (m.StateChanged, m.LimitExceeded)) and ev.seq < logs.next_seq:
            continue  # in the logs
        emit(event_dict(ev))
        if isinstance(ev, m.StateChanged) and ev.new == "deleted":
            return True
    return False
