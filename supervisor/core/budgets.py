"""Budgets, the daemon's side: the spend ledger's figures, the check made
as each LLM call begins, and what `status` shows.

Runs in the daemon's loop.  What a session and a uid spent is a ledger
(supervisor.store.spend, kept by the store: `StateStore.spend`), not a
sum over the sessions that exist: removing a session leaves its spend in
its uid's total, and an import starts the session's figure at what its
document says it spent (or `unknown`), never at zero by omission.  This
class keeps a copy of the book, folded as each charge is made, and hands
each charge to the store.

When a call counts: as it begins.  A worker about to make an LLM request
asks first (`m.Spent` with a `request_id`): the ceilings are checked
against the ledger's figures (`ipc.budget.first_reached_at`), the call
is counted, and only once that charge is durable is the worker told to
go (`m.CallCleared`).  A worker killed during the call has paid for it;
its resumed turn replays the calls that were journaled and makes the
killed one again, counted again: what the provider receives never passes
a ceiling.  Tokens are counted as the worker reports them after each
call (`m.Spent`, cumulative), and go to the ledger without a wait.

The running turn's share (`Session.turn_spend`, owned here) is the
ledger's too (`Entry.turn_spent`): a daemon restarted during a turn takes
it back, so the resumed turn's replayed calls are not counted again.

The worker also gets figures with each input (`m.Input.spent`,
`.uid_spent`, and `m.BudgetUpdate` when another session of its uid
spends), for a check that costs no round trip and for handlers that show
them; the check that holds is the one made here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from ipc import messages as m
from ipc.budget import SPEND_KEYS, first_reached_at, spend_of, standings_at, total
from ipc.settings import BudgetSettings
from supervisor.core.session import NO_SPEND, Session
from supervisor.core.recorder import NO_METRICS, Recorder
from supervisor.core.registry import Registry
from supervisor.store.spend import Book, Charge, Entry, SpendBook, fold

__all__ = ["Budgets", "tokens_of", "uid_ceilings"]

log = logging.getLogger("sessiond.manager")


def tokens_of(usage: Mapping[str, int]) -> dict[str, int]:
    """`SessionInfo.usage`: a session's usage without its LLM calls, which
    `budget` shows (the key stays tokens only, as TurnDone.usage)."""
    return {k: v for k, v in usage.items() if k != "llm_calls"}


def uid_ceilings(budget: BudgetSettings) -> bool:
    """Whether any per-uid ceiling is set (else nobody needs the uid's total)."""
    return any(getattr(budget, f"uid_max_{key}") is not None
               for key in ("llm_calls", "input_tokens", "output_tokens", "reasoning_tokens"))


def _less(whole: Mapping[str, int], part: Mapping[str, int]) -> dict[str, int]:
    return {k: v - part.get(k, 0) for k, v in whole.items() if v > part.get(k, 0)}


class _Volatile:
    """A book kept nowhere (a ledger built without a store: tests of the
    ledger alone)."""

    def read(self) -> Book:
        return Book()

    def write(self, charges: list[Charge]) -> asyncio.Future[Book | None]:
        fut: asyncio.Future[Book | None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    def close(self) -> None:
        pass


class Budgets:
    def __init__(self, sessions: Registry, book: SpendBook | None = None,
                 metrics: Recorder = NO_METRICS) -> None:
        self._sessions = sessions
        self._metrics = metrics
        self._store: SpendBook = book if book is not None else _Volatile()
        # The book as charged so far (durable or on its way); read at start.
        self._book = self._store.read()
        self._seeded = False
        self._seeds: list[Charge] = []

    # ---------------------------------------------------------------- figures

    def _entry(self, session: Session) -> Entry:
        """The session's entry; one the book never saw (a session from
        before the ledger, or a new one) opens with its logs' figures,
        which its uid is charged too.  A session that has spent nothing
        has none until it spends (its first charge makes it): a daemon
        holding many such sessions, or listing them, keeps nothing of them."""
        entry = self._book.sessions.get(session.id)
        if entry is None:
            add = {k: v for k in SPEND_KEYS if (v := session.usage.get(k, 0))}
            if not add:
                return Entry()  # (not kept: opening it with nothing would change no figure)
            seed = Charge(session=session.id, uid=session.meta.owner_uid, opens=True, uid_too=True, add=add)
            fold(self._book, seed)
            # Written ahead of the next charge, not on its own: one from a
            # restart that came first is made again, the same, from the logs.
            self._seeds.append(seed)
            entry = self._book.sessions[session.id]
        return entry

    def _uid_total(self, uid: int) -> dict[str, int]:
        if not self._seeded:  # (once: the sessions loaded at start, into their uids' totals)
            self._seeded = True
            for session in list(self._sessions.values()):
                self._entry(session)
        return self._book.uids.get(uid, {})

    def spent(self, session: Session) -> dict[str, int]:
        """The session's spend: its turns, and the running one so far."""
        return self._entry(session).spent

    def uid_spent(self, uid: int) -> dict[str, int]:
        """What every session `uid` ever had spent (removed ones included)."""
        return self._uid_total(uid)

    def for_input(self, session: Session) -> tuple[dict[str, int], dict[str, int]]:
        """`m.Input.spent` and `.uid_spent` for the turn about to start (or
        resumed): the session's spend less the turn's share, and the uid's
        less the session's."""
        self._take_turn(session)
        own = self.spent(session)
        before = _less(own, session.turn_spend)
        if not uid_ceilings(session.settings.agent.budget):
            return before, {}
        return before, _less(self._uid_total(session.meta.owner_uid), own)

    def figures(self, session: Session) -> dict[str, Any]:
        """`SessionInfo.budget`."""
        budget = session.settings.agent.budget
        entry = self._entry(session)
        with_uid = uid_ceilings(budget)
        uid = self._uid_total(session.meta.owner_uid) if with_uid else {}
        out: dict[str, Any] = {
            "spent": spend_of(entry.spent),
            "turn": spend_of(session.turn_spend) if session.current_turn is not None else {},
            "ceilings": [s.as_json() for s in standings_at(budget, session.turn_spend, entry.spent, uid,
                                                           entry.unknown)],
        }
        if with_uid:
            out["uid_spent"] = spend_of(uid)
        if entry.unknown:
            out["unknown_before_import"] = True
        return out

    # ---------------------------------------------------------------- the running turn

    def reported(self, session: Session, msg: m.Spent) -> None:
        """The running turn's worker: a call about to begin (`request_id`),
        or its spend so far, after a call."""
        if msg.request_id:
            self._call_begins(session, msg)
            return
        if msg.turn != session.current_turn or session.committing == msg.turn:
            return
        self._take_turn(session)
        before = session.turn_spend
        # Cumulative: a figure only grows (a resumed turn's replay repeats them).
        reported = {k: v for k, v in msg.spend.items() if k in SPEND_KEYS and isinstance(v, int) and v > 0}
        session.turn_spend = {k: v for k in SPEND_KEYS if (v := max(reported.get(k, 0), before.get(k, 0)))}
        self._moved(session, before)

    def _call_begins(self, session: Session, msg: m.Spent) -> None:
        worker = session.worker
        if worker is None:
            return
        if msg.turn != session.current_turn or session.committing == msg.turn:
            worker.conn.send(m.CallCleared(request_id=msg.request_id, error="not the running turn"))
            return
        self._take_turn(session)
        entry = self._entry(session)
        reached = first_reached_at(session.settings.agent.budget, session.turn_spend, entry.spent,
                                   self._uid_total(session.meta.owner_uid), entry.unknown)
        if reached is not None:
            worker.conn.send(m.CallCleared(request_id=msg.request_id, ceiling=reached.ceiling, used=reached.used,
                                           limit=reached.limit, unit=reached.unit, unknown=reached.unknown))
            return
        before = session.turn_spend
        session.turn_spend = total(before, {"llm_calls": 1})
        written = self._moved(session, before)

        def answer(fut: asyncio.Future[Book | None]) -> None:
            if session.worker is not worker:
                return  # (it died meanwhile: the call is counted, never made)
            exc = None if fut.cancelled() else fut.exception()
            worker.conn.send(m.CallCleared(request_id=msg.request_id, error=str(exc) if exc else ""))
            worker.conn.flush()

        written.add_done_callback(answer)

    def _take_turn(self, session: Session) -> None:
        """A turn the ledger saw begin before this daemon started (it died
        during it): its share so far, from the ledger."""
        if not session.turn_spend and session.current_turn is not None:
            entry = self._book.sessions.get(session.id)
            if entry is not None and entry.turn == session.current_turn and entry.turn_spent:
                session.turn_spend = dict(entry.turn_spent)

    def turn_over(self, session: Session) -> None:
        session.turn_spend = NO_SPEND

    def _moved(self, session: Session, before: Mapping[str, int]) -> asyncio.Future[Book | None]:
        """The running turn's spend grew from `before`: charge the ledger,
        and tell the uid's other running turns, whose uid ceilings it moves."""
        delta = _less(session.turn_spend, before)
        if not delta:
            done: asyncio.Future[Book | None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        written = self._write(Charge(session=session.id, uid=session.meta.owner_uid, add=delta,
                                     turn=session.current_turn or 0))
        self._metrics.llm_spent(delta)
        if not uid_ceilings(session.settings.agent.budget):
            return written  # (the uid ceilings are the operator's alone: its peers have none either)
        uid = session.meta.owner_uid
        for peer in list(self._sessions.live):  # (a running turn's session is live)
            if peer.meta.owner_uid == uid and peer is not session and peer.current_turn is not None \
                    and peer.worker is not None:
                peer.worker.conn.send(m.BudgetUpdate(
                    turn=peer.current_turn, uid_spent=_less(self._uid_total(uid), self.spent(peer))))
        return written

    # ---------------------------------------------------------------- sessions coming and going

    def imported(self, session_id: str, uid: int,
                 figures: Mapping[str, int] | None) -> asyncio.Future[Book | None]:
        """An imported session's entry: what its document says it spent, or
        `unknown` (None).  Its uid is not charged: that spend was made
        elsewhere, or is in the uid's total already.  Any entry the id had
        goes first (the id is free: a stale one is not this session's)."""
        add = {k: v for k, v in (figures or {}).items() if k in SPEND_KEYS and v > 0}
        charges = [Charge(session=session_id, drop=True),
                   Charge(session=session_id, uid=uid, add=add, opens=True, unknown=figures is None)]
        for charge in charges:
            fold(self._book, charge)
        charges, self._seeds = [*self._seeds, *charges], []
        written = self._store.write(charges)
        written.add_done_callback(self._written)
        return written

    def restored(self, session: Session) -> None:
        """A stored session came in after the uids' totals were seeded (the
        start-up load runs while turns do): one the book never saw is
        seeded now, as it would have been then."""
        if self._seeded:
            self._entry(session)

    def forget(self, session_id: str) -> None:
        """The session is removed: its entry goes; its uid's total keeps it."""
        self._write(Charge(session=session_id, drop=True))

    def _write(self, charge: Charge) -> asyncio.Future[Book | None]:
        fold(self._book, charge)
        written = self._store.write([*self._seeds, charge])
        self._seeds = []
        written.add_done_callback(self._written)
        return written

    def _written(self, fut: asyncio.Future[Book | None]) -> None:
        if fut.cancelled():
            return
        if (exc := fut.exception()) is not None:
            log.error("the spend ledger could not be written: %s (the daemon's figures keep the charge; "
                      "a restart would not)", exc)
            return
        # Daemons sharing the store: what the others charged these uids too.
        # The larger figure of each (ours may hold charges still on their way).
        fresh = fut.result()
        for uid, spent in (fresh.uids.items() if fresh is not None else ()):
            mine = self._book.uids.setdefault(uid, {})
            for key, value in spent.items():
                mine[key] = max(mine.get(key, 0), value)
