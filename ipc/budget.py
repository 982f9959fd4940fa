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

A ceiling is reached when what counts against it is at or above it: the
next call is not made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ipc.settings import BudgetSettings

__all__ = ["MEASURES", "SPEND_KEYS", "Standing", "first_reached", "spend_of", "standings", "total"]

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

    @property
    def reached(self) -> bool:
        return self.used >= self.limit

    def describe(self) -> str:
        return f"{self.ceiling} = {self.limit} {self.unit}: {self.used} {self.unit} spent"

    def as_json(self) -> dict[str, int | str]:
        return {"ceiling": self.ceiling, "used": self.used, "limit": self.limit, "unit": self.unit}


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
    spent = {
        "turn": turn,
        "session": total(session, turn),
        "uid": total(uid_others, session, turn),
    }
    out = []
    for scope in _SCOPES:
        for measure, key, unit in MEASURES:
            limit = getattr(budget, f"{scope}_max_{measure}", None)
            if limit is not None:
                out.append(Standing(f"{_PREFIX}{scope}_max_{measure}", spent[scope].get(key, 0), limit, unit))
    return out


def first_reached(budget: BudgetSettings, turn: Mapping[str, int], session: Mapping[str, int],
                  uid_others: Mapping[str, int]) -> Standing | None:
    """The first ceiling reached (turn, then session, then uid), or None:
    the next LLM call may be made."""
    return next((s for s in standings(budget, turn, session, uid_others) if s.reached), None)
