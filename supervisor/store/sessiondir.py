"""The files of one session's directory, as the file store keeps them.

    <state>/sessions/ID/log.<gen>        records, framed (supervisor.store.logscan)
    <state>/sessions/ID/snapshot         the last snapshot; snapshot.prev the one before
    <state>/sessions/ID/fence            the writer's generation (supervisor.store.files)

Plain file operations with their durability rules: a snapshot is replaced
atomically and the directory fsync'd, a new log exists durably before its
first record, a removed session's directory goes by one rename.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FENCE", "Listing", "fsync_dir", "listing", "log_gens", "read_fence", "remove_dir",
           "write_snapshot_files"]

FENCE = struct.Struct(">Q")  # the `fence` file: the last writer's generation


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(slots=True, frozen=True)
class Listing:
    """What one read of a session directory found (os.scandir: no file
    opened, no stat but of a log whose size decides never-created)."""

    names: frozenset[str]
    gens: list[int]  # the log.<gen> files, in order

    def never_created(self, path: Path) -> bool:
        """No snapshot and no byte of log: not even the metadata record landed."""
        if "snapshot" in self.names or "snapshot.prev" in self.names:
            return False
        for g in self.gens:
            with contextlib.suppress(FileNotFoundError):
                if os.stat(f"{path}/log.{g}").st_size:
                    return False
        return True


def listing(path: Path) -> Listing:
    """The session directory's entries; FileNotFoundError if it is gone."""
    with os.scandir(path) as entries:
        names = frozenset(e.name for e in entries)
    return Listing(names, _gens(names))


def _gens(names: frozenset[str] | list[str]) -> list[int]:
    return sorted(int(n[4:]) for n in names if n.startswith("log.") and n[4:].isdigit())


def log_gens(path: Path) -> list[int]:
    try:
        return _gens(os.listdir(path))
    except FileNotFoundError:
        return []


def read_fence(path: Path) -> int:
    """The generation the session's last writer took (0: none yet)."""
    try:
        fd = os.open(f"{path}/fence", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        raw = os.pread(fd, FENCE.size, 0)
    finally:
        os.close(fd)
    return FENCE.unpack(raw)[0] if len(raw) == FENCE.size else 0


def write_snapshot_files(path: Path, data: bytes, gen: int) -> None:
    """`snapshot` replaced atomically, the one it replaces kept as
    `snapshot.prev`, `log.<gen>` created; the directory fsync'd even if
    that failed (a new log's entry must be durable before its records)."""
    tmp = path / "snapshot.tmp"
    cur = path / "snapshot"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if cur.exists():
            # A hard link, then a rename: `snapshot.prev` is always
            # whole, and `snapshot` never missing.
            prev_tmp = path / "snapshot.prev.tmp"
            prev_tmp.unlink(missing_ok=True)
            os.link(cur, prev_tmp)
            os.replace(prev_tmp, path / "snapshot.prev")
        os.replace(tmp, cur)
        # The next log exists, durably, before its first record: journal
        # replay fills logs, never creates them (supervisor.store.journal).
        os.close(os.open(path / f"log.{gen}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        fsync_dir(path)


def remove_dir(path: Path) -> None:
    trash = path.with_name(f".deleted-{path.name}-{time.monotonic_ns()}")
    with contextlib.suppress(FileNotFoundError):
        os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
