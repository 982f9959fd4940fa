"""Durable session state in files: an append-only log per session plus snapshots.

Layout under `<state_dir>/sessions/<id>/`:

    fence          u64 fencing generation, bumped by every writer that opens the session
    log.<gen>      records, each `u32 length | u32 crc32 | msgpack`, appended
    snapshot       the session at the end of log.<gen-1>, replaced atomically;
                   `SNP1 | u32 length | u32 crc32 | msgpack` (older ones: bare msgpack)
    snapshot.prev  the snapshot it replaced, kept with its log as a fallback

Only the daemon writes here (workers send what a turn produced; the daemon
appends it).  Writing a turn costs O(the turn): one append and one fsync.
Every `snapshot_every_turns` turns the worker sends its handler's whole
state; the daemon writes `snapshot` (temp file, fsync, rename, fsync dir)
and opens `log.<gen+1>`.  The previous snapshot and its log are kept until
the next snapshot is durable, so a snapshot that fails its checksum falls
back to the previous generation (older snapshot, more log) instead of losing
the session.  Restoring reads at most one snapshot and two short logs.

Damage in a log is told apart by what follows it:
* a torn tail (power loss mid-append: the last record incomplete or failing
  its checksum, nothing valid after it) is cut with a warning; everything
  before it survives;
* damage followed by intact records (a flipped byte in the middle) is never
  cut: load raises `StoreDamaged` and leaves the files as they are, until
  the operator's `repair` keeps every intact record (skip_bad) or what
  precedes the damage (truncate).  Intact records after damage are found
  by trying every offset (length sane, checksum matches, decodes).

See `supervisor.state_store` for the promises and errors shared with other
stores.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from supervisor.logtag import tagged
from supervisor.state_store import (
    Abort,
    Commit,
    Fenced,
    InputRecord,
    LoadedSession,
    Mark,
    Meta,
    Record,
    RepairMode,
    RepairResult,
    Snapshot,
    StoreDamaged,
    StoreError,
    StoreFull,
    boot_state,
)

__all__ = [
    "Abort",
    "Commit",
    "FileStateStore",
    "Fenced",
    "LogScan",
    "InputRecord",
    "LoadedSession",
    "Meta",
    "Mark",
    "SessionStore",
    "Snapshot",
    "StoreDamaged",
    "StoreError",
    "StoreFull",
    "describe_damage",
    "frame_record",
    "scan_log",
]

log = logging.getLogger("sessiond.store")

_REC = struct.Struct(">II")
_SNAP_MAGIC = b"SNP1"
_SNAP_HEAD = struct.Struct(">4sII")
_FENCE = struct.Struct(">Q")
# No record is bigger than a worker frame (1 GiB); a larger length read
# while resynchronising is garbage, not a record.
_MAX_RECORD = 1 << 30
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

_rec_encoder = msgspec.msgpack.Encoder()
_rec_decoder = msgspec.msgpack.Decoder(Record)
_snap_decoder = msgspec.msgpack.Decoder(Snapshot)


def _write_error(what: str, exc: OSError) -> StoreError:
    """Our error for a failed write; `StoreFull` when space ran out, so that
    the client hears `no_space` and what to do, not `internal`."""
    if exc.errno == errno.EFBIG:
        return StoreFull(f"cannot write {what}: No space left on device "
                         "(the file size limit, RLIMIT_FSIZE, was reached)")
    if exc.errno in _FULL_ERRNOS:
        return StoreFull(f"cannot write {what}: {exc.strerror}; free some space in the state directory")
    return StoreError(f"cannot write {what}: {exc.strerror}")


def _bench_fdatasync() -> Callable[[int], None]:
    """`os.fdatasync`, or, for benchmarks only (bench/load.py), one that
    first sleeps SESSIOND_BENCH_FSYNC_DELAY_MS: a stand-in for a disk whose
    flush is slow (network block storage).  Not a setting: never set it
    in production."""
    delay = float(os.environ.get("SESSIOND_BENCH_FSYNC_DELAY_MS") or 0) / 1000
    if delay <= 0:
        return os.fdatasync

    def slow(fd: int) -> None:
        time.sleep(delay)
        os.fdatasync(fd)

    return slow


_fdatasync = _bench_fdatasync()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """os.write until done.  A short write (the disk filled up mid-record)
    is retried so that the real reason (ENOSPC, EFBIG) surfaces."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


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


