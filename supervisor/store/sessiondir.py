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
import time
from pathlib import Path

__all__ = ["fsync_dir", "log_gens", "never_created", "remove_dir", "write_snapshot_files"]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def log_gens(path: Path) -> list[int]:
    gens = []
    for p in path.glob("log.*"):
        suffix = p.name[4:]
        if suffix.isdigit():
            gens.append(int(suffix))
    return sorted(gens)


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


def never_created(path: Path) -> bool:
    """No snapshot and no byte of log: not even the metadata record landed."""
    if (path / "snapshot").exists() or (path / "snapshot.prev").exists():
        return False
    for g in log_gens(path):
        if (path / f"log.{g}").stat().st_size:
            return False
    return True


def remove_dir(path: Path) -> None:
    trash = path.with_name(f".deleted-{path.name}-{time.monotonic_ns()}")
    with contextlib.suppress(FileNotFoundError):
        os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
