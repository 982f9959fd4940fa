"""The spend ledger in a file (`<sessions>/.spend`), and the thread that
makes a book's charges durable off the daemon's loop (the PostgreSQL
store's book uses it too).

Runs in the daemon: `write` on its loop, `BookWriter`'s thread does the
I/O.  The file is the ledger's frames (supervisor.store.spend): a `Book`,
then the charges made since, each `u32 length | u32 crc32 | msgpack`,
appended and fdatasync'd, one fdatasync for every charge pending (an LLM
call waits for its own before its request goes out: the charges of calls
beginning together share it).  Once the charges outgrow the book
(`_REWRITE_BYTES`, or four times the last book's size), the writer
thread writes the whole book to a new file, fsyncs it and renames it over
the old one: the file stays as large as the principals it names.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from supervisor.errors import StoreDamaged, StoreError
from supervisor.store.journal import fdatasync, write_all, write_error
from supervisor.store.replay import fsync_path
from supervisor.store.spend import Book, Charge, copy_book, decode_frames, fold, frame

__all__ = ["BookWriter", "FileSpendBook"]

log = logging.getLogger("sessiond.store")

_REWRITE_BYTES = 1 << 20
FILE_NAME = ".spend"


class BookWriter:
    """One thread that hands batches of charges to `persist`, in order,
    and completes each write's future on its loop with what it returns.
    `persist` raises `StoreError` for a batch that is not durable."""

    def __init__(self, persist: Callable[[list[Charge]], Book | None], name: str) -> None:
        self._persist = persist
        self._cond = threading.Condition()
        self._pending: list[tuple[list[Charge], asyncio.Future[Book | None]]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def write(self, charges: list[Charge]) -> asyncio.Future[Book | None]:
        fut: asyncio.Future[Book | None] = asyncio.get_running_loop().create_future()
        with self._cond:
            if self._closed:
                fut.set_exception(StoreError("the spend ledger is closed"))
                return fut
            self._pending.append((charges, fut))
            self._cond.notify()
        return fut

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                batch, self._pending = self._pending, []
                if not batch and self._closed:
                    return
            error: StoreError | None = None
            result: Book | None = None
            try:
                result = self._persist([c for charges, _ in batch for c in charges])
            except StoreError as exc:
                error = exc
            for _, fut in batch:
                _settle_soon(fut, result, error)


def _settle_soon(fut: asyncio.Future[Book | None], result: Book | None, error: StoreError | None) -> None:
    def settle() -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)

    try:
        fut.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the loop is closed: nobody waits any more


class FileSpendBook:
    """`SpendBook` in `<root>/.spend`.  Opened with the store; a damaged
    file (bad bytes followed by intact charges) stops the daemon's start
    with `StoreDamaged`, never a silent reset of what was spent."""

    def __init__(self, root: Path) -> None:
        self.path = root / FILE_NAME
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            raise StoreError(f"cannot read the spend ledger {self.path}: {exc.strerror}") from None
        self._book, intact, damaged = decode_frames(data)
        if damaged:
            raise StoreDamaged(
                FILE_NAME, f"the spend ledger {self.path} is damaged (intact charges follow bad bytes "
                f"at offset {intact}): move it away to start again from the sessions' own figures",
                repairable=False)
        if intact < len(data):
            log.warning("the spend ledger %s ended in a torn charge (%d bytes): dropped",
                        self.path, len(data) - intact)
        # (The writer thread's from here on: the book, under the lock for `read`; the file.)
        self._lock = threading.Lock()
        self._size = self._rewrite() if intact < len(data) or not data else len(data)
        self._base = max(self._size, _REWRITE_BYTES // 4)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._writer = BookWriter(self._persist, "sd-spend")

    def read(self) -> Book:
        with self._lock:
            return copy_book(self._book)

    def write(self, charges: list[Charge]) -> asyncio.Future[Book | None]:
        return self._writer.write(charges)

    def close(self) -> None:
        self._writer.close()
        os.close(self._fd)

    def _persist(self, charges: list[Charge]) -> None:
        """(On the writer thread.)  The one writer of its file: nothing fresher to say."""
        data = b"".join(frame(c) for c in charges)
        try:
            write_all(self._fd, data)
            fdatasync(self._fd)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, self._size)  # nothing half-kept
            except OSError:
                pass
            raise write_error(f"the spend ledger {self.path}", exc) from None
        self._size += len(data)
        with self._lock:
            for charge in charges:
                fold(self._book, charge)
        if self._size > max(_REWRITE_BYTES, 4 * self._base):
            try:
                new = self._rewrite()
            except StoreError as exc:
                log.warning("%s (its charges stay appended)", exc)
                return
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            self._size = self._base = new

    def _rewrite(self) -> int:
        """The whole book as one frame, in place of the file (temp file,
        fsync, rename, fsync of the directory).  Returns its size."""
        data = frame(self._book)
        tmp = self.path.with_name(FILE_NAME + ".new")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            fsync_path(self.path.parent, directory=True)
        except OSError as exc:
            raise write_error(f"the spend ledger {self.path}", exc) from None
        return len(data)