def _read_scan(path: Path) -> _Scan:
    try:
        return _scan(path.read_bytes())
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


def _read_snapshot(path: Path) -> tuple[Snapshot | None, str]:
    """(snapshot, "") or (None, "") when there is none, or (None, why) when
    it is there but unreadable."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"{path.name} cannot be read: {exc.strerror}"
    if data[:4] == _SNAP_MAGIC:
        if len(data) < _SNAP_HEAD.size:
            return None, f"{path.name} is truncated"
        _, length, crc = _SNAP_HEAD.unpack_from(data)
        body = data[_SNAP_HEAD.size :]
        if len(body) != length or zlib.crc32(body) != crc:
            return None, f"{path.name} fails its checksum"
    else:
        # Written before snapshots had a checksum: msgpack can still
        # reject it, but a flipped byte inside may go unnoticed.
        body = data
    try:
        return _snap_decoder.decode(body), ""
    except msgspec.DecodeError as exc:
        return None, f"{path.name} cannot be decoded: {exc}"


def _log_gens(path: Path) -> list[int]:
    gens = []
    for p in path.glob("log.*"):
        suffix = p.name[4:]
        if suffix.isdigit():
            gens.append(int(suffix))
    return sorted(gens)


@dataclass(slots=True)
class _Plan:
    """How a session directory loads: which snapshot, which logs."""

    snap: Snapshot | None
    base: int  # logs >= base are replayed
    gens: list[int]  # the logs replayed, in order
    scans: dict[int, _Scan]
    fallback: str = ""  # non-empty: the snapshot was bad; why


def _plan(path: Path) -> _Plan:
    """Read a session directory without changing it; `StoreDamaged` if it
    cannot be loaded as it is."""
    sid = path.name
    snap, why = _read_snapshot(path / "snapshot")
    fallback = ""
    if why:
        prev, prev_why = _read_snapshot(path / "snapshot.prev")
        base = prev.gen if prev is not None else 0
        if prev_why or not (path / f"log.{base}").exists():
            meta = prev.meta if prev is not None else _meta_from_log(path / "log.0")
            raise StoreDamaged(
                sid,
                f"{why} and no previous generation is kept to fall back to; its state is "
                f"lost: `sessionctl rm {sid}` deletes it",
                meta=meta, repairable=False,
            )
        snap, fallback = prev, why
    base = snap.gen if snap is not None else 0
    gens = [g for g in _log_gens(path) if g >= base] or [base]
    scans = {g: _read_scan(path / f"log.{g}") for g in gens}
    for g in gens:
        if scans[g].damaged:
            meta = snap.meta if snap is not None else _meta_in(scans.get(0))
            raise StoreDamaged(sid, describe_damage(f"log.{g}", scans[g]), meta=meta)
    if snap is None and not any(isinstance(r, Meta) for s in scans.values() for _, _, r in s.records):
        raise StoreDamaged(sid, f"{path}: no metadata record (not a session directory?)",
                           repairable=False)
    return _Plan(snap, base, gens, scans, fallback)


def _meta_in(scan: _Scan | None) -> Meta | None:
    if scan is not None:
        for _, _, rec in scan.records:
            if isinstance(rec, Meta):
                return rec
    return None


def _meta_from_log(path: Path) -> Meta | None:
    return _meta_in(_read_scan(path))


def _take_fence(path: Path) -> tuple[int, int]:
    """A new fencing generation for `path`, durable before its writer writes
    anything, so that a writer holding an older one is refused from now on.
    Returns the kept-open fence file and the generation."""
    fd = os.open(path / "fence", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        raw = os.pread(fd, _FENCE.size, 0)
        generation = (_FENCE.unpack(raw)[0] if len(raw) == _FENCE.size else 0) + 1
        os.pwrite(fd, _FENCE.pack(generation), 0)
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        raise _write_error(f"{path.name}/fence", exc) from exc
    except BaseException:
        os.close(fd)
        raise
    return fd, generation


# ---------------------------------------------------------------- one session


class SessionStore:
    """One session's files, held by its one writer.  Runs in the daemon only."""

    def __init__(self, path: Path, gen: int, snap_gen: int = 0, base_gen: int = 0,
                 fence: tuple[int, int] | None = None) -> None:
        self.path = path
        self.gen = gen  # the log appended to
        self._snap_gen = snap_gen  # the current snapshot continues at this log
        self._base_gen = base_gen  # oldest log kept (the fallback's)
        self._fd = -1
        self._size = self._synced = 0
        self._fence_fd, self._generation = fence if fence is not None else _take_fence(path)
        try:
            self._open_log()
        except BaseException:
            if fence is None:  # else the caller closes what it passed
                os.close(self._fence_fd)
            raise

    @property
    def generation(self) -> int:
        return self._generation

    # ---------------------------------------------------------------- fencing

    def _check_fence(self) -> None:
        # One pread of 8 bytes from a kept-open file: about a microsecond
        # (bench in tests/test_store_contract.py), against an fsync's ms.
        if self._fence_fd < 0:
            raise StoreError(f"session {self.path.name}: this writer was closed")
        raw = os.pread(self._fence_fd, _FENCE.size, 0)
        current = _FENCE.unpack(raw)[0] if len(raw) == _FENCE.size else 0
        if current != self._generation:
            raise Fenced(self.path.name, self._generation, current)

    # ---------------------------------------------------------------- create / load

    @classmethod
    def create(cls, root: Path, meta: Meta, durable: bool = True) -> SessionStore:
        """A new session directory with its metadata record.  With
        durable=False the caller must call `make_durable()` before telling
        anyone the session exists (so the fsyncs can overlap other work)."""
        path = root / meta.id
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            raise
        except OSError as exc:
            raise _write_error(str(path), exc) from exc
        try:
            store = cls(path, 0)
            store.append(meta, durable=False)
            if durable:
                store.make_durable()
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return store

    def make_durable(self) -> None:
        """fsync the log and the directory entries that lead to it."""
        try:
            _fdatasync(self._fd)
            _fsync_dir(self.path)
            _fsync_dir(self.path.parent)
        except OSError as exc:
            raise _write_error(str(self.path), exc) from exc
        # Else a later failed sync() would cut the log back past the
        # metadata record that this fsync made durable.
        self._synced = self._size

    @classmethod
    def load(cls, path: Path) -> tuple[SessionStore, LoadedSession]:
        """Open for writing and read back.  `StoreDamaged` leaves every file
        as it was; a torn tail is cut, a bad snapshot falls back."""
        plan = _plan(path)
        # Fenced before anything changes: an older writer is refused from here on.
        fence = _take_fence(path)
        try:
            return cls._load(path, plan, fence)
        except BaseException:
            os.close(fence[0])
            raise

    @classmethod
    def _load(cls, path: Path, plan: _Plan, fence: tuple[int, int]) -> tuple[SessionStore, LoadedSession]:
        if plan.fallback:
            tagged(log, path.name).warning("%s; restored from the previous generation (%s and log(s) %s)",
                                           plan.fallback, "snapshot.prev" if plan.snap else "no snapshot",
                                           ", ".join(map(str, plan.gens)))
            # The previous generation becomes the current one on disk too,
            # so the next rotation keeps a good snapshot as its fallback.
            if plan.snap is not None:
                os.replace(path / "snapshot.prev", path / "snapshot")
            else:
                (path / "snapshot").unlink()
            _fsync_dir(path)
        snap = plan.snap
        loaded: LoadedSession | None = None
        if snap is not None:
            loaded = LoadedSession(meta=snap.meta, turns=snap.turns, seq=snap.seq, mark=snap.mark,
                                   usage=dict(snap.usage))
        for g in plan.gens:
            scan = plan.scans[g]
            torn = scan.torn_at
            if torn is not None:
                tagged(log, path.name).warning("log.%d: dropping %d bytes of a torn last record at offset %d",
                                               g, scan.size - torn, torn)
                with open(path / f"log.{g}", "r+b") as f:
                    f.truncate(torn)
                    os.fsync(f.fileno())
            for _, _, rec in scan.records:
                if loaded is None and isinstance(rec, Meta):
                    loaded = LoadedSession(meta=rec)
                elif loaded is not None:
                    loaded.apply(rec)
        assert loaded is not None  # _plan checked there is a Meta
        prev, _ = _read_snapshot(path / "snapshot.prev")
        base = prev.gen if prev is not None else 0
        # Logs older than the fallback's are folded into both snapshots.
        for g in _log_gens(path):
            if g < base:
                (path / f"log.{g}").unlink(missing_ok=True)
        snap_gen = snap.gen if snap is not None else 0
        return cls(path, plan.gens[-1], snap_gen, base, fence), loaded

    # ---------------------------------------------------------------- writing

    def _open_log(self) -> None:
        log_path = self.path / f"log.{self.gen}"
        try:
            self._fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _write_error(f"{self.path.name}/log.{self.gen}", exc) from exc
        self._size = self._synced = os.fstat(self._fd).st_size

    def append(self, record: Record, durable: bool) -> None:
        self._check_fence()
        frame = _frame(record)
        try:
            _write_all(self._fd, frame)
            if durable:
                _fdatasync(self._fd)
        except OSError as exc:
            # Cut back what may have landed, so the log ends on a whole record.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise _write_error(f"{self.path.name}/log.{self.gen}", exc) from exc
        self._size += len(frame)
        if durable:
            self._synced = self._size

    def sync(self) -> None:
        """Make every append so far durable; on failure the unsynced tail
        is cut off again, so the log never holds a record nobody was told
        was saved."""
        try:
            self._check_fence()
            _fdatasync(self._fd)
        except (OSError, Fenced) as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._synced)
            self._size = self._synced
            if isinstance(exc, Fenced):
                raise
            raise _write_error(f"{self.path.name}/log.{self.gen}", exc) from exc
        self._synced = self._size

    def write_snapshot(self, snap: Snapshot) -> None:
        """Start a new generation from a snapshot: the snapshot it replaces
        and that one's log stay as the fallback; older ones go."""
        self._check_fence()
        snap.gen = self.gen + 1
        tmp = self.path / "snapshot.tmp"
        cur = self.path / "snapshot"
        try:
            with open(tmp, "wb") as f:
                f.write(_encode_snapshot(snap))
                f.flush()
                os.fsync(f.fileno())
            new_base = self._snap_gen
            if cur.exists():
                # A hard link, then a rename: `snapshot.prev` is always
                # whole, and `snapshot` never missing.
                prev_tmp = self.path / "snapshot.prev.tmp"
                prev_tmp.unlink(missing_ok=True)
                os.link(cur, prev_tmp)
                os.replace(prev_tmp, self.path / "snapshot.prev")
            os.replace(tmp, cur)
            _fsync_dir(self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise _write_error(f"the snapshot of {self.path.name}", exc) from exc
        old_fd = self._fd
        self.gen += 1
        self._snap_gen = snap.gen
        self._open_log()
        os.close(old_fd)
        for g in _log_gens(self.path):
            if g < new_base:
                with contextlib.suppress(OSError):
                    (self.path / f"log.{g}").unlink()
        self._base_gen = new_base

    # ---------------------------------------------------------------- reading

    def read_for_boot(self) -> tuple[bytes, list[bytes], int]:
        """What a new worker needs: the handler snapshot, the records after
        it (non-empty ones, in order) and the committed turn count."""
        snap, why = _read_snapshot(self.path / "snapshot")
        if why:
            raise StoreError(f"session {self.path.name}: {why}; restart the daemon to fall back")
        records: list[Record] = []
        for g in range(self._snap_gen, self.gen + 1):
            scan = _read_scan(self.path / f"log.{g}")
            records.extend(rec for _, _, rec in scan.records)
        return boot_state(snap, records)

    def close(self) -> None:
        for attr in ("_fd", "_fence_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)

    def remove(self) -> None:
        self.close()
        _remove_dir(self.path)


def _never_created(path: Path) -> bool:
    """No snapshot and no byte of log: not even the metadata record landed."""
    if (path / "snapshot").exists() or (path / "snapshot.prev").exists():
        return False
    for g in _log_gens(path):
        if (path / f"log.{g}").stat().st_size:
            return False
    return True


def _remove_dir(path: Path) -> None:
    trash = path.with_name(f".deleted-{path.name}-{time.monotonic_ns()}")
    with contextlib.suppress(FileNotFoundError):
        os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


# ---------------------------------------------------------------- the store


class FileStateStore:
    """`StateStore` over a directory of session directories."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def create(self, meta: Meta, durable: bool = True) -> SessionStore:
        return SessionStore.create(self.root, meta, durable)

    def load(self, session_id: str) -> tuple[SessionStore, LoadedSession]:
        path = self.root / session_id
        if not path.is_dir() or _never_created(path):
            raise KeyError(session_id)
        return SessionStore.load(path)

    def ids(self) -> list[str]:
        out = []
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".deleted-"):
                # The daemon died while removing it.
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir() and not path.name.startswith("."):
                if _never_created(path):
                    # A create cut short by a crash before its fsync: it was
                    # never acknowledged, so it never existed.
                    log.info("removing %s: a session whose creation never completed", path)
                    _remove_dir(path)
                    continue
                out.append(path.name)
        return out

    def remove(self, session_id: str) -> None:
        _remove_dir(self.root / session_id)

    def repair(self, session_id: str, mode: RepairMode) -> RepairResult:
        """Rewrite each damaged log of a session atomically (temp file,
        fsync, rename, fsync dir), per `mode`.  A snapshot beyond repair
        stays beyond repair (StoreDamaged)."""
        path = self.root / session_id
        if not path.is_dir():
            raise KeyError(session_id)
        try:
            _plan(path)
        except StoreDamaged as exc:
            if not exc.repairable:
                raise
        else:
            return RepairResult(0, 0, 0)
        snap, _ = _read_snapshot(path / "snapshot")
        base = snap.gen if snap is not None else 0
        kept = dropped_records = dropped_bytes = 0
        for g in _log_gens(path):
            if g < base:
                continue
            log_path = path / f"log.{g}"
            data = log_path.read_bytes()
            scan = _scan(data)
            if not scan.bad:
                kept += len(scan.records)
                continue
            if mode is RepairMode.TRUNCATE:
                cut = scan.bad[0][0]
                keep = [(a, b) for a, b, _ in scan.records if a < cut]
                dropped_records += len(scan.records) - len(keep)
            else:
                keep = [(a, b) for a, b, _ in scan.records]
            kept += len(keep)
            dropped_bytes += sum(b - a for a, b in scan.bad)
            body = b"".join(data[a:b] for a, b in keep)
            tmp = path / f"log.{g}.repair"
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, log_path)
            _fsync_dir(path)
            tagged(log, session_id).warning("log.%d repaired (%s): %d record(s) kept, %d intact record(s) and "
                                            "%d damaged byte(s) dropped",
                                            g, mode.value, len(keep), len(scan.records) - len(keep),
                                            sum(b - a for a, b in scan.bad))
        return RepairResult(kept, dropped_records, dropped_bytes)
