"""`ls` selected and paged by the daemon (supervisor.api.listing): what a
List request may ask, and that walking the pages sees every session once."""

from __future__ import annotations

from typing import Any

import pytest

from ipc import messages as m
from ipc.contract import LIST_PAGE_MAX
from ipc.settings import SessionSettings
from supervisor.api.listing import MAX_VALUES, select
from supervisor.core.session import Session
from supervisor.core.states import State
from supervisor.errors import BadRequest
from supervisor.store.state_store import Meta


def _session(sid: str, state: State = State.IDLE, owner: int = 0, handler: str = "echo") -> Session:
    store: Any = None  # never touched by a listing
    return Session(id=sid, meta=Meta(id=sid, handler=handler, owner_uid=owner), store=store,
                   settings=SessionSettings(), state=state)


SESSIONS = [_session(f"s{i:02d}", State.HIBERNATED if i % 3 else State.IDLE, owner=1000 + i % 2,
                     handler="agent" if i % 5 == 0 else "echo") for i in range(25)]


def _ids(sessions: list[Session]) -> list[str]:
    return [s.id for s in sessions]


@pytest.mark.pure
def test_no_selection_and_no_page_is_every_session_in_the_registrys_order() -> None:
    shuffled = SESSIONS[::-1]
    chosen, after = select(shuffled, m.List(id=1))
    assert _ids(chosen) == _ids(shuffled) and after == ""


@pytest.mark.pure
def test_every_list_given_must_match_and_any_of_its_values_does() -> None:
    req = m.List(id=1, states=["idle", "failed"], owners=[1001], handlers=["echo", "agent"])
    chosen, _ = select(SESSIONS, req)
    assert _ids(chosen) == [s.id for s in SESSIONS if s.state is State.IDLE and s.meta.owner_uid == 1001]
    assert select(SESSIONS, m.List(id=1, handlers=["nosuch"])) == ([], "")


@pytest.mark.pure
def test_pages_walk_every_session_once_in_id_order() -> None:
    seen: list[str] = []
    after, pages = "", 0
    while True:
        page, after = select(SESSIONS[::-1], m.List(id=1, limit=10, after=after))
        seen += _ids(page)
        pages += 1
        if not after:
            break
        assert after == page[-1].id
    assert seen == sorted(s.id for s in SESSIONS) and pages == 3
    # Exactly a page's worth left: the last page says nothing more.
    assert select(SESSIONS, m.List(id=1, limit=5, after="s19"))[1] == ""
    # `after` alone: the rest, in id order, unpaged.
    assert _ids(select(SESSIONS[::-1], m.List(id=1, after="s22"))[0]) == ["s23", "s24"]


@pytest.mark.pure
def test_a_page_of_a_selection_counts_only_what_matches() -> None:
    page, after = select(SESSIONS, m.List(id=1, owners=[1000], limit=3))
    assert _ids(page) == ["s00", "s02", "s04"] and after == "s04"


@pytest.mark.pure
@pytest.mark.parametrize(("req", "says"), [
    (m.List(id=1, states=["sleeping"]), "unknown state"),
    (m.List(id=1, limit=-1), "limit"),
    (m.List(id=1, limit=LIST_PAGE_MAX + 1), "limit"),
    (m.List(id=1, after="../x"), "after"),
    (m.List(id=1, owners=list(range(MAX_VALUES + 1))), "at most"),
    (m.List(id=1, handlers=["h"] * (MAX_VALUES + 1)), "at most"),
])
def test_a_request_no_listing_should_answer_is_bad_request(req: m.List, says: str) -> None:
    with pytest.raises(BadRequest, match=says):
        select(SESSIONS, req)
