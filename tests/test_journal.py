"""The file store's daemon-wide journal (supervisor/store/journal.py): what a crash
leaves of it and what replay makes of that, checkpoints, tombstones, locks,
and a daemon SIGKILLed in the middle of many sessions' batches."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec
import pytest

from supervisor.store import journal as journal_mod
from supervisor.store import replay as replay_mod
from supervisor.errors import StoreDamaged
from supervisor.ctl.client import AsyncClient
from supervisor.store.state_store import Commit, Meta, RepairMode, Snapshot
from supervisor.store.files import SessionStore, scan_log
from supervisor.store.filestore import FileStateStore
from harness import Daemon, wait_for


def _meta(sid: str) -> Meta:
    return Meta(id=sid, handler="echo", created_at=1.0)


def _commit(turn: int, record: bytes) -> Commit:
    return Commit(turn=turn, reply=f"r{turn}", record=record, seq=turn)


def _power_loss(store: FileStateStore, handles: list[SessionStore], journal_bytes: int | None = None) -> None:
    """Logs lose what this writer appended (only the journal was flushed);
    the journal keeps what was fdatasync'd, or `journal_bytes` of it."""
    j = store._journal
    assert j is not None
    keep = j.synced_bytes if journal_bytes is None else journal_bytes
    for h in handles:
        with open(h.path / f"log.{h.gen}", "r+b") as f:
            f.truncate(h._opened)
        h.close()
    j.abandon()
    with open(j.path, "r+b") as f:
        f.truncate(keep)


@pytest.mark.component
def test_a_torn_journal_tail_loses_only_the_torn_record(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path)
    h = store.create(_meta("s1"))
    h.append(_commit(1, b"\x01"), durable=True)
    h.append(_commit(2, b"\x02"), durable=True)
    j = store._journal
    assert j is not None
    whole = j.synced_bytes
    h.append(_commit(3, b"\x03"), durable=True)
    torn = whole + (j.synced_bytes - whole) // 2  # half of the last record
    _power_loss(store, [h], journal_bytes=torn)
    h2, loaded = FileStateStore(tmp_path).load("s1")
    assert h2.read_for_boot()[1] == [b"\x01", b"\x02"] and loaded.seq == 2
    assert not list((tmp_path / ".journal").glob("*.wal"))[1:]  # replayed ones deleted


@pytest.mark.component
def test_a_removed_sessions_records_never_reach_a_new_one_of_its_id(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path)
    old = store.create(_meta("x"))
    for t in range(1, 6):
        old.append(_commit(t, b"old"), durable=True)
    old.remove()
    new = store.create(_meta("x"))
    new.append(_commit(1, b"new"), durable=True)
    _power_loss(store, [new])
    h, loaded = FileStateStore(tmp_path).load("x")
    assert h.read_for_boot()[1] == [b"new"] and loaded.turns == 0 and loaded.seq == 1


@pytest.mark.component
def test_a_live_journal_is_not_replayed_by_another_store(tmp_path: Path) -> None:
    first = FileStateStore(tmp_path)
    h = first.create(_meta("s1"))
    h.append(_commit(1, b"\x01"), durable=True)
    second = FileStateStore(tmp_path)
    assert second.ids() == ["s1"]
    assert first._journal is not None and first._journal.path.exists()  # still first's
    first.close()
    second.close()


@pytest.mark.component
def test_a_checkpoint_makes_logs_durable_and_retires_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_mod, "_CHECKPOINT_BYTES", 2000)
    store = FileStateStore(tmp_path)
    handles = [store.create(_meta(f"s{i}")) for i in range(4)]

    async def main() -> None:
        for turn in range(1, 30):
            for h in handles:
                h.append(_commit(turn, bytes([turn])), durable=False)
            await asyncio.gather(*(h.sync_soon() for h in handles))

    asyncio.run(main())
    j = store._journal
    assert j is not None

    def retired() -> bool:
        return [p.name for p in (tmp_path / ".journal").glob("*.wal")] == [j.path.name]

    # The writer thread deletes a retired journal after syncing its logs.
    wait_for(retired, timeout=10, what="the retired journal deleted")
    store.close()
    assert not list((tmp_path / ".journal").glob("*.wal"))
    reopened = FileStateStore(tmp_path)
    for i in range(4):
        assert reopened.load(f"s{i}")[0].read_for_boot()[1] == [bytes([t]) for t in range(1, 30)]


