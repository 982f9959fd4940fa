"""The durable log and snapshots, including torn tails and failed writes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from supervisor.store.files import (
    Commit,
    InputRecord,
    Mark,
    Meta,
    SessionStore,
    Snapshot,
    StoreError,
)

pytestmark = pytest.mark.component


def make(tmp_path: Path) -> SessionStore:
    return SessionStore.create(tmp_path, Meta(id="s1", handler="echo", created_at=1.0))


def test_round_trip(tmp_path: Path) -> None:
    st = make(tmp_path)
    st.append(InputRecord(turn=1, text="hi", seq=3), durable=True)
    st.append(Commit(turn=1, reply="1: hi", record=b"\x01", seq=7), durable=True)
    st.append(InputRecord(turn=2, text="open", seq=8), durable=True)
    st.close()
    _, loaded = SessionStore.load(tmp_path / "s1")
    assert loaded.meta.id == "s1" and loaded.turns == 2 and loaded.seq == 8
    assert loaded.open_input is not None and loaded.open_input.turn == 2
    state, records, turns = SessionStore.load(tmp_path / "s1")[0].read_for_boot()
    assert state == b"" and records == [b"\x01"] and turns == 1


@pytest.mark.parametrize("cut", [1, 3, 8, 11])
def test_torn_tail_is_dropped_and_the_rest_survives(tmp_path: Path, cut: int) -> None:
    st = make(tmp_path)
    st.append(Commit(turn=1, reply="a", record=b"\x01", seq=1), durable=True)
    st.append(Commit(turn=2, reply="b", record=b"\x02", seq=2), durable=True)
    st.close()
    log = tmp_path / "s1" / "log.0"
    size = log.stat().st_size
    with open(log, "r+b") as f:
        f.truncate(size - cut)
    st2, loaded = SessionStore.load(tmp_path / "s1")
    assert loaded.seq == 1
    assert st2.read_for_boot()[1] == [b"\x01"]
    # The file was cut back to the last good record, so appends line up again.
    st2.append(Commit(turn=2, reply="b2", record=b"\x03", seq=5), durable=True)
    st2.close()
    assert SessionStore.load(tmp_path / "s1")[0].read_for_boot()[1] == [b"\x01", b"\x03"]


def test_corrupt_byte_fails_the_checksum(tmp_path: Path) -> None:
    st = make(tmp_path)
    st.append(Commit(turn=1, reply="aaaa", record=b"\x01", seq=1), durable=True)
    st.close()
    log = tmp_path / "s1" / "log.0"
    data = bytearray(log.read_bytes())
    data[-2] ^= 0xFF
    log.write_bytes(bytes(data))
    _, loaded = SessionStore.load(tmp_path / "s1")
    assert loaded.seq == 0 and loaded.meta.id == "s1"


def test_snapshot_rotates_the_log(tmp_path: Path) -> None:
    st = make(tmp_path)
    for t in range(1, 4):
        st.append(Commit(turn=t, reply="x", record=b"\x01", seq=t), durable=True)
    meta = Meta(id="s1", handler="echo")
    st.write_snapshot(Snapshot(gen=0, meta=meta, turns=3, seq=3, handler_state=b"\x03"))
    st.append(Commit(turn=4, reply="y", record=b"\x01", seq=4), durable=True)
    st.close()
    names = sorted(p.name for p in (tmp_path / "s1").iterdir())
    # The log the snapshot folds in stays as the fallback until the next snapshot.
    assert names == ["fence", "log.0", "log.1", "snapshot"]
    st2, loaded = SessionStore.load(tmp_path / "s1")
    assert loaded.seq == 4
    assert st2.read_for_boot() == (b"\x03", [b"\x01"], 4)


def test_crash_between_snapshot_and_new_log_keeps_everything(tmp_path: Path) -> None:
    st = make(tmp_path)
    st.append(Commit(turn=1, reply="x", record=b"\x01", seq=1), durable=True)
    st.write_snapshot(Snapshot(gen=0, meta=Meta(id="s1", handler="echo"), turns=1, seq=1,
                               handler_state=b"\x01"))
    st.close()
    # The log the snapshot folded in is not read again while the snapshot is good.
    (tmp_path / "s1" / "log.0").write_bytes(b"stale")
    st2, loaded = SessionStore.load(tmp_path / "s1")
    assert st2.read_for_boot() == (b"\x01", [], 1)


def test_failed_write_leaves_no_partial_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = make(tmp_path)
    st.append(Commit(turn=1, reply="ok", record=b"\x01", seq=1), durable=True)
    real_write = os.write

    def half_then_enospc(fd: int, data: bytes) -> int:
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_enospc)
    with pytest.raises(StoreError, match="No space left"):
        st.append(Commit(turn=2, reply="lost", record=b"\x02", seq=2), durable=True)
    monkeypatch.setattr(os, "write", real_write)
    st.append(Commit(turn=2, reply="ok2", record=b"\x03", seq=3), durable=True)
    st.close()
    assert SessionStore.load(tmp_path / "s1")[0].read_for_boot()[1] == [b"\x01", b"\x03"]


def test_mark_persists_state(tmp_path: Path) -> None:
    st = make(tmp_path)
    st.append(Mark(state="failed", seq=4096, restarts=3, last_exit={"reason": "crashed"}), durable=True)
    st.close()
    _, loaded = SessionStore.load(tmp_path / "s1")
    assert loaded.mark.state == "failed" and loaded.mark.restarts == 3 and loaded.seq == 4096


def test_remove(tmp_path: Path) -> None:
    st = make(tmp_path)
    st.remove()
    assert list(tmp_path.iterdir()) == []
