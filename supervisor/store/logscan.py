"""A session log's bytes: framing records, scanning a log (damage and all),
and the snapshot file's format.  Pure functions over bytes and files, shared
by the file store (supervisor.store.files) and the in-memory one.

    record    u32 length | u32 crc32 | msgpack
    snapshot  SNP1 | u32 length | u32 crc32 | msgpack   (older ones: bare msgpack)
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from supervisor.store.state_store import Record, Snapshot

__all__ = ["LogScan", "describe_damage", "frame_record", "read_scan", "read_snapshot", "encode_snapshot",
           "scan_log"]

_REC = struct.Struct(">II")
_SNAP_MAGIC = b"SNP1"
_SNAP_HEAD = struct.Struct(">4sII")
# No record is bigger than a worker frame (1 GiB); a larger length read
# while resynchronising is garbage, not a record.
_MAX_RECORD = 1 << 30

_rec_encoder = msgspec.msgpack.Encoder()
_rec_decoder = msgspec.msgpack.Decoder(Record)
_snap_decoder = msgspec.msgpack.Decoder(Snapshot)


def _frame(record: Record) -> bytes:
    body = _rec_encoder.encode(record)
    return _REC.pack(len(body), zlib.crc32(body)) + body


# ---------------------------------------------------------------- reading logs


@dataclass(slots=True)
class _Scan:
    """One log file read through, damage and all."""

    size: int
    # (offset, end, record) of every intact record, in file order.
    records: list[tuple[int, int, Record]] = field(default_factory=list)
    # [start, end) byte ranges that are not intact records.
    bad: list[tuple[int, int]] = field(default_factory=list)

    @property
    def torn_at(self) -> int | None:
        """Where a torn tail starts: bad bytes with nothing valid after them."""
        if self.bad and self.bad[-1][1] == self.size:
            return self.bad[-1][0]
        return None

    @property
    def damaged(self) -> list[tuple[int, int]]:
        """Bad ranges followed by intact records: never cut silently."""
        return [r for r in self.bad if r[1] < self.size]

    def before(self, offset: int) -> list[Record]:
        return [rec for start, _, rec in self.records if start < offset]


def _record_at(view: memoryview, pos: int, end: int) -> tuple[Record, int] | None:
    if end - pos < _REC.size:
        return None
    length, crc = _REC.unpack_from(view, pos)
    if length > end - pos - _REC.size or length > _MAX_RECORD:
        return None
    body = view[pos + _REC.size : pos + _REC.size + length]
    if zlib.crc32(body) != crc:
        return None
    try:
        return _rec_decoder.decode(body), pos + _REC.size + length
    except msgspec.DecodeError:
        return None


def _scan(data: bytes) -> _Scan:
    view = memoryview(data)
    end = len(data)
    scan = _Scan(size=end)
    pos = 0
    while pos < end:
        found = _record_at(view, pos, end)
        if found is not None:
            scan.records.append((pos, found[1], found[0]))
            pos = found[1]
            continue
        nxt = pos + 1
        while nxt < end and _record_at(view, nxt, end) is None:
            nxt += 1
        scan.bad.append((pos, nxt))
        pos = nxt
    return scan


# Pure framing and scanning, shared with the in-memory store.
LogScan = _Scan
frame_record = _frame
scan_log = _scan


def _slurp(path: str | Path) -> bytes:
    # Unbuffered: one FileIO, its size read once (the start-up load reads
    # every session's files: a Path and a buffered reader cost as much).
    with open(path, "rb", buffering=0) as f:
        return f.readall()


def _read_scan(path: str | Path) -> _Scan:
    try:
        return _scan(_slurp(path))
    except FileNotFoundError:
        return _Scan(size=0)


def describe_damage(name: str, scan: _Scan) -> str:
    ranges = scan.damaged
    first = ranges[0][0]
    after = sum(1 for start, _, _ in scan.records if start > first)
    where = ", ".join(f"{a}-{b}" for a, b in ranges[:4]) + (", ..." if len(ranges) > 4 else "")
    return (
        f"{name} is corrupt at byte(s) {where} with {after} intact record(s) after the damage; "
        "the file is kept as it is. `sessionctl repair ID --skip-bad` keeps every intact record, "
        "`--truncate` keeps what precedes the damage, `sessionctl rm ID` deletes the session"
    )


# ---------------------------------------------------------------- snapshots


def _encode_snapshot(snap: Snapshot) -> bytes:
    body = msgspec.msgpack.encode(snap)
    return _SNAP_HEAD.pack(_SNAP_MAGIC, len(body), zlib.crc32(body)) + body


def _read_snapshot(path: str | Path) -> tuple[Snapshot | None, str]:
    """(snapshot, "") or (None, "") when there is none, or (None, why) when
    it is there but unreadable."""
    name = os.path.basename(path)
    try:
        data = _slurp(path)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise  # the daemon is out of fds, the file is fine: the caller refuses (`capacity`)
        return None, f"{name} cannot be read: {exc.strerror}"
    if data[:4] == _SNAP_MAGIC:
        if len(data) < _SNAP_HEAD.size:
            return None, f"{name} is truncated"
        _, length, crc = _SNAP_HEAD.unpack_from(data)
        body: bytes | memoryview = memoryview(data)[_SNAP_HEAD.size :]
        if len(body) != length or zlib.crc32(body) != crc:
            return None, f"{name} fails its checksum"
    else:
        # Written before snapshots had a checksum: msgpack can still
        # reject it, but a flipped byte inside may go unnoticed.
        body = data
    try:
        return _snap_decoder.decode(body), ""
    except msgspec.DecodeError as exc:
        return None, f"{name} cannot be decoded: {exc}"



read_scan = _read_scan
read_snapshot = _read_snapshot
encode_snapshot = _encode_snapshot
