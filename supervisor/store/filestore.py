"""The file store: a directory of session directories (supervisor.store.files
holds one session's), the journal that makes their appends durable
(supervisor.store.journal) and the spend ledger (supervisor.store.spendfile).

Runs in the daemon.  Creates, lists, opens (at start, without a write:
`read_stored`), repairs and removes sessions; each one open is a
`SessionStore`, whose files and durability rules supervisor.store.files
describes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from supervisor.store import dirplan
from supervisor.store.files import SessionStore, erase_dir
from supervisor.store.journal import Journal
from supervisor.store.repair import repair_dir
from supervisor.store.sessiondir import listing as _listing
from supervisor.store.sessiondir import remove_dir as _remove_dir
from supervisor.store.spendfile import FileSpendBook
from supervisor.store.state_store import LoadedSession, Meta, RepairMode, RepairResult

__all__ = ["FileStateStore"]

log = logging.getLogger("sessiond.store")


class FileStateStore:
    """`StateStore` over a directory of session directories."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._journal: Journal | None = None
        self._spend: FileSpendBook | None = None

    @property
    def spend(self) -> FileSpendBook:
        """The spend ledger (supervisor.store.spendfile), opened at first use."""
        if self._spend is None:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._spend = FileSpendBook(self.root)
        return self._spend

    @property
    def journal(self) -> Journal:
        """Opened (and every unlocked journal replayed) at first use, before
        any session is listed or loaded."""
        if self._journal is None:
            self._journal = Journal(self.root)
        return self._journal

    def create(self, meta: Meta, durable: bool = True) -> SessionStore:
        return SessionStore.create(self.root, meta, durable, self.journal)

    def close(self) -> None:
        """Make every log durable on its own and delete the journal."""
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        if self._spend is not None:
            self._spend.close()
            self._spend = None

    def load(self, session_id: str) -> tuple[SessionStore, LoadedSession]:
        path, journal = self.root / session_id, self.journal
        try:
            found = _listing(path)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise KeyError(session_id) from exc
        return SessionStore.load(path, journal, found)

    def read_stored(self, session_id: str) -> Callable[[], tuple[SessionStore, LoadedSession]]:
        """A stored session read for the daemon's start without changing
        anything: any thread may call this (files only, no state of the
        store's).  The call it returns, on the loop, opens it (`opened`:
        nothing written unless the directory needs it).  KeyError (from
        either) where there is no such session; a create cut short (never
        acknowledged, so it never existed) is removed then."""
        path = self.root / session_id
        try:
            read = dirplan.read(path, _listing(path))
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise KeyError(session_id) from exc
        if read is None:
            return lambda: self._never_created(path)
        return lambda: SessionStore.opened(read, path, self.journal)

    def open_stored(self, session_id: str) -> tuple[SessionStore, LoadedSession]:
        """`read_stored` and its open at once (on the loop)."""
        return self.read_stored(session_id)()

    def _never_created(self, path: Path) -> tuple[SessionStore, LoadedSession]:
        log.info("removing %s: a session whose creation never completed", path)
        _remove_dir(path)
        raise KeyError(path.name)

    def ids(self) -> list[str]:
        out = []
        for sid in sorted(self.listed()):
            path = self.root / sid
            if _listing(path).never_created(path):
                with contextlib.suppress(KeyError):
                    self._never_created(path)
                continue
            out.append(sid)
        return out

    def listed(self) -> list[str]:
        """Every session directory's name from one read of the store's
        directory (no session's own is opened), in the order the daemon's
        start loads them: those the journal of the daemon before wrote
        first (the last used; any turn it died in among them, unless a
        checkpoint came after the turn's last record), then by name.
        Those a crash cut short before their creation completed are among
        them (their load says KeyError, `read_stored` removes them)."""
        recent = self.journal.recent  # (replays before anything is listed)
        out = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.startswith(".deleted-"):
                    # The daemon died while removing it.
                    shutil.rmtree(entry.path, ignore_errors=True)
                elif not entry.name.startswith(".") and entry.is_dir():
                    out.append(entry.name)
        return sorted(out, key=lambda sid: (sid not in recent, sid))

    def remove(self, session_id: str) -> None:
        self.journal.forget(session_id)
        erase_dir(self.root / session_id, self.journal)

    def repair(self, session_id: str, mode: RepairMode) -> RepairResult:
        """Rewrite each damaged log of a session atomically, per `mode`
        (supervisor.store.repair)."""
        return repair_dir(self.root / session_id, self.root, mode)
