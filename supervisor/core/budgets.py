"""Budgets, the daemon's side: what it tells a worker its turn may spend,
what it shows, and the per-uid ceilings no single worker can see.

Runs in the daemon's loop.  The check itself is the worker's, before each
LLM call (session_worker/agent/_budget.py), against figures this module
hands it with the turn (`m.Input.spent`, `.uid_spent`): the session's spend
as the daemon holds it durably (its committed turns, and the failed and
crashed ones whose `Abort` records carry what they spent), and, for a uid
ceiling, the other sessions of its uid.  Sessions of one uid run
concurrently, so while a turn runs the others' spend moves: each `m.Spent`
a worker reports is counted at once, and the uid's other running turns are
sent the new total (`m.BudgetUpdate`) for their next check.  The rules of
what counts against which ceiling are `ipc.budget`'s, shared with the
worker, so `status` shows the very figures the check used.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from ipc import messages as m
from ipc.budget import SPEND_KEYS, spend_of, standings, total
from ipc.settings import BudgetSettings
from supervisor.core.session import Session
from supervisor.ops.metrics import NO_METRICS, Recorder

__all__ = ["Budgets", "tokens_of", "uid_ceilings"]


def tokens_of(usage: Mapping[str, int]) -> dict[str, int]:
    """`SessionInfo.usage`: a session's usage without its LLM calls, which
    `budget` shows (the key stays tokens only, as TurnDone.usage)."""
    return {k: v for k, v in usage.items() if k != "llm_calls"}


def uid_ceilings(budget: BudgetSettings) -> bool:
    """Whether any per-uid ceiling is set (else nobody needs the uid's total)."""
    return any(getattr(budget, f"uid_max_{key}") is not None
               for key in ("llm_calls", "input_tokens", "output_tokens", "reasoning_tokens"))


class Budgets:
    def __init__(self, sessions: Mapping[str, Session], metrics: Recorder = NO_METRICS) -> None:
        self._sessions = sessions
        self._metrics = metrics
        # The uid's totals, for the length of one pass of the loop: `ls`
        # asks for every session's figures at once, which would otherwise
        # sum the uid's sessions once per session.
        self._memo: dict[int, dict[str, int]] = {}

    @staticmethod
    def spent(session: Session) -> dict[str, int]:
        """The session's spend: its turns, and the running one so far."""
        return total({k: session.usage.get(k, 0) for k in SPEND_KEYS}, session.turn_spend)

    def uid_spent(self, uid: int, but: Session | None = None, *, shown: bool = False) -> dict[str, int]:
        """Every session of `uid` together (less `but`'s own).  `shown`:
        for display, where a total from earlier in this pass will do."""
        whole = self._memo.get(uid) if shown else None
        if whole is None:
            whole = total(*(self.spent(s) for s in self._sessions.values() if s.meta.owner_uid == uid))
            if shown and self._memo_until_next_pass():
                self._memo[uid] = whole
        own = self.spent(but) if but is not None else {}
        return {k: v - own.get(k, 0) for k, v in whole.items()}

    def _memo_until_next_pass(self) -> bool:
        if not self._memo:
            try:
                asyncio.get_running_loop().call_soon(self._memo.clear)
            except RuntimeError:
                return False  # no loop (a test's direct call): no memo, always fresh
        return True

    def for_input(self, session: Session) -> tuple[dict[str, int], dict[str, int]]:
        """`m.Input.spent` and `.uid_spent` for the turn about to start."""
        before = {k: v for k in SPEND_KEYS if (v := session.usage.get(k, 0))}
        if not uid_ceilings(session.settings.agent.budget):
            return before, {}
        return before, self.uid_spent(session.meta.owner_uid, but=session)

    def spend_moved(self, session: Session, before: Mapping[str, int]) -> None:
        """The running turn of `session` reported more spend (its
        `turn_spend` was `before`): count it, and tell the uid's other
        running turns, whose uid ceilings it moves."""
        delta = {k: v - before.get(k, 0) for k, v in session.turn_spend.items() if v > before.get(k, 0)}
        if delta:
            self._metrics.llm_spent(delta)
        if not uid_ceilings(session.settings.agent.budget):
            return  # (the uid ceilings are the operator's alone: its peers have none either)
        uid = session.meta.owner_uid
        peers = [s for s in self._sessions.values()
                 if s.meta.owner_uid == uid and s is not session and s.current_turn is not None
                 and s.worker is not None]
        for peer in peers:
            assert peer.current_turn is not None and peer.worker is not None
            peer.worker.conn.send(m.BudgetUpdate(turn=peer.current_turn,
                                                 uid_spent=self.uid_spent(uid, but=peer)))

    def figures(self, session: Session) -> dict[str, Any]:
        """`SessionInfo.budget`."""
        budget = session.settings.agent.budget
        before = {k: session.usage.get(k, 0) for k in SPEND_KEYS}
        with_uid = uid_ceilings(budget)
        others = self.uid_spent(session.meta.owner_uid, but=session, shown=True) if with_uid else {}
        out: dict[str, Any] = {
            "spent": spend_of(self.spent(session)),
            "turn": spend_of(session.turn_spend) if session.current_turn is not None else {},
            "ceilings": [s.as_json() for s in standings(budget, session.turn_spend, before, others)],
        }
        if with_uid:
            out["uid_spent"] = spend_of(total(others, self.spent(session)))
        return out
