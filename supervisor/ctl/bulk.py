"""Selecting sessions by what they are: `ls --state S --owner UID
--handler H --sort KEY`, and `stop|restart|rm|interrupt --all | --state S
| --owner UID | --handler H [--dry-run]`.

Runs in the sessionctl process.  The selection is made here, from the
listing the daemon gives this user (`ls`: an admin's is every session, any
other user's only their own), so a bulk command can act on nothing `ls`
would not show; each session is then asked for as `sessionctl stop ID`
would ask, on one connection, a few at a time.  The session a bulk command
cannot act on in its state (`interrupt` of an idle one, `stop` of a
stopped one) is skipped and said so; one that is gone meanwhile (a child
removed with its parent) is skipped too.  Exit 0 when every request
succeeded (or nothing matched), 1 when one failed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from ipc.messages import SessionInfo
from supervisor.ctl.client import AsyncClient
from supervisor.ctl.errors import RequestError
from supervisor.ctl.render import EXIT_FAILED, EXIT_OK, SORT_KEYS

__all__ = ["ACTIONS", "Outcome", "Selector", "applies", "run_bulk", "select", "sort_sessions", "usage_problem"]

# What each bulk command does, in the past tense for its report.
ACTIONS = {"interrupt": "interrupted", "stop": "stopped", "restart": "restarted", "rm": "removed"}

# Requests in flight at once: enough to overlap each stop's wait for its
# worker, few enough that the daemon's other clients are not starved.
_AT_ONCE = 8

# The states in which each command has nothing to do (the daemon would
# refuse it, or it is done already); `interrupt` acts on running turns only.
_NOTHING_TO_DO = {
    "stop": frozenset({"stopped", "deleted", "damaged"}),
    "restart": frozenset({"deleted", "damaged"}),
    "rm": frozenset({"deleted"}),
}


@dataclass(slots=True)
class Selector:
    """What the command line asked for; empty lists match anything."""

    states: list[str] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    handlers: list[str] = field(default_factory=list)

    def matches(self, s: SessionInfo) -> bool:
        return ((not self.states or s.state in self.states)
                and (not self.owners or s.owner_uid in self.owners)
                and (not self.handlers or s.handler in self.handlers))


def select(sessions: list[SessionInfo], selector: Selector) -> list[SessionInfo]:
    return [s for s in sessions if selector.matches(s)]


def applies(action: str, state: str) -> bool:
    if action == "interrupt":
        return state == "running"
    return state not in _NOTHING_TO_DO[action]


def sort_sessions(sessions: list[SessionInfo], key: str, now: float) -> list[SessionInfo]:
    """As `top --sort` orders its rows: figures largest first (the oldest
    first for age), id and state alphabetically."""
    if key not in SORT_KEYS:
        raise ValueError(key)
    if key == "id":
        return sorted(sessions, key=lambda s: s.id)
    if key == "state":
        return sorted(sessions, key=lambda s: (s.state, s.id))
    figure = {
        "cpu": lambda s: s.cpu_percent or 0.0,
        "rss": lambda s: float(s.rss_bytes or 0),
        "turns": lambda s: float(s.turns),
        "restarts": lambda s: float(s.restarts),
        "age": lambda s: now - s.created_at if s.created_at else 0.0,
    }[key]
    # Largest first, ties by id (ascending): two passes of a stable sort.
    return sorted(sorted(sessions, key=lambda s: s.id), key=figure, reverse=True)


@dataclass(slots=True)
class Outcome:
    done: list[str] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)


async def run_bulk(client: AsyncClient, action: str, selector: Selector, dry_run: bool, as_json: bool) -> int:
    # Selected by the daemon, and again here (a daemon older than
    # server-side selection answers every session).
    listed = await client.list(states=selector.states, owners=selector.owners, handlers=selector.handlers)
    chosen = select(listed, selector)
    outcome = Outcome()
    todo = []
    for s in chosen:
        if applies(action, s.state):
            todo.append(s)
        else:
            outcome.skipped.append({"id": s.id, "state": s.state, "reason": f"nothing to {action} ({s.state})"})
    if dry_run:
        outcome.done = [s.id for s in todo]
    else:
        await _act(client, action, todo, outcome, as_json)
    _report(action, outcome, dry_run, as_json, matched=len(chosen))
    return EXIT_FAILED if outcome.failed else EXIT_OK


async def _act(client: AsyncClient, action: str, todo: list[SessionInfo], outcome: Outcome, as_json: bool) -> None:
    call = {"interrupt": client.interrupt, "stop": client.stop,
            "restart": client.restart, "rm": client.remove}[action]
    gate = asyncio.Semaphore(_AT_ONCE)

    async def one(s: SessionInfo) -> None:
        async with gate:
            try:
                await call(s.id)
            except RequestError as exc:
                if exc.code == "not_found" or (action == "interrupt" and exc.code == "conflict"):
                    # Gone meanwhile (a child removed with its parent), or
                    # the turn ended meanwhile: nothing left to do.
                    outcome.skipped.append({"id": s.id, "state": s.state, "reason": exc.message})
                    return
                outcome.failed.append({"id": s.id, "code": exc.code, "message": exc.message})
                if not as_json:
                    print(f"sessionctl: {s.id}: {exc.message}", file=sys.stderr, flush=True)
                return
            outcome.done.append(s.id)
            if not as_json:
                print(f"{ACTIONS[action]} {s.id}", flush=True)

    await asyncio.gather(*(one(s) for s in todo))


def _report(action: str, outcome: Outcome, dry_run: bool, as_json: bool, matched: int) -> None:
    if as_json:
        doc: dict[str, Any] = {"action": action, "dry_run": dry_run, "matched": matched,
                               ("would" if dry_run else "done"): outcome.done,
                               "skipped": outcome.skipped, "failed": outcome.failed}
        print(json.dumps(doc))
        return
    if dry_run:
        for sid in outcome.done:
            print(f"would {action} {sid}")
    if not matched:
        print("no sessions match", file=sys.stderr)
        return
    tail = f", {len(outcome.failed)} failed" if outcome.failed else ""
    skipped = f", {len(outcome.skipped)} skipped" if outcome.skipped else ""
    verb = f"would {action}" if dry_run else ACTIONS[action]
    print(f"sessionctl: {verb} {len(outcome.done)} of {matched} matching session(s){skipped}{tail}",
          file=sys.stderr)


def usage_problem(has_id: bool, every: bool, selector: Selector) -> str | None:
    """Why a lifecycle command line names neither one session nor a
    selection, or both; None if it is fine."""
    selecting = every or bool(selector.states or selector.owners or selector.handlers)
    if has_id and selecting:
        return "give a session id or a selection (--all, --state, --owner, --handler), not both"
    if not has_id and not selecting:
        return "give a session id, or select sessions with --all, --state, --owner or --handler"
    return None

