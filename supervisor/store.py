"""Durable session state: an append-only log per session plus snapshots.

Layout under `<state_dir>/sessions/<id>/`:

    log.<gen>     records, each `u32 length | u32 crc32 | msgpack`, appended
    snapshot      the session at the end of log.<gen-1>, replaced atomically

Only the daemon writes here (workers send what a turn produced; the daemon
appends it).  Writing a turn costs O(the turn): one append and one fsync.
Every `snapshot_every_turns` turns the worker sends its handler's whole
state; the daemon writes `snapshot` (temp file, fsync, rename, fsync dir),
opens `log.<gen+1>` and deletes the old log, so restoring never reads more
than one snapshot and one short tail, whatever the history.

A torn or corrupt record at the end of a log (power loss mid-append) fails
its checksum; it is dropped with a warning and the file is cut back to the
last good record.  Everything before it survives.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "Abort",
    "Commit",
    "InputRecord",
    "LoadedSession",
    "Meta",
    "Mark",
    "SessionStore",
    "Snapshot",
    "StoreError",
]

log = logging.getLogger("sessiond.store")

_REC = struct.Struct(">II")


class _Rec(msgspec.Struct, tag_field="r", omit_defaults=True, kw_only=True):
    pass


class Meta(_Rec, tag="meta"):
    id: str
    handler: str
    overrides: dict[str, Any] = {}
    created_at: float = 0.0
    owner_uid: int = 0
    parent: str | None = None
    depth: int = 0
    # Name of the session's directory under the workspace root ("ID@TOKEN");
    # empty for sessions made before workspaces were named so (they use ID).
    workspace: str = ""
    # The uid its worker and tools run as, when the daemon gives each
    # session its own; kept so that its files stay its own across restarts.
    run_uid: int | None = None


class InputRecord(_Rec, tag="input"):
    turn: int
    text: str
    seq: int
    at: float = 0.0


class Commit(_Rec, tag="commit"):
    turn: int
    reply: str
    record: bytes = b""
    interrupted: bool = False
    seq: int = 0


class Abort(_Rec, tag="abort"):
    """A turn that failed or whose worker died; its input stays in the log."""

    turn: int
    reason: str
    record: bytes = b""
    seq: int = 0


class Mark(_Rec, tag="mark"):
    """State worth keeping across a daemon restart, and seq reservations."""

    state: str = ""  # "stopped", "failed" or "" (live/hibernated)
    reason: str = ""
    seq: int = 0  # seq numbers up to this one may have been used
    restarts: int = 0
    last_exit: dict[str, Any] | None = None


Record = Meta | InputRecord | Commit | Abort | Mark


class Snapshot(msgspec.Struct, kw_only=True):
    gen: int  # the log generation that continues this snapshot
    meta: Meta
    turns: int
    seq: int
    handler_state: bytes = b""
    mark: Mark = msgspec.field(default_factory=Mark)


_rec_encoder = msgspec.msgpack.Encoder()
_rec_decoder = msgspec.msgpack.Decoder(Record)
_snap_decoder = msgspec.msgpack.Decoder(Snapshot)


class StoreError(Exception):
    """A write that did not become durable; nothing was acknowledged."""


@dataclass(slots=True)
class LoadedSession:
    meta: Meta
    turns: int = 0
    seq: int = 0
    mark: Mark = field(default_factory=Mark)
    # The last input had no commit/abort: its worker (or the daemon) died.
    open_input: InputRecord | None = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SessionStore:
    """One session's files.  Runs in the daemon only."""

    def __init__(self, path: Path, gen: int) -> None:
        self.path = path
        self.gen = gen
        self._fd = -1
        self._size = 0
        self._open_log()

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
            raise StoreError(f"cannot create {path}: {exc.strerror}") from exc
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
            os.fdatasync(self._fd)
            _fsync_dir(self.path)
            _fsync_dir(self.path.parent)
        except OSError as exc:
            raise StoreError(f"cannot write {self.path}: {exc.strerror}") from exc

    @classmethod
    def load(cls, path: Path) -> tuple[SessionStore, LoadedSession]:
        snap: Snapshot | None = None
        snap_path = path / "snapshot"
        if snap_path.exists():
            snap = _snap_decoder.decode(snap_path.read_bytes())
        gen = snap.gen if snap is not None else 0
        # Logs older than the snapshot's generation are already folded in.
        for old in path.glob("log.*"):
            suffix = old.name[4:]
            if suffix.isdigit() and int(suffix) < gen:
                old.unlink(missing_ok=True)
        loaded: LoadedSession | None = None
        if snap is not None:
            loaded = LoadedSession(meta=snap.meta, turns=snap.turns, seq=snap.seq, mark=snap.mark)
        records, _ = _read_log(path / f"log.{gen}", truncate=True)
        for rec in records:
            match rec:
                case Meta():
                    if loaded is None:
                        loaded = LoadedSession(meta=rec)
                case InputRecord():
                    assert loaded is not None
                    loaded.turns = rec.turn
                    loaded.seq = max(loaded.seq, rec.seq)
                    loaded.open_input = rec
                case Commit() | Abort():
                    assert loaded is not None
                    loaded.seq = max(loaded.seq, rec.seq)
                    if loaded.open_input is not None and loaded.open_input.turn == rec.turn:
                        loaded.open_input = None
                case Mark():
                    assert loaded is not None
                    loaded.seq = max(loaded.seq, rec.seq)
                    loaded.mark = rec
        if loaded is None:
            raise StoreError(f"{path}: no metadata record (not a session directory?)")
        return cls(path, gen), loaded

    # ---------------------------------------------------------------- writing

    def _open_log(self) -> None:
        log_path = self.path / f"log.{self.gen}"
        self._fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._size = self._synced = os.fstat(self._fd).st_size

    def append(self, record: Record, durable: bool) -> None:
        body = _rec_encoder.encode(record)
        frame = _REC.pack(len(body), zlib.crc32(body)) + body
        try:
            written = os.write(self._fd, frame)
            if written != len(frame):
                raise OSError(errno.ENOSPC, "short write")
            if durable:
                os.fdatasync(self._fd)
        except OSError as exc:
            # Cut back what may have landed, so the log ends on a whole record.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise StoreError(f"cannot write {self.path.name}/log.{self.gen}: {exc.strerror}") from exc
        self._size += len(frame)
        if durable:
            self._synced = self._size

    def sync(self) -> None:
        """Make every append so far durable; on failure the unsynced tail
        is cut off again, so the log never holds a record nobody was told
        was saved."""
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._synced)
            self._size = self._synced
            raise StoreError(f"cannot write {self.path.name}/log.{self.gen}: {exc.strerror}") from exc
        self._synced = self._size

    def write_snapshot(self, snap: Snapshot) -> None:
        """Replace the log with a snapshot and an empty next-generation log."""
        snap.gen = self.gen + 1
        tmp = self.path / "snapshot.tmp"
        data = msgspec.msgpack.encode(snap)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path / "snapshot")
            _fsync_dir(self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreError(f"cannot write the snapshot of {self.path.name}: {exc.strerror}") from exc
        old_fd, old_gen = self._fd, self.gen
        self.gen += 1
        self._open_log()
        os.close(old_fd)
        with contextlib.suppress(OSError):
            (self.path / f"log.{old_gen}").unlink()

    # ---------------------------------------------------------------- reading

    def read_for_boot(self) -> tuple[bytes, list[bytes], int]:
        """What a new worker needs: the handler snapshot, the records after
        it (non-empty ones, in order) and the committed turn count."""
        state = b""
        turns = 0
        snap_path = self.path / "snapshot"
        if snap_path.exists():
            snap = _snap_decoder.decode(snap_path.read_bytes())
            state, turns = snap.handler_state, snap.turns
        records, _ = _read_log(self.path / f"log.{self.gen}", truncate=False)
        tail: list[bytes] = []
        for rec in records:
            if isinstance(rec, (Commit, Abort)):
                turns = max(turns, rec.turn)
                if rec.record:
                    tail.append(rec.record)
        return state, tail, turns

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> None:
        self.close()
        trash = self.path.with_name(f".deleted-{self.path.name}-{time.monotonic_ns()}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _read_log(path: Path, truncate: bool) -> tuple[list[Record], int]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    records: list[Record] = []
    pos, end = 0, len(data)
    view = memoryview(data)
    while pos < end:
        if end - pos < _REC.size:
            break
        length, crc = _REC.unpack_from(view, pos)
        body = view[pos + _REC.size : pos + _REC.size + length]
        if len(body) != length or zlib.crc32(body) != crc:
            break
        try:
            records.append(_rec_decoder.decode(body))
        except msgspec.DecodeError:
            break
        pos += _REC.size + length
    if pos < end:
        log.warning(
            "%s: dropping %d bytes of torn or corrupt records after offset %d",
            path, end - pos, pos,
        )
        if truncate:
            with open(path, "r+b") as f:
                f.truncate(pos)
                os.fsync(f.fileno())
    return records, pos
