"""Group commit: one daemon-wide journal, made durable off the event loop.

Every record appended to a session's log (`log.<gen>`, see supervisor.store.files)
is also appended to this daemon's journal, `<sessions>/.journal/<id>.wal`,
as `u32 length | u32 crc32 | msgpack[session, log gen, offset, fence gen,
the log frame]`.  Only the journal is fdatasync'd on the hot path: a writer
thread fsyncs it for whatever is pending, however many sessions wrote, and
then completes every waiting append on the loop (`call_soon_threadsafe`).
The session logs are written (page cache) but fsync'd only at a checkpoint.

Why one journal and not a batch of per-session fsyncs: measured here
(bench/fsync_batch.py, ext4, 2 vCPUs), making 50 sessions' appends durable
took 9.5 ms as 50 fdatasyncs in a row, 5.1 ms from 8 threads at once, 1.8 ms
as one syncfs, and 0.40 ms as one append + fdatasync of a shared journal
(200 sessions: 28 / 15 / 5.1 / 0.71 ms).

Threads and processes: `write`, `sync_soon`, `sync_now`, `forget` run on the
daemon's loop, which is the only writer of every file; the writer thread
only calls fdatasync/fsync and, at a checkpoint, unlinks a retired journal.

Promises (those of supervisor.store.state_store, unchanged):
* a waiting append completes only after an fdatasync of the journal that
  began after it was written;
* a failed fdatasync fails every append not yet durable (exactly the
  waiting ones) and cuts them off again, from the journal and from their
  session logs, so none of them is acknowledged or comes back on restart;
  a new epoch makes any in-flight result of the writer thread stale;
* a write that runs out of space raises `StoreFull` at once and leaves
  nothing half-written; it also starts a checkpoint (`free_space`), so the
  journal's copy of what the logs hold goes without waiting for 64 MiB;
* a removed session's records leave the journal at once (`erase`: a
  checkpoint), not at the next 64 MiB.

Crash recovery (`replay`, when the store opens, before any session loads)
is supervisor.store.replay: every journal not locked by a live daemon is
replayed into the logs' tails, then the logs are fsync'd and the journals
deleted; a damaged one is replayed record by record, kept, and the sessions
it could not complete are left damaged until `repair` (never a silent loss).

Checkpoint: past `_CHECKPOINT_BYTES`, the journal is synced on the loop,
a new one is started, and the writer thread fsyncs every log the old one
covered (and their directories), then deletes it.  If that fails the old
journal stays and is replayed at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from supervisor.errors import StoreError, StoreFull
from supervisor.store.replay import REC as _REC
from supervisor.store.replay import TOMBSTONE as _TOMBSTONE
from supervisor.store.replay import JRec as _JRec
from supervisor.store.replay import encoder as _encoder
from supervisor.store.replay import fsync_path as _fsync_path
from supervisor.store.replay import replay

__all__ = ["FSYNC_DELAY_SECS", "Journal", "fdatasync", "full_error", "write_all", "write_error"]

log = logging.getLogger("sessiond.store")

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_CHECKPOINT_BYTES = 64 << 20

# For benchmarks only (bench/load.py): every log or journal fdatasync first
# sleeps this long, a stand-in for a disk whose flush is slow (network block
# storage).  Not a setting: never set SESSIOND_BENCH_FSYNC_DELAY_MS in production.
FSYNC_DELAY_SECS = float(os.environ.get("SESSIOND_BENCH_FSYNC_DELAY_MS") or 0) / 1000


def fdatasync(fd: int) -> None:
    if FSYNC_DELAY_SECS > 0:
        time.sleep(FSYNC_DELAY_SECS)
    os.fdatasync(fd)


def write_error(what: str, exc: OSError, where: Path | None = None) -> StoreError:
    """Our error for a failed write; `StoreFull` when space ran out, so that
    the client hears `no_space` and what to do, not `internal`.  `where`:
    the directory whose file system is full, named to whoever reads it."""
    if exc.errno == errno.EFBIG:
        return StoreFull(f"cannot write {what}: No space left on device "
                         "(the file size limit, RLIMIT_FSIZE, was reached)")
    if exc.errno in _FULL_ERRNOS:
        place = f" ({where})" if where is not None else ""
        return StoreFull(f"cannot write {what}: {exc.strerror}; free some space in the state directory{place}")
    return StoreError(f"cannot write {what}: {exc.strerror}")


def full_error(what: str, exc: OSError, journal: Journal | None) -> StoreError:
    """`write_error`, and when space ran out (not the file size limit) the
    journal checkpoints at once, since it holds a second copy of what the
    logs hold (`Journal.free_space`), and the error says so."""
    err = write_error(what, exc, journal.root if journal is not None else None)
    if isinstance(err, StoreFull) and journal is not None and exc.errno != errno.EFBIG:
        return StoreFull(f"{err}; {journal.free_space()}")
    return err


def write_all(fd: int, data: bytes) -> None:
    """os.write until done.  A short write (the disk filled up mid-record)
    is retried so that the real reason (ENOSPC, EFBIG) surfaces."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]



