"""The console's connections, bounded before anyone is known (runs in the
`sessionctl web` process, on its loop).

Any local user can connect to 127.0.0.1:PORT; the guard (guard.py) sees a
request only once its head (request line and headers) has arrived, and
uvicorn waits for a head with no deadline: a user without the token could
hold as many connections as it opens, each sending a byte now and then
(1,008 were held in an audit).  So the HTTP protocol uvicorn runs here is
its own h11 one with two bounds on a connection whose head is not in yet:

- a deadline (`HEAD_TIMEOUT_SECS` from the connection, or from the first
  byte of the next request on a kept-alive one): past it the connection
  is closed;
- a cap on how many such connections there are at once
  (`MAX_WAITING_HEADS`): one more closes the one that has waited longest,
  so a flood cannot keep the user's own browser out for long.

A request the guard refuses is answered with `Connection: close` (app.py),
so an unknown client holds nothing once its head is in.  The browser's
own connections have their heads in at once and are not touched.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HEAD_TIMEOUT_SECS", "MAX_WAITING_HEADS", "bounded_h11"]

HEAD_TIMEOUT_SECS = 10.0
MAX_WAITING_HEADS = 32


def bounded_h11(head_timeout_secs: float = HEAD_TIMEOUT_SECS,
                max_waiting: int = MAX_WAITING_HEADS) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the bounds above, as a class for
    `uvicorn.Config(http=...)`; each class counts its own connections."""
    # Insertion-ordered: the first is the one that has waited longest.
    waiting: dict[Bounded, None] = {}

    class Bounded(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._await_head()
            while len(waiting) > max_waiting:
                next(iter(waiting))._give_up()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._head_in()
            elif self._head_timer is None and not self.transport.is_closing():
                self._await_head()  # (the next request's head, on a kept-alive connection)

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_in()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            waiting[self] = None
            self._head_timer = self.loop.call_later(head_timeout_secs, self._give_up)

        def _head_in(self) -> None:
            waiting.pop(self, None)
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _give_up(self) -> None:
            self._head_in()
            self.transport.close()

    return Bounded
