"""Budgets: what counts against which ceiling of `[agent.budget]`.

Pure, and shared: the worker's agent loop asks `first_reached` before each
LLM call (session_worker/agent/_budget.py), the daemon reports the same
`standings` in `status --json` and `top` (supervisor/core/budgets.py), so
the figure a user sees is the figure the check used.

Spend is a dict in the usage's own names (`prompt_tokens`,
`completion_tokens`, `reasoning_tokens`, as `TurnDone.usage`) plus
`llm_calls`; a missing key counts 0.  Three spends meet:

    turn        the running turn's calls so far (a resumed turn's replayed
                calls included: its count never starts again)
    session     the session's turns before this one, as the daemon has them
                durably (committed, failed and crashed turns alike)
    uid_others  every other session of the same owner uid: their turns and
                their running turns' calls so far, as the daemon last saw them

That is how a worker sees them (`first_reached`, with the figures its turn
was handed).  The daemon, which counts each call as it begins in its spend
ledger (supervisor.store.spend), holds the totals themselves: the
session's, the running turn's included, and its uid's, every session it
ever had included (`first_reached_at`); and it may not know what an
imported session spent before (`unknown`): then each `session_` ceiling
set counts as reached.

A ceiling is reached when what counts against it is at or above it: the
next call is not made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ipc.settings import BudgetSettings

__all__ = ["MEASURES", "SPEND_KEYS", "Standing", "first_reached", "first_reached_at", "spend_of", "standings",
           "standings_at", "total"]

# (measure in the ceiling's name, key in a spend dict, unit), in the order
# the ceilings are checked and shown.
MEASURES: tuple[tuple[str, str, str], ...] = (
    ("llm_calls", "llm_calls", "LLM calls"),
    ("input_tokens", "prompt_tokens", "tokens"),
    ("output_tokens", "completion_tokens", "tokens"),
    ("reasoning_tokens", "reasoning_tokens", "tokens"),
)
SPEND_KEYS = tuple(key for _, key, _ in MEASURES)
_SCOPES = ("turn", "session", "uid")
_PREFIX = "agent.budget."


@dataclass(frozen=True, slots=True)
class Standing:
    """One ceiling that is set, and what counts against it now."""

    ceiling: str  # the config key: "agent.budget.session_max_output_tokens"
    used: int
    limit: int
    unit: str  # "tokens" or "LLM calls"
    # A session ceiling of a session imported without its figures: what
    # it spent before is not known, so the ceiling counts as reached.
    unknown: bool = False

    @property
    def reached(self) -> bool:
        return self.unknown or self.used >= self.limit

    def describe(self) -> str:
        if self.unknown:
            return (f"{self.ceiling} = {self.limit} {self.unit}: {self.used} {self.unit} spent since an "
                    "import whose document did not say what the session spent before")
        return f"{self.ceiling} = {self.limit} {self.unit}: {self.used} {self.unit} spent"

    def as_json(self) -> dict[str, int | str | bool]:
        out: dict[str, int | str | bool] = {"ceiling": self.ceiling, "used": self.used, "limit": self.limit,
                                            "unit": self.unit}
        if self.unknown:
            out["unknown"] = True
        return out


def total(*spends: Mapping[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for spend in spends:
        for key, value in spend.items():
            out[key] = out.get(key, 0) + value
    return out


def spend_of(spend: Mapping[str, int]) -> dict[str, int]:
    """A spend shown by measure ("input_tokens": ...), every measure present."""
    return {measure: spend.get(key, 0) for measure, key, _ in MEASURES}


def standings(budget: BudgetSettings, turn: Mapping[str, int], session: Mapping[str, int],
              uid_others: Mapping[str, int]) -> list[Standing]:
    """Every ceiling `budget` sets, against the spends above."""
    return standings_at(budget, turn, total(session, turn), total(uid_others, session, turn))


def standings_at(budget: BudgetSettings, turn: Mapping[str, int], session: Mapping[str, int],
                 uid: Mapping[str, int], unknown: bool = False) -> list[Standing]:
    """Every ceiling `budget` sets, against the totals of each scope (the
    daemon's: `session` and `uid` include the running turn)."""
    spent = {"turn": turn, "session": session, "uid": uid}
    out = []
    for scope in _SCOPES:
        for measure, key, unit in MEASURES:
            limit = getattr(budget, f"{scope}_max_{measure}", None)
            if limit is not None:
                out.append(Standing(f"{_PREFIX}{scope}_max_{measure}", spent[scope].get(key, 0), limit, unit,
                                    unknown and scope == "session"))
    return out


def first_reached(budget: BudgetSettings, turn: Mapping[str, int], session: Mapping[str, int],
                  uid_others: Mapping[str, int]) -> Standing | None:
    """The first ceiling reached (turn, then session, then uid), or None:
    the next LLM call may be made."""
    return next((s for s in standings(budget, turn, session, uid_others) if s.reached), None)


def first_reached_at(budget: BudgetSettings, turn: Mapping[str, int], session: Mapping[str, int],
                     uid: Mapping[str, int], unknown: bool = False) -> Standing | None:
    """`first_reached` against the daemon's totals (`standings_at`)."""
    return next((s for s in standings_at(budget, turn, session, uid, unknown) if s.reached), None)