@pytest.mark.process
def test_sigkill_in_the_middle_of_batches_loses_no_acknowledged_turn(make_daemon) -> None:
    d: Daemon = make_daemon()
    acked: dict[str, int] = {}

    async def load() -> None:
        client = await AsyncClient.connect(str(d.socket))
        sids = [(await client.create(handler="echo")).id for _ in range(12)]
        for sid in sids:
            acked[sid] = 0

        async def one(sid: str) -> None:
            while True:
                reply = await client.send_text(sid, "x")
                acked[sid] = int(reply.split(":")[0])

        tasks = [asyncio.ensure_future(one(sid)) for sid in sids]
        while sum(acked.values()) < 300:
            await asyncio.sleep(0.01)
        d.kill()  # SIGKILL, with batches in flight
        # (The client would wait for the daemon to come back: what was
        # acknowledged before the kill is all that counts.)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()

    asyncio.run(load())
    d.start()
    with d.client() as c:
        for sid, n in acked.items():
            assert c.status(sid).turns >= n, (sid, n)
            # Echo numbers a reply by the turns committed before it, as
            # restored from the store: every acknowledged one is there.
            committed = int(c.send_text(sid, "y").split(":")[0]) - 1
            assert committed >= n, (sid, committed, n)


@pytest.mark.component
def test_a_snapshot_written_off_the_loop_is_consistent_before_and_after_it_lands(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path)
    h = store.create(_meta("s1"))

    async def main() -> tuple[bytes, list[bytes], int]:
        for t in range(1, 4):
            h.append(_commit(t, bytes([t])), durable=False)
        await h.sync_soon()
        h.write_snapshot(Snapshot(gen=0, meta=_meta("s1"), turns=3, seq=3, handler_state=b"S1"))
        before = h.read_for_boot()  # whichever snapshot is on disk, with its logs
        assert before in ((b"S1", [], 3), (b"", [b"\x01", b"\x02", b"\x03"], 3))
        h.append(_commit(4, b"\x04"), durable=False)
        await h.sync_soon()
        assert h.read_for_boot() in ((b"S1", [b"\x04"], 4), (b"", [b"\x01", b"\x02", b"\x03", b"\x04"], 4))
        deadline = asyncio.get_running_loop().time() + 10
        while h._snapshotting:  # landed, and its completion ran on the loop
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.001)
        return h.read_for_boot()

    assert asyncio.run(main()) == (b"S1", [b"\x04"], 4)
    _power_loss(store, [h])
    h2, loaded = FileStateStore(tmp_path).load("s1")
    assert h2.read_for_boot() == (b"S1", [b"\x04"], 4) and loaded.turns == 3 and loaded.seq == 4


@pytest.mark.component
def test_records_of_a_superseded_writer_survive_a_crash_after_the_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Replay skips records of an older fence generation: a reload must make
    # them durable in the log itself first.  What an fsync made durable is
    # recorded, and the power loss keeps exactly that of log.0.
    durable: dict[Path, int] = {}
    real = journal_mod._fsync_path

    def recording(path: str | Path, directory: bool = False) -> None:
        real(path, directory)
        if not directory:
            durable[Path(path)] = os.stat(path).st_size

    monkeypatch.setattr(journal_mod, "_fsync_path", recording)
    store = FileStateStore(tmp_path)
    h1 = store.create(_meta("s1"))
    h1.append(_commit(1, b"\x01"), durable=True)
    h2, _ = store.load("s1")
    h2.append(_commit(2, b"\x02"), durable=True)
    h1.close()
    log0 = tmp_path / "s1" / "log.0"
    j = store._journal
    assert j is not None
    keep = j.synced_bytes
    h2.close()
    j.abandon()
    with open(j.path, "r+b") as f:
        f.truncate(keep)
    with open(log0, "r+b") as f:
        f.truncate(durable.get(log0, 0))
    h3, loaded = FileStateStore(tmp_path).load("s1")
    assert h3.read_for_boot()[1] == [b"\x01", b"\x02"] and loaded.seq == 2


# ---------------------------------------------------------------- a damaged journal (issue 23)


