"""Durable session state in files: an append-only log per session plus snapshots.

Layout under `<state_dir>/sessions/<id>/`:

    fence          u64 fencing generation, bumped by every writer that opens the session
                   (at the daemon's start: by its first write, `SessionStore.opened`)
    log.<gen>      records, each `u32 length | u32 crc32 | msgpack`, appended
    snapshot       the session at the end of log.<gen-1>, replaced atomically;
                   `SNP1 | u32 length | u32 crc32 | msgpack` (older ones: bare msgpack)
    snapshot.prev  the snapshot it replaced, kept with its log as a fallback

Only the daemon writes here (workers send what a turn produced; the daemon
appends it).  Writing a turn costs O(the turn): one append here, and the
same frame in the daemon-wide journal (supervisor.store.journal), whose group
commit makes it durable; the logs themselves are fsync'd at the journal's
checkpoints.  A `SessionStore` opened without a journal (tools, tests of
one session) fdatasyncs its own log instead.
Every `snapshot_every_turns` turns the worker sends its handler's whole
state; the daemon opens `log.<gen+1>` and writes `snapshot` (temp file,
fsync, rename, fsync dir; with a journal, in a background thread).  The previous snapshot and its log are kept until
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
  by trying every offset (length sane, checksum matches, decodes);
* records a damaged journal lost and the log lacks (supervisor.store.replay):
  replay leaves the hole in the log and a note, `journal-damage`, saying
  why; load raises `StoreDamaged` until `repair`, which removes the note.

See `supervisor.store.state_store` for the promises and errors shared with other
stores.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
from pathlib import Path

from supervisor.store import dirplan
from supervisor.store.dirplan import check_damage as _check_damage
from supervisor.store.journal import Journal
from supervisor.store.replay import clear_damage_note
from supervisor.store.sessiondir import fsync_dir as _fsync_dir
from supervisor.store.sessiondir import FENCE as _FENCE
from supervisor.store.sessiondir import Listing
from supervisor.store.sessiondir import log_gens as _log_gens
from supervisor.store.sessiondir import remove_dir as _remove_dir
from supervisor.store.sessiondir import write_snapshot_files as _snapshot_files
from supervisor.store.journal import fdatasync as _fdatasync
from supervisor.store.journal import write_all as _write_all
from supervisor.store.journal import write_error as _write_error
from supervisor.store.journal import full_error as _full_error
from supervisor.store.logscan import (
    LogScan,
    describe_damage,
    encode_snapshot as _encode_snapshot,
    frame_record,
    read_scan as _read_scan,
    read_snapshot as _read_snapshot,
    scan_log,
)
from supervisor.logtag import tagged
from supervisor.errors import Fenced, StoreDamaged, StoreError, StoreFull
from supervisor.store.state_store import (
    Abort,
    Commit,
    InputRecord,
    LoadedSession,
    Mark,
    Meta,
    Record,
    Snapshot,
    StepRecord,
    boot_state,
    settled,
    turn_steps,
)

__all__ = ["Abort", "Commit", "Fenced", "LogScan", "InputRecord", "LoadedSession", "Meta", "Mark",
           "SessionStore", "Snapshot", "StoreDamaged", "StoreError", "StoreFull", "describe_damage", "frame_record",
           "erase_dir", "scan_log"]

log = logging.getLogger("sessiond.store")


def _take_fence(path: Path, sync: bool = True) -> tuple[int, int]:
    """A new fencing generation for `path`, durable before its writer writes
    anything, so that a writer holding an older one is refused from now on.
    Returns the kept-open fence file and the generation.  sync=False: a new
    session's, made durable by `make_durable` before the session exists."""
    fd = os.open(path / "fence", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        raw = os.pread(fd, _FENCE.size, 0)
        generation = (_FENCE.unpack(raw)[0] if len(raw) == _FENCE.size else 0) + 1
        os.pwrite(fd, _FENCE.pack(generation), 0)
        if sync:
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
    """One session's files, held by its one writer.  Runs in the daemon only.
    Lean (slots; its directory a string, a Path made when used): the
    daemon keeps one per session, hibernated ones included."""

    __slots__ = ("_root", "name", "_journal", "gen", "_snap_gen", "_fd", "_size", "_synced",
                 "_opened", "_log_path", "_snapshotting", "_rest", "_released", "_closed", "_fence_fd",
                 "_generation", "_untaken")

    def __init__(self, path: Path, gen: int, snap_gen: int = 0,
                 fence: tuple[int, int] | None = None, journal: Journal | None = None,
                 new: bool = False, *, seen_fence: int | None = None, size: int = 0) -> None:
        self._root = sys.intern(str(path.parent))  # (one string for every session)
        self.name = path.name  # the session's id
        # With a journal (the daemon's), appends are made durable by the
        # journal's group commit; without one (tools, tests of one session),
        # by this log's own fdatasync.
        self._journal = journal
        self.gen = gen  # the log appended to
        self._snap_gen = snap_gen  # the current snapshot continues at this log
        self._fd = -1
        self._size = self._synced = self._opened = size
        self._log_path = f"{self._dir}/log.{gen}"
        self._snapshotting = False
        # At rest (at_rest()): its files are closed (released) once all is
        # durable, and opened again by the next write; closed: for good.
        # A loaded session starts at rest: it has no worker yet.
        self._rest = self._released = self._closed = False
        # Opened without a write (`opened`: the daemon's start): the generation
        # after `seen_fence` is taken, durably, before its first write, if
        # the fence still holds `seen_fence` then (else a newer writer has it).
        self._untaken = seen_fence
        if seen_fence is not None:
            self._fence_fd, self._generation = -1, seen_fence + 1
            self._rest = self._released = True
            return
        self._fence_fd, self._generation = fence if fence is not None else _take_fence(path, sync=not new)
        try:
            self._open_log()
        except BaseException:
            if fence is None:  # else the caller closes what it passed
                os.close(self._fence_fd)
            raise

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def path(self) -> Path:
        return Path(self._dir)

    @property
    def _dir(self) -> str:
        return f"{self._root}/{self.name}"

    # ---------------------------------------------------------------- fencing

    def _check_fence(self, writing: bool = True) -> None:
        """Fenced if another writer took the session.  Before a write (the
        default) a session at rest has its files opened again; otherwise
        its fence is read without keeping it."""
        if self._closed:
            raise StoreError(f"session {self.name}: this writer was closed")
        if self._released and writing:
            self._reopen()
        # One pread of 8 bytes from a kept-open file: about a microsecond
        # (bench in tests/test_store_contract.py), against an fsync's ms.
        if self._released:
            try:
                with open(f"{self._dir}/fence", "rb") as f:
                    raw = f.read(_FENCE.size)
            except OSError as exc:
                raise _write_error(f"{self.name}/fence", exc) from exc
        else:
            raw = os.pread(self._fence_fd, _FENCE.size, 0)
        current = _FENCE.unpack(raw)[0] if len(raw) == _FENCE.size else 0
        if current != (self._generation if self._untaken is None else self._untaken):
            raise Fenced(self.name, self._generation, current)

    def _take(self, fd: int) -> None:
        """The generation an `opened` store was given, taken now, before its
        first write: durable, as `_take_fence` makes one."""
        assert self._untaken is not None
        raw = os.pread(fd, _FENCE.size, 0)
        current = _FENCE.unpack(raw)[0] if len(raw) == _FENCE.size else 0
        if current != self._untaken:
            raise Fenced(self.name, self._generation, current)
        if self._journal is not None:
            self._journal.settle(self.path)
        try:
            os.pwrite(fd, _FENCE.pack(self._generation), 0)
            os.fsync(fd)
        except OSError as exc:
            raise _write_error(f"{self.name}/fence", exc) from exc
        self._untaken = None

    # ---------------------------------------------------------------- create / load

    @classmethod
    def create(cls, root: Path, meta: Meta, durable: bool = True,
               journal: Journal | None = None) -> SessionStore:
        """A new session directory with its metadata record.  With
        durable=False the caller must call `make_durable()` before telling
        anyone the session exists (so the fsyncs can overlap other work)."""
        path = root / meta.id
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            raise
        except OSError as exc:
            raise _full_error(str(path), exc, journal) from exc
        try:
            store = cls(path, 0, journal=journal, new=True)
            store.append(meta, durable=False)
            if durable:
                store.make_durable()
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return store

    def make_durable(self) -> None:
        """fsync the log (or the journal that holds it) and the directory
        entries that lead to it."""
        try:
            os.fsync(self._fence_fd)
            if self._journal is not None:
                # Also makes a tombstone of an earlier session of this id
                # durable before this one exists (see supervisor.store.journal).
                self._journal.sync_now()
            else:
                _fdatasync(self._fd)
            _fsync_dir(self.path)
            _fsync_dir(self.path.parent)
        except OSError as exc:
            raise _write_error(str(self.path), exc) from exc
        # Else a later failed sync() would cut the log back past the
        # metadata record that this fsync made durable.
        self._synced = self._size

    def make_durable_soon(self) -> asyncio.Future[None]:
        """`make_durable` without blocking the loop: the journal's flush
        and, in the background thread, the fence and directory fsyncs."""
        journal = self._journal
        loop = asyncio.get_running_loop()
        if journal is None:
            return settled(self.make_durable)
        return loop.create_task(self._durable(loop, journal))

    async def _durable(self, loop: asyncio.AbstractEventLoop, journal: Journal) -> None:
        files: asyncio.Future[None] = loop.create_future()
        fence_fd, path = self._fence_fd, self.path

        def fsyncs() -> None:
            os.fsync(fence_fd)
            _fsync_dir(path)
            _fsync_dir(path.parent)

        def then(err: OSError | None) -> None:
            if files.done():
                return
            if err is not None:
                files.set_exception(_write_error(str(path), err))
            else:
                files.set_result(None)

        flush = journal.sync_soon()
        journal.in_background(fsyncs, then)
        try:
            await flush
        finally:
            await files  # both done before the create is answered, either way

    @classmethod
    def load(cls, path: Path, journal: Journal | None = None,
             listed: Listing | None = None) -> tuple[SessionStore, LoadedSession]:
        """Open for writing and read back, fenced at once.  `StoreDamaged`
        leaves every file as it was; a torn tail is cut, a bad snapshot
        falls back; KeyError where a create was cut short."""
        found = dirplan.read(path, listed)
        if found is None:
            raise KeyError(path.name)
        if journal is not None:  # then fenced: an older writer is refused from here on
            journal.settle(path)
        fence = _take_fence(path)
        try:
            dirplan.settle(path, found.plan)
            store = cls(path, found.plan.gens[-1], found.plan.snap.gen if found.plan.snap else 0, fence, journal)
        except BaseException:
            os.close(fence[0])
            raise
        store.at_rest(True)  # no worker yet: its files close until it is written to
        return store, found.loaded

    @classmethod
    def opened(cls, found: dirplan.Read, path: Path, journal: Journal | None) -> tuple[SessionStore, LoadedSession]:
        """`load` for the daemon's start, from what `dirplan.read` found:
        nothing is written unless the directory needs it (a torn tail, a
        fallback); its generation is taken at its first write."""
        p = found.plan
        size = dirplan.settle(path, p)
        store = cls(path, p.gens[-1], p.snap.gen if p.snap else 0, journal=journal, seen_fence=found.fence,
                    size=size)
        return store, found.loaded

    # ---------------------------------------------------------------- writing

    def _open_log(self) -> None:
        # Kept (made when the gen changes): the journal notes it on every
        # append (a Path built per append cost ~15 µs in the profile; a
        # string costs less to keep, and one string serves every reopening).
        log_path = self._log_path
        try:
            self._fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _write_error(f"{self.name}/log.{self.gen}", exc) from exc
        self._size = self._synced = self._opened = os.fstat(self._fd).st_size

    def append(self, record: Record, durable: bool) -> None:
        self._check_fence()
        frame = frame_record(record)
        offset = self._size
        try:
            _write_all(self._fd, frame)
            if self._journal is not None:
                self._journal.write(self, self.name, self.gen, offset, self._generation, frame,
                                    self._log_path)
            elif durable:
                _fdatasync(self._fd)
        except (OSError, StoreError) as exc:
            # Cut back what may have landed, so the log ends on a whole record.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, offset)
            self._maybe_release()
            if isinstance(exc, StoreError):
                raise
            raise _full_error(f"{self.name}/log.{self.gen}", exc, self._journal) from exc
        self._size = offset + len(frame)
        if durable:
            if self._journal is not None:
                self._journal.sync_now()
            self._synced = self._size
            self._maybe_release()

    def sync(self) -> None:
        """Make every append so far durable; on failure the unsynced tail
        is cut off again, so the log never holds a record nobody was told
        was saved."""
        try:
            self._check_fence()
            if self._journal is not None:
                self._journal.sync_now()  # cuts back every unsynced log on failure
                return
            _fdatasync(self._fd)
        except (OSError, Fenced) as exc:
            self.discard_unsynced()
            if isinstance(exc, Fenced):
                raise
            raise _write_error(f"{self.name}/log.{self.gen}", exc) from exc
        self._synced = self._size
        self._maybe_release()

    def sync_soon(self) -> asyncio.Future[None]:
        """Every append so far durable, without blocking the loop: the
        journal's group commit (one fdatasync for whatever all sessions
        have pending, in its thread).  Fails with StoreError, every append
        not yet durable cut back."""
        if self._journal is None:
            fut = asyncio.get_running_loop().create_future()
            try:
                self.sync()
            except StoreError as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)
            return fut
        if self._size == self._synced:
            # Else the appends being synced were fence-checked a moment ago.
            self._check_fence(writing=False)
        return self._journal.sync_soon()

    # The journal's side (supervisor.store.journal.Tail), on the loop.

    def mark_synced(self, log_gen: int, size: int) -> None:
        if log_gen == self.gen and self._synced < size <= self._size:
            self._synced = size
            self._maybe_release()

    def discard_unsynced(self) -> None:
        if self._fd < 0 or self._size == self._synced:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._synced)
            if self._journal is not None:
                # Or a record nobody was told was saved could come back
                # from the page cache after a crash.
                os.fsync(self._fd)
        self._size = self._synced

    def write_snapshot(self, snap: Snapshot) -> None:
        """Start a new generation from a snapshot: the snapshot it replaces
        and that one's log stay as the fallback; older ones go.  With a
        journal the files are written by its writer thread, off the loop:
        appends go to the next log at once (loading replays every log from
        whichever snapshot is on disk, so either is consistent), and older
        logs go once the snapshot is durable.  A snapshot still being
        written makes this one a no-op (the log keeps every turn)."""
        self._check_fence()
        if self._snapshotting:
            return
        snap.gen = self.gen + 1
        data, new_base, path = _encode_snapshot(snap), self._snap_gen, self.path
        if self._journal is None:
            try:
                _snapshot_files(path, data, snap.gen)
            except OSError as exc:
                raise _write_error(f"the snapshot of {path.name}", exc) from exc
            self._next_log()
            self._snapshot_done(snap.gen, new_base, None)
            return
        # The next log's directory entry is not durable yet: the journal
        # notes its creation, so replay can make it again.
        os.close(os.open(path / f"log.{snap.gen}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        self._journal.log_created(self.name, snap.gen, self._generation, f"{self._dir}/log.{snap.gen}")
        self._next_log()
        self._snapshotting = True
        self._journal.in_background(lambda: _snapshot_files(path, data, snap.gen),
                                    lambda err: self._snapshot_done(snap.gen, new_base, err))

    def write_snapshot_soon(self, snap: Snapshot) -> asyncio.Future[None]:
        # Already off the loop with a journal (its writer thread writes the
        # files; a failure is logged); without one, done here.
        return settled(lambda: self.write_snapshot(snap))

    def _next_log(self) -> None:
        old_fd = self._fd
        self.gen += 1
        self._log_path = f"{self._dir}/log.{self.gen}"
        self._open_log()
        os.close(old_fd)

    def _snapshot_done(self, snap_gen: int, new_base: int, err: OSError | None) -> None:
        self._snapshotting = False
        self._maybe_release()
        if err is not None:
            tagged(log, self.name).warning("%s (the log still holds every turn)",
                                                _full_error(f"the snapshot of {self.name}", err, self._journal))
            return
        self._snap_gen = snap_gen
        for g in _log_gens(self.path):
            if g < new_base:
                with contextlib.suppress(OSError):
                    (self.path / f"log.{g}").unlink()

    # ---------------------------------------------------------------- reading

    def read_for_boot(self) -> tuple[bytes, list[bytes], int]:
        """What a new worker needs: the handler snapshot, the records after
        it (non-empty ones, in order) and the committed turn count."""
        snap, why = _read_snapshot(self.path / "snapshot")
        if why:
            raise StoreError(f"session {self.name}: {why}; restart the daemon to fall back")
        # The snapshot's own gen: one being written may have landed already.
        return boot_state(snap, self._records(snap, snap.gen if snap is not None else 0))

    def _records(self, snap: Snapshot | None, first: int, last: int | None = None) -> list[Record]:
        """The intact records of log.`first` to the current one; StoreDamaged
        where the start-up load would find the session damaged.  (A torn
        tail is not damage: a read in a thread may meet an append half
        written; the loop's own appends are whole.)"""
        scans = {g: _read_scan(self.path / f"log.{g}") for g in range(first, (self.gen if last is None else last) + 1)}
        _check_damage(self.path, snap, scans)
        return [rec for scan in scans.values() for _, _, rec in scan.records]

    def read_for_boot_soon(self) -> asyncio.Future[tuple[bytes, list[bytes], int]]:
        # A local read of one snapshot and a short log or two: done here.
        return settled(self.read_for_boot)

    def read_history(self) -> tuple[Snapshot | None, list[Record]]:
        """The snapshot and every record after it, as stored (history, export)."""
        snap, why = _read_snapshot(self.path / "snapshot")
        if why:
            raise StoreError(f"session {self.name}: {why}")
        return snap, self._records(snap, self._snap_gen)

    def read_history_soon(self) -> asyncio.Future[tuple[Snapshot | None, list[Record]]]:
        # Local files: read here (api/transfer.py reads them in a thread).
        return settled(self.read_history)

    def read_steps_soon(self, turn: int) -> asyncio.Future[list[StepRecord]]:
        # In a thread (tens of MB); the logs it reads stay meanwhile (a
        # snapshot comes after a commit, and removes only older logs).
        first, last = self._snap_gen, self.gen
        return asyncio.ensure_future(asyncio.to_thread(
            lambda: turn_steps(self._records(None, first, last), turn)))

    # ---------------------------------------------------------------- files held

    def at_rest(self, rest: bool) -> None:
        """The session has no worker (hibernated, stopped, failed: how every
        loaded session starts) or has one again.  At rest its files are
        closed whenever every append is durable, and opened again by the
        next write (fenced as ever: a generation another writer took
        meanwhile is found then), so that a session at rest holds no fd of
        the daemon's, whatever the count of sessions."""
        self._rest = rest
        self._maybe_release()

    def _maybe_release(self) -> None:
        # Not while an append waits for its group commit (the journal
        # cuts it back through this fd on failure) or a snapshot is made.
        if (self._rest and not self._closed and not self._released and self._size == self._synced
                and not self._snapshotting):
            self._close_files()
            self._released = True

    def _reopen(self) -> None:
        try:
            fd = os.open(f"{self._dir}/fence", os.O_RDWR | os.O_CLOEXEC | os.O_CREAT, 0o600)
        except OSError as exc:
            raise _write_error(f"{self.name}/fence", exc) from exc
        if self._untaken is not None:
            try:
                self._take(fd)
            except BaseException:
                os.close(fd)
                raise
        self._fence_fd, self._released = fd, False
        opened = self._opened  # (what this writer found in the log: tests' crashes cut back to it)
        try:
            self._open_log()
            self._opened = opened
        except BaseException:
            self._close_files()
            self._released = True
            raise

    def _close_files(self) -> None:
        for attr in ("_fd", "_fence_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)

    def close(self) -> None:
        self._close_files()
        self._closed = True

    def remove(self) -> None:
        if self._journal is not None:
            self._journal.forget(self.name)
        self.close()
        erase_dir(self.path, self._journal)

    def remove_soon(self) -> asyncio.Future[None]:
        return settled(self.remove)


def erase_dir(path: Path, journal: Journal | None) -> None:
    """A removed session's content, wherever this store can reach it at
    once: its directory (logs, snapshots), a damaged journal kept for it
    alone, and its records in the live journal (a checkpoint)."""
    if path.is_dir():
        with contextlib.suppress(OSError):
            clear_damage_note(path, path.parent)
    _remove_dir(path)
    if journal is not None:
        journal.erase(path.name)