class Tail(Protocol):
    """What the journal needs of a session log it covers (loop only)."""

    def mark_synced(self, log_gen: int, size: int) -> None: ...

    def discard_unsynced(self) -> None: ...


def _open_journal(jdir: Path) -> tuple[int, Path]:
    path = jdir / f"{time.time_ns():020d}-{os.getpid()}.wal"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd, path


class Journal:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir = root / ".journal"
        self.dir.mkdir(mode=0o700, exist_ok=True)
        # The sessions the journals of a daemon gone wrote (supervisor.store.filestore.FileStateStore.listed).
        self.recent = frozenset(replay(self.dir, root))
        self._fd, self._path = _open_journal(self.dir)
        _fsync_path(self.dir, directory=True)
        # Log sequence numbers: byte positions in the journals of this
        # daemon, as if they were one file.  Loop only.
        self._base = self._end = self._synced = 0
        self._pending: deque[tuple[int, Tail, int, int]] = deque()  # (lsn end, log, log gen, size after)
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        # Logs written since this journal began (strings: one per session written, kept until a checkpoint).
        self._dirty: set[str] = set()
        self._sids: set[str] = set()  # sessions written since this journal began (erase)
        self._erasing = False  # a checkpoint for removed sessions is scheduled
        # Shared with the writer thread, under _cond; the thread sleeps in a
        # read of an eventfd that `_wake` writes.  (A threading.Condition
        # costs a lock allocation and more GIL hand-offs per wait: ~90 µs of
        # CPU per flush here, measured, against ~the same without a thread.)
        self._cond = threading.Lock()
        self._efd = os.eventfd(0, os.EFD_CLOEXEC)
        self._want = self._asked = 0
        self._sleeping = False  # the writer thread waits on _efd
        self._epoch = 0
        # Work for the writer thread, run in order before the next flush.
        self._jobs: list[Callable[[], None]] = []
        self._closing = False
        self._thread: threading.Thread | None = None
        self._background: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---------------------------------------------------------------- the loop's side

    def write(self, tail: Tail, sid: str, log_gen: int, offset: int, fence: int, frame: bytes,
              log_path: str | None) -> None:
        """Journal one log frame (not yet durable).  Raises StoreError with
        the journal cut back to where it was."""
        body = _encoder.encode(_JRec(sid, log_gen, offset, fence, frame))
        data = _REC.pack(len(body), zlib.crc32(body)) + body
        try:
            write_all(self._fd, data)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._end - self._base)
            if exc.errno in _FULL_ERRNOS and exc.errno != errno.EFBIG:
                raise StoreFull(f"{write_error('the journal', exc, self.root)}; {self.free_space()}") from exc
            if exc.errno != errno.EFBIG or self._end == self._base:
                raise write_error("the journal", exc) from exc
            # The file size limit: a fresh journal may still have room.
            self._checkpoint()
            try:
                write_all(self._fd, data)
            except OSError as exc2:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, self._end - self._base)
                raise write_error("the journal", exc2) from exc2
        self._end += len(data)
        self._sids.add(sid)
        self._pending.append((self._end, tail, log_gen, offset + len(frame)))
        if log_path is not None:
            self._dirty.add(log_path)

    def settle(self, session_dir: Path) -> None:
        """Before a session takes a new fence generation: fsync its logs that
        this journal still covers, since replay skips records written under
        an older generation (they would be lost to a crash otherwise)."""
        where = str(session_dir)
        logs = [p for p in self._dirty if os.path.dirname(p) == where]
        for log_path in logs:
            with contextlib.suppress(FileNotFoundError):
                _fsync_path(log_path)
        if logs:
            _fsync_path(session_dir, directory=True)

    def forget(self, sid: str) -> None:
        """A tombstone: records of `sid` before it are never replayed (a
        session of the same id created later must not receive them)."""
        with contextlib.suppress(StoreError):
            self.write(_NoTail(), sid, _TOMBSTONE, 0, 0, b"", None)

    def erase(self, sid: str) -> None:
        """`sid` was removed (its directory is gone): its records leave the
        journal now, not at the next 64 MiB checkpoint.  A checkpoint: the
        journal that holds them is deleted by the writer thread as soon as
        the other sessions' logs it covers are fsync'd.  (A journal kept
        after a failed checkpoint keeps them until the next start, whose
        replay skips them for the tombstone and deletes it.)  On the loop,
        the removals of one pass share a checkpoint (an `rm` of 50 sessions
        costs one journal fdatasync on the loop, not 50)."""
        if sid not in self._sids:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._checkpoint()
            return
        if not self._erasing:
            self._erasing = True
            loop.call_soon(self._erase_now)

    def _erase_now(self) -> None:
        self._erasing = False
        if self._fd >= 0:
            self._checkpoint()

    def sync_soon(self) -> asyncio.Future[None]:
        """A future that completes once everything written so far is
        durable (or fails with StoreError, everything not durable cut)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if self._synced >= self._end:
            fut.set_result(None)
            return fut
        self._waiters.append((self._end, fut))
        self._start(loop)
        with self._cond:
            if self._end > self._want:
                self._want = self._end
                if self._sleeping:
                    # Only then: a busy writer sees _want when its flush
                    # ends, and an eventfd write per session per batch was
                    # 4% of the loop at 50 sessions (bench/load.py).
                    self._sleeping = False
                    self._wake()
        return fut

    def sync_now(self) -> None:
        """Make everything written so far durable, here and now (off the hot
        path: marks, aborts, creates).  Raises StoreError after cutting back."""
        target = self._end
        if self._synced >= target:
            return
        try:
            fdatasync(self._fd)
        except OSError as exc:
            err = self._fail(exc)
            raise err from exc
        self._advance(target)

    def _done(self, epoch: int, target: int, exc: OSError | None) -> None:
        if epoch != self._epoch:
            return  # a result from before a failure: everything it covered was cut
        if exc is not None:
            self._fail(exc)
            return
        self._advance(target)
        if self._end - self._base > _CHECKPOINT_BYTES:
            self._checkpoint()

    def _advance(self, target: int) -> None:
        self._synced = max(self._synced, target)
        pending, waiters = self._pending, self._waiters
        while pending and pending[0][0] <= self._synced:
            _, tail, log_gen, size = pending.popleft()
            tail.mark_synced(log_gen, size)
        while waiters and waiters[0][0] <= self._synced:
            fut = waiters.popleft()[1]
            if not fut.done():
                fut.set_result(None)

    def _fail(self, exc: OSError) -> StoreError:
        err = write_error("the journal", exc, self.root)
        log.error("%s; every append not yet durable is discarded", err)
        with self._cond:
            self._epoch += 1
            keep = max(0, self._synced - self._base)
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, keep)
                # Else records a flush may have made durable before the
                # failure could come back from the disk after a crash.
                os.fsync(self._fd)
            self._end = self._base + keep
            self._want = self._asked = self._end
        tails = {id(t): t for _, t, _, _ in self._pending}
        self._pending.clear()
        for tail in tails.values():
            tail.discard_unsynced()
        waiters, self._waiters = self._waiters, deque()
        for _, fut in waiters:
            if not fut.done():
                fut.set_exception(err)
        return err

    def free_space(self) -> str:
        """Out of space (ENOSPC, a quota): checkpoint now rather than at
        `_CHECKPOINT_BYTES`, so that the journal's copy of every record
        (the session logs hold the other) is deleted as soon as the writer
        thread has fsync'd those logs.  Returns what to tell the client;
        the log says what was freed once it is."""
        held = self._end - self._base
        if self._fd < 0 or held <= 0:
            return "the journal holds nothing a checkpoint could free"
        log.warning("out of space: checkpointing the journal now, to free the %.1f MiB it holds", held / (1 << 20))
        if not self._checkpoint(freeing=True):
            return "a journal checkpoint could not start (see the daemon's log)"
        return (f"a journal checkpoint was started to free {held / (1 << 20):.1f} MiB (the journal's copy of "
                "records the session logs hold); retry in a moment")

    def _checkpoint(self, freeing: bool = False) -> bool:
        try:
            self.sync_now()
            fd, path = _open_journal(self.dir)
        except (StoreError, OSError) as exc:
            log.warning("journal checkpoint postponed: %s", exc)
            return False
        with self._cond:
            old = (self._fd, self._path, self._dirty, freeing)
            self._jobs.append(lambda: self._retire_journal(*old))
            self._fd, self._path, self._dirty, self._sids = fd, path, set(), set()
            self._base = self._end
            self._wake()
        return True

    def close(self) -> None:
        """Sync, checkpoint every log, stop the threads, delete the journal."""
        if self._background is not None:
            self._background.shutdown(wait=True)
        with contextlib.suppress(StoreError):
            self.sync_now()
        with self._cond:
            old = (self._fd, self._path, self._dirty, False)
            self._jobs.append(lambda: self._retire_journal(*old))
            self._fd, self._dirty = -1, set()
            self._closing = True
            self._wake()
        if self._thread is not None:
            self._thread.join()
        else:
            self._run()
        os.close(self._efd)

    def log_created(self, sid: str, log_gen: int, fence: int, log_path: str) -> None:
        """Journal that `log.<log_gen>` of `sid` now exists: replay creates
        it if a crash lost its directory entry (else replay never creates
        a log).  Not durable by itself: the next flush carries it, before
        any record of that log.  (Noted as written, so that a checkpoint
        fsyncs its directory before the journal that says so goes.)"""
        self.write(_NoTail(), sid, log_gen, 0, fence, b"", log_path)

    def in_background(self, job: Callable[[], None], then: Callable[[OSError | None], None]) -> None:
        """Run `job` in a second thread (snapshots: their fsyncs stay off
        the loop and out of the way of the flushes), then `then(error)` on
        the loop.  Without a running loop (tools, tests): here and now."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None

        def run() -> None:
            err: OSError | None = None
            try:
                job()
            except OSError as exc:
                err = exc
            if loop is None:
                then(err)
                return
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(then, err)

        if loop is None:
            run()
            return
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="sessiond-snapshot")
        self._background.submit(run)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        # The loop that completes flushes is the one asking now (a store
        # outliving one loop, in tests and tools, still completes on the next).
        self._loop = loop
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sessiond-journal", daemon=True)
            self._thread.start()

    def abandon(self) -> None:
        """For tests of a crash: stop without syncing anything more; what
        was not durable stays in the file, as the page cache would leave it."""
        if self._background is not None:
            self._background.shutdown(wait=True)
        with self._cond:
            self._closing = True
            self._wake()
        if self._thread is not None:
            self._thread.join()
        os.close(self._fd)
        os.close(self._efd)
        self._fd = -1

    @property
    def synced_bytes(self) -> int:
        """How much of the current journal file is durable (for tests)."""
        return self._synced - self._base

    @property
    def path(self) -> Path:
        return self._path

    # ---------------------------------------------------------------- the writer thread

    def _wake(self) -> None:
        os.eventfd_write(self._efd, 1)

    def _run(self) -> None:
        while True:
            with self._cond:
                idle = not self._jobs and self._want <= self._asked and not self._closing
                self._sleeping = idle
            if idle:
                os.eventfd_read(self._efd)  # state is set before the write: no lost wake-up
                continue
            with self._cond:
                if self._jobs:
                    job = self._jobs.pop(0)
                elif self._closing:
                    return
                else:
                    target, epoch, fd = self._want, self._epoch, self._fd
                    self._asked = target
                    job = None
            if job is not None:
                job()
                continue
            err: OSError | None = None
            try:
                fdatasync(fd)
            except OSError as exc:
                err = exc
            loop = self._loop
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is gone
                    loop.call_soon_threadsafe(self._done, epoch, target, err)

    def _retire_journal(self, fd: int, path: Path, dirty: set[str], freeing: bool = False) -> None:
        """Writer thread: every log the journal covered is made durable on
        its own; then the journal can go."""
        try:
            size = os.fstat(fd).st_size
            fdatasync(fd)
            for log_path in dirty:
                with contextlib.suppress(FileNotFoundError):
                    _fsync_path(log_path)
            for d in {os.path.dirname(p) for p in dirty}:
                with contextlib.suppress(FileNotFoundError):
                    _fsync_path(d, directory=True)
            os.unlink(path)
            _fsync_path(self.dir, directory=True)
            if freeing:
                log.warning("out of space: the journal checkpoint freed %.1f MiB", size / (1 << 20))
        except OSError as exc:
            log.warning("journal %s kept (its logs could not be synced: %s); it is replayed at the "
                        "next start", path.name, exc.strerror)
        finally:
            os.close(fd)


class _NoTail:
    def mark_synced(self, log_gen: int, size: int) -> None:
        pass

    def discard_unsynced(self) -> None:
        pass
