"""`SessionLog.read_history()` (history, export) under the store contract
suite's adapters: the snapshot and every record after it, read-only."""

from __future__ import annotations

import asyncio

import pytest
from test_store_contract import ad, commit, meta  # noqa: F401  (ad: the adapter fixture)

from supervisor.store.state_store import Abort, InputRecord, Meta, Snapshot

pytestmark = pytest.mark.component


def test_read_history_is_the_snapshot_and_the_records_after_it(ad) -> None:  # noqa: F811
    h = ad.store.create(meta())
    snap, records = h.read_history()
    assert snap is None and all(isinstance(r, Meta) for r in records)  # a store may log its meta
    h.append(InputRecord(turn=1, text="one", seq=1), durable=True)
    h.append(commit(1, b"\x01", 2), durable=True)
    snap, records = h.read_history()
    assert snap is None
    assert [r for r in records if not isinstance(r, Meta)] == [
        InputRecord(turn=1, text="one", seq=1), commit(1, b"\x01", 2)]
    h.write_snapshot(Snapshot(gen=0, meta=meta(), turns=1, seq=2, handler_state=b"S"))
    h.append(InputRecord(turn=2, text="two", seq=3), durable=True)
    h.append(Abort(turn=2, reason="crashed", seq=4), durable=True)
    snap, records = h.read_history()
    assert snap is not None and snap.turns == 1 and snap.handler_state == b"S"
    assert records == [InputRecord(turn=2, text="two", seq=3), Abort(turn=2, reason="crashed", seq=4)]
    # Reading changes nothing: the writer goes on, a load sees the same.
    h.append(commit(3, b"\x03", 5), durable=True)
    h.close()
    h2, loaded = ad.store.load("s1")
    assert loaded.turns == 2 and h2.read_history()[1][-1] == commit(3, b"\x03", 5)


def test_read_history_soon_reads_the_same_without_blocking_the_loop(ad) -> None:  # noqa: F811
    h = ad.store.create(meta())
    h.append(InputRecord(turn=1, text="one", seq=1), durable=True)
    h.append(commit(1, b"\x01", 2), durable=True)

    async def main() -> None:
        h.append(InputRecord(turn=2, text="two", seq=3), durable=False)  # appended, not synced: read too
        soon = await h.read_history_soon()
        assert soon == h.read_history()
        assert [r for r in soon[1] if not isinstance(r, Meta)][-1] == InputRecord(turn=2, text="two", seq=3)

    asyncio.run(main())


def test_history_keeps_the_newest_turns_that_fit_one_reply() -> None:
    from ipc.settings import SessionSettings
    from supervisor.api import transfer
    from supervisor.store.memory import InMemoryStateStore
    from supervisor.core.session import Session
    from supervisor.core.states import State

    store = InMemoryStateStore()
    log = store.create(meta())
    for turn in range(1, 11):
        log.append(InputRecord(turn=turn, text=f"q{turn}", seq=2 * turn - 1), durable=True)
        log.append(commit(turn, b"", 2 * turn) if turn != 4 else Abort(turn=4, reason="crashed", seq=8),
                   durable=True)
    log.append(InputRecord(turn=11, text="running", seq=21), durable=True)
    session = Session(id="s1", meta=meta(), store=log, settings=SessionSettings(), state=State.RUNNING)

    def history(*args: object, **kwargs: object) -> object:  # (a coroutine: it works off the loop)
        return asyncio.run(transfer.history(*args, **kwargs))  # type: ignore[arg-type]

    whole = history(session, None)
    assert [t.turn for t in whole.turns] == list(range(1, 12)) and whole.omitted_turns == 0
    assert whole.turns[3].outcome == "aborted" and whole.turns[3].reason == "crashed"
    assert whole.turns[-1].outcome == "open" and whole.turns[0].reply == "r1"
    assert [t.turn for t in history(session, 2).turns] == [10, 11]
    assert history(session, 0).turns == []
    small = history(session, None, max_bytes=200)
    assert 0 < len(small.turns) < 11 and small.omitted_turns == 11 - len(small.turns)
    assert small.turns[-1].turn == 11
    with pytest.raises(Exception, match="0 or more"):
        history(session, -1)
