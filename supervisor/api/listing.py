"""`ls` as the daemon answers it: the client's selection and page, checked as
hostile input, applied to the sessions that client may see.  Runs in the
daemon, on its loop.

Selecting here rather than in sessionctl keeps a user's `ls` as cheap as
what it shows: among 100,000 sessions, one user's 100 are described and
sent, not every one.  A page (`limit`) is ordered by id, so that a client
walks a changing registry with `after` and sees every session that existed
throughout once (one made or removed meanwhile may or may not appear).
While a daemon just started still loads the sessions on disk
(supervisor.core.loading) the list holds those loaded so far, and says so
(`loading`).
"""

from __future__ import annotations

from collections.abc import Iterable

from ipc import messages as m
from ipc.contract import LIST_PAGE_MAX
from ipc.inputs import valid_session_id
from supervisor.core.session import Session
from supervisor.core.states import State
from supervisor.errors import BadRequest

__all__ = ["MAX_VALUES", "loading", "select"]

# The most values one selector list may carry.  (A page holds at most
# LIST_PAGE_MAX sessions: a frame of SessionInfos stays a few MiB.)
MAX_VALUES = 64
_STATES = frozenset(s.value for s in State)


def check(req: m.List) -> None:
    """BadRequest for a selection no session could match by construction
    or that asks the daemon for unbounded work."""
    for name, values in (("states", req.states), ("owners", req.owners), ("handlers", req.handlers)):
        if len(values) > MAX_VALUES:
            raise BadRequest(f"ls: at most {MAX_VALUES} {name}, not {len(values)}")
    if unknown := [s for s in req.states if s not in _STATES]:
        raise BadRequest(f"ls: unknown state {unknown[0][:40]!r} (one of {', '.join(sorted(_STATES))})")
    if not 0 <= req.limit <= LIST_PAGE_MAX:
        raise BadRequest(f"ls: limit must be 0 (no page) to {LIST_PAGE_MAX}, not {req.limit}")
    if req.after and not valid_session_id(req.after):
        raise BadRequest("ls: after must be a session id")


def select(sessions: Iterable[Session], req: m.List) -> tuple[list[Session], str]:
    """(the sessions to describe, the next page's `after` or "")."""
    check(req)
    states, owners, handlers = frozenset(req.states), frozenset(req.owners), frozenset(req.handlers)
    if states or owners or handlers:
        sessions = (s for s in sessions
                    if (not states or s.state.value in states)
                    and (not owners or s.meta.owner_uid in owners)
                    and (not handlers or s.meta.handler in handlers))
    if not (req.limit or req.after):
        return list(sessions), ""
    ordered = sorted((s for s in sessions if s.id > req.after), key=lambda s: s.id)
    if not req.limit or len(ordered) <= req.limit:
        return ordered, ""
    page = ordered[:req.limit]
    return page, page[-1].id


def loading(progress: tuple[int, int] | None, admin: bool) -> m.Loading | None:
    """What `ls` and `stats` say while the start-up load runs: how far it
    got, to an admin; to anyone else only that it runs (how many sessions
    others hold is theirs to know)."""
    if progress is None:
        return None
    return m.Loading(loaded=progress[0], total=progress[1]) if admin else m.Loading()
