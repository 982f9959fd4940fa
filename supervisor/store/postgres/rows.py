"""Rows of the PostgreSQL store's log, checked as the file store checks its
records (supervisor.store.files): each row holds one frame, `u32 length | u32
crc32 | msgpack`; damaged rows at the end are a torn tail, damaged rows
followed by intact ones are damage that loading must not paper over.
Pure: no I/O (supervisor.store.postgres.store reads the rows)."""

from __future__ import annotations

import msgspec

from supervisor.errors import StoreDamaged
from supervisor.store.state_store import LoadedSession, Meta, Record, Snapshot
from supervisor.store.files import scan_log

__all__ = ["Rows", "checked", "decode_snapshot", "describe", "intact", "replay", "snap_encoder"]

snap_encoder = msgspec.msgpack.Encoder()
_snap_decoder = msgspec.msgpack.Decoder(Snapshot)


def intact(frame: bytes) -> Record | None:
    """The record a row holds, or None when its frame is damaged."""
    scan = scan_log(frame)
    if scan.bad or len(scan.records) != 1:
        return None
    return scan.records[0][2]


class Rows:
    """A session's log rows, checked: which are intact, which damaged."""

    def __init__(self, rows: list[tuple[int, bytes]]) -> None:
        self.rows = rows
        self.records: list[tuple[int, Record]] = []
        self.bad: list[tuple[int, int]] = []  # (pos, length) of damaged rows
        for pos, frame in rows:
            rec = intact(bytes(frame))
            if rec is None:
                self.bad.append((pos, len(frame)))
            else:
                self.records.append((pos, rec))

    @property
    def torn_at(self) -> int | None:
        """First position of damaged rows with nothing intact after them."""
        last_good = self.records[-1][0] if self.records else -1
        return next((pos for pos, _ in self.bad if pos > last_good), None)

    @property
    def damaged(self) -> list[int]:
        last_good = self.records[-1][0] if self.records else -1
        return [pos for pos, _ in self.bad if pos < last_good]

    def meta(self) -> Meta | None:
        return next((r for _, r in self.records if isinstance(r, Meta)), None)


def decode_snapshot(session_id: str, body: bytes | None) -> Snapshot | None:
    if body is None:
        return None
    try:
        return _snap_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise StoreDamaged(session_id, f"its snapshot cannot be decoded ({exc}); its state is lost: "
                           f"`sessionctl rm {session_id}` deletes it", repairable=False) from None


def describe(rows: Rows) -> str:
    damaged = rows.damaged
    where = ", ".join(map(str, damaged[:4])) + (", ..." if len(damaged) > 4 else "")
    after = sum(1 for pos, _ in rows.records if pos > damaged[0])
    return (
        f"record(s) at position {where} are corrupt with {after} intact record(s) after the damage; "
        "they are kept as they are. `sessionctl repair ID --skip-bad` keeps every intact record, "
        "`--truncate` keeps what precedes the damage, `sessionctl rm ID` deletes the session"
    )


def checked(session_id: str, snap: Snapshot | None, rows: Rows) -> list[Record]:
    """The intact records of `rows`, in order; `StoreDamaged` for damaged
    rows followed by intact ones.  The one check of every read: load, and a
    worker's boot, history and export while the daemon runs, so that none
    reads past what the next start would refuse."""
    if rows.damaged:
        raise StoreDamaged(session_id, describe(rows), meta=snap.meta if snap is not None else rows.meta())
    return [rec for _, rec in rows.records]


def replay(session_id: str, snap: Snapshot | None, rows: Rows) -> LoadedSession:
    """The session a snapshot and the intact rows after it make."""
    return LoadedSession.replay(session_id, snap, (rec for _, rec in rows.records))