def _ten_turns_and_a_flip(tmp_path: Path, flip_turn: int, log_keeps: int) -> tuple[Path, int]:
    """Sessions s1 and s2 commit ten turns each (acknowledged: durable), the
    journal gets one flipped byte in the middle of s1's turn `flip_turn`,
    and a power loss cuts s1's log after its turn `log_keeps` (s2's log
    loses everything this writer appended).  Returns the journal's path."""
    store = FileStateStore(tmp_path)
    s1, s2 = store.create(_meta("s1")), store.create(_meta("s2"))
    j = store._journal
    assert j is not None
    span: dict[int, tuple[int, int]] = {}
    log_size: dict[int, int] = {}
    for t in range(1, 11):
        before = j.synced_bytes
        s1.append(_commit(t, bytes([t]) * 200), durable=True)
        span[t] = (before, j.synced_bytes)
        log_size[t] = s1._size
        s2.append(_commit(t, bytes([t]) * 50), durable=True)
    path = j.path
    log1 = tmp_path / "s1" / "log.0"
    kept = log1.read_bytes()[: log_size[log_keeps]]
    _power_loss(store, [s1, s2])
    log1.write_bytes(kept)
    a, b = span[flip_turn]
    data = bytearray(path.read_bytes())
    data[(a + b) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return path, log_size[log_keeps]


@pytest.mark.component
def test_a_flipped_journal_byte_and_a_lost_log_tail_lose_no_acknowledged_turn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The chaos run's finding: replay stopped at the flipped record and
    deleted the journal, so turns 6-10, acknowledged, were lost."""
    journal, _ = _ten_turns_and_a_flip(tmp_path, flip_turn=5, log_keeps=5)
    store = FileStateStore(tmp_path)
    for sid, size in (("s1", 200), ("s2", 50)):
        h, loaded = store.load(sid)
        assert h.read_for_boot()[1] == [bytes([t]) * size for t in range(1, 11)], sid
        assert loaded.seq == 10
    assert "is damaged" in caplog.text  # never silent
    assert (tmp_path / ".journal" / "damaged" / journal.name).exists()  # the evidence is kept


@pytest.mark.component
def test_records_a_damaged_journal_lost_leave_the_session_damaged_until_repair(tmp_path: Path) -> None:
    journal, _ = _ten_turns_and_a_flip(tmp_path, flip_turn=5, log_keeps=4)
    store = FileStateStore(tmp_path)
    with pytest.raises(StoreDamaged, match=rf"log.0: bytes .* no intact journal record.*{journal.name}"):
        store.load("s1")
    kept = tmp_path / ".journal" / "damaged" / journal.name
    assert kept.exists()
    h2, loaded2 = store.load("s2")  # its records after the damage were restored
    assert len(h2.read_for_boot()[1]) == 10 and loaded2.seq == 10
    # A restart does not forget it.
    store.close()
    store = FileStateStore(tmp_path)
    with pytest.raises(StoreDamaged):
        store.load("s1")
    result = store.repair("s1", RepairMode.SKIP_BAD)
    assert result.kept_records == 10  # Meta and nine turns: only turn 5 is lost
    h, loaded = store.load("s1")
    assert h.read_for_boot()[1] == [bytes([t]) * 200 for t in range(1, 11) if t != 5]
    assert loaded.seq == 10
    assert not kept.exists() and not (tmp_path / "s1" / "journal-damage").exists()


@pytest.mark.component
def test_a_flipped_last_record_the_log_lacks_is_damage_not_a_torn_tail(tmp_path: Path) -> None:
    journal, _ = _ten_turns_and_a_flip(tmp_path, flip_turn=10, log_keeps=9)
    # The flip was in s1's turn 10; s2's turn 10 follows it intact.  Cut
    # that off too: the damaged record is the journal's last.
    data = journal.read_bytes()
    records = replay_mod._read_journal(journal).records
    assert records[-1].sid == "s2"
    journal.write_bytes(data[: len(data) - len(replay_mod.encoder.encode(records[-1])) - 8])
    store = FileStateStore(tmp_path)
    with pytest.raises(StoreDamaged, match="record at .* failed its checksum"):
        store.load("s1")
    store.repair("s1", RepairMode.TRUNCATE)
    h, _ = store.load("s1")
    assert len(h.read_for_boot()[1]) == 9


# ---------------------------------------------------------------- rm erases (issue 23)


def _files_holding(root: Path, marker: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and marker in p.read_bytes()]


@pytest.mark.component
def test_a_removed_sessions_content_leaves_the_journal_at_once(tmp_path: Path) -> None:
    """It stayed in the shared journal until the next 64 MiB checkpoint."""
    store = FileStateStore(tmp_path)
    gone, kept = store.create(_meta("gone")), store.create(_meta("kept"))

    async def main() -> None:
        for t in range(1, 4):
            gone.append(_commit(t, b"SECRET-of-gone"), durable=False)
            kept.append(_commit(t, b"kept-" + bytes([t])), durable=False)
            await asyncio.gather(gone.sync_soon(), kept.sync_soon())
        assert _files_holding(tmp_path, b"SECRET-of-gone")
        gone.remove()
        kept.append(_commit(4, b"kept-\x04"), durable=False)
        await kept.sync_soon()

    asyncio.run(main())
    wait_for(lambda: not _files_holding(tmp_path, b"SECRET-of-gone"), 10, "the journal that held it deleted")
    # A crash now: the checkpoint fsync'd kept's log; its turn 4 is in the new journal.
    kept.close()
    assert store._journal is not None
    store._journal.abandon()
    h, loaded = FileStateStore(tmp_path).load("kept")
    assert h.read_for_boot()[1] == [b"kept-" + bytes([t]) for t in range(1, 5)] and loaded.seq == 4


@pytest.mark.component
def test_removing_the_session_a_damaged_journal_was_kept_for_deletes_it(tmp_path: Path) -> None:
    journal, _ = _ten_turns_and_a_flip(tmp_path, flip_turn=5, log_keeps=4)
    store = FileStateStore(tmp_path)
    assert store.ids() == ["s1", "s2"]  # (replayed)
    kept = tmp_path / ".journal" / "damaged" / journal.name
    assert kept.exists()
    store.remove("s1")
    assert not kept.exists()
    assert len(store.load("s2")[0].read_for_boot()[1]) == 10


@pytest.mark.component
def test_a_last_record_whose_last_sector_never_landed_is_a_torn_tail(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path)
    h = store.create(_meta("s1"))
    for t in range(1, 4):
        h.append(_commit(t, bytes([t]) * 2000), durable=True)
    j = store._journal
    assert j is not None
    path, size = j.path, j.synced_bytes
    _power_loss(store, [h])
    data = bytearray(path.read_bytes())
    data[size - 700 :] = bytes(700)  # the file grew, its last sectors stayed zeros
    path.write_bytes(bytes(data))
    h2, loaded = FileStateStore(tmp_path).load("s1")
    assert h2.read_for_boot()[1] == [bytes([t]) * 2000 for t in (1, 2)] and loaded.seq == 2
    assert not (tmp_path / ".journal" / "damaged").exists()


def _journal_records(path: Path) -> list[tuple[int, int, replay_mod.JRec]]:
    """(start, end, record) of every record of a journal file, in order."""
    data, pos, out = path.read_bytes(), 0, []
    while pos + 8 <= len(data):
        length, _ = replay_mod.REC.unpack_from(data, pos)
        end = pos + 8 + length
        out.append((pos, end, msgspec.msgpack.decode(data[pos + 8 : end], type=replay_mod.JRec)))
        pos = end
    return out


@pytest.mark.parametrize("log_holds_the_bad_record", [True, False])
@pytest.mark.process
def test_the_chaos_runs_damaged_journal_loses_no_acknowledged_turn(
    make_daemon, log_holds_the_bad_record: bool
) -> None:
    """The finding, on a real daemon: ten acknowledged turns, a SIGKILL, then
    what a power loss leaves (the log's tail after turn 5 missing) and one
    flipped byte in the journal's copy of turn 5: five turns were lost.
    If the log lacks turn 5's record too, only that one record is lost, the
    session says so (`damaged`) and `repair` keeps everything else."""
    d: Daemon = make_daemon()
    with d.client() as c:
        sid = c.create().id
        for i in range(1, 11):
            assert c.send_text(sid, f"turn {i}") == f"{i}: turn {i}"
    d.kill()
    journal, = (d.state_dir / "sessions" / ".journal").glob("*.wal")
    records = _journal_records(journal)
    (start, end, rec), = [(a, b, r) for a, b, r in records if r.sid == sid and r.frame
                          and (found := scan_log(r.frame).records)
                          and isinstance(found[0][2], Commit) and found[0][2].turn == 5]
    log0 = d.state_dir / "sessions" / sid / f"log.{rec.log}"
    log0.write_bytes(log0.read_bytes()[: rec.offset + (len(rec.frame) if log_holds_the_bad_record else 0)])
    data = bytearray(journal.read_bytes())
    data[(start + end) // 2] ^= 0x01
    journal.write_bytes(bytes(data))
    d.start()
    assert "is damaged at byte(s)" in d.log
    if not log_holds_the_bad_record:
        with d.client() as c:
            st = c.status(sid)
            assert st.state == "damaged" and "no intact journal record" in (st.error or ""), st
        r = d.ctl("repair", sid, "--skip-bad")
        assert r.returncode == 0 and "now hibernated" in r.stdout, r.stdout + r.stderr
        assert not list((d.state_dir / "sessions" / ".journal" / "damaged").iterdir())
    with d.client() as c:
        assert c.status(sid).turns == 10
        # Echo counts committed turns: turn 5's commit is the one record lost.
        assert c.send_text(sid, "after") == ("11: after" if log_holds_the_bad_record else "10: after")
