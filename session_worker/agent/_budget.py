"""The budget check before each LLM call of an agent turn.

Runs in the worker, inside the turn's task.  `TurnSpend` is the running
turn's count (tokens as the provider reported them, and LLM calls,
compaction summaries included); `begin_call` is awaited where the loop
sends an LLM request (the turn's calls and compaction's summaries), right
before it.  It checks twice: first against the figures the daemon handed
the turn (`TurnContext.budget_spent`: the session's turns before this
one, and the other sessions of the uid), which costs nothing; then the
daemon's own word (`TurnContext.begin_llm_call`): it checks its spend
ledger, which no export, import or `rm` lowers, and counts the call there
durably before answering, so the request goes out only once it is paid
for and a worker killed during the call cannot push what the provider
receives past a ceiling.  What counts against which ceiling is
`ipc.budget`'s, shared with the daemon's `status`.

A turn resumed after its worker died starts its `TurnSpend` from the
usage its replayed LLM steps carry (`TurnSpend.add` per replayed step, as
per live call), so it is never counted from zero again, and the daemon's
figure for the session does not include the running turn: nothing is
counted twice and nothing is forgotten.
"""

from __future__ import annotations

from session_worker.agent._errors import BudgetReached
from session_worker.handler import TurnContext
from ipc.budget import first_reached
from ipc.settings import BudgetSettings

__all__ = ["TurnSpend", "begin_call", "check", "stop_note"]


class TurnSpend:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, usage: dict[str, int]) -> None:
        """One LLM call made, with the tokens the provider reported for it."""
        for key, value in usage.items():
            self.counts[key] = self.counts.get(key, 0) + value
        self.counts["llm_calls"] = self.counts.get("llm_calls", 0) + 1

    def tokens(self) -> dict[str, int]:
        """As TurnResult.usage (tokens only)."""
        return {k: v for k, v in self.counts.items() if k != "llm_calls"}


def check(budget: BudgetSettings, ctx: TurnContext, spend: TurnSpend) -> None:
    """Raise BudgetReached when a ceiling leaves no room for another call."""
    session, uid_others = ctx.budget_spent()
    reached = first_reached(budget, spend.counts, session, uid_others)
    if reached is not None:
        raise BudgetReached(reached.ceiling, reached.used, reached.limit, reached.unit)


async def begin_call(budget: BudgetSettings, ctx: TurnContext, spend: TurnSpend) -> None:
    """Raise BudgetReached unless the call may be made, and counted, now."""
    check(budget, ctx, spend)
    reached = await ctx.begin_llm_call()
    if reached is not None:
        raise BudgetReached(reached.ceiling, reached.used, reached.limit, reached.unit, reached.unknown)


def stop_note(exc: BudgetReached) -> str:
    """What the user and, in the history, the model read."""
    scope = exc.ceiling.rpartition(".")[2].partition("_")[0]
    then = {
        "turn": "Send another message to continue.",
        "session": "This session makes no further LLM call.",
        "uid": "No session of this user makes a further LLM call.",
    }.get(scope, "")
    if exc.unknown:
        return (f"[Stopped: the budget {exc.ceiling} = {exc.limit} {exc.unit} cannot be checked: this "
                f"session was imported from a document that did not say what it spent. {then}]")
    return (f"[Stopped: the budget {exc.ceiling} = {exc.limit} {exc.unit} is reached ({exc.used} "
            f"{exc.unit} spent). {then}]")
