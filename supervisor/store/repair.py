"""`sessionctl repair` of a file-store session: each damaged log rewritten
atomically (temp file, fsync, rename, fsync dir), keeping every intact
record (skip_bad) or what precedes the first damage (truncate).  A snapshot
beyond repair stays beyond repair (StoreDamaged).  Runs in the daemon."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from supervisor.errors import StoreDamaged
from supervisor.logtag import tagged
from supervisor.store.dirplan import plan
from supervisor.store.logscan import read_snapshot, scan_log
from supervisor.store.replay import clear_damage_note
from supervisor.store.sessiondir import fsync_dir, log_gens
from supervisor.store.state_store import RepairMode, RepairResult

__all__ = ["repair_dir"]

log = logging.getLogger("sessiond.store")


def repair_dir(path: Path, root: Path, mode: RepairMode) -> RepairResult:
    if not path.is_dir():
        raise KeyError(path.name)
    try:
        plan(path)
    except StoreDamaged as exc:
        if not exc.repairable:
            raise
    else:
        return RepairResult(0, 0, 0)
    snap, _ = read_snapshot(path / "snapshot")
    base = snap.gen if snap is not None else 0
    kept = dropped_records = dropped_bytes = 0
    for g in log_gens(path):
        if g < base:
            continue
        log_path = path / f"log.{g}"
        data = log_path.read_bytes()
        scan = scan_log(data)
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
        fsync_dir(path)
        tagged(log, path.name).warning("log.%d repaired (%s): %d record(s) kept, %d intact record(s) and "
                                        "%d damaged byte(s) dropped",
                                        g, mode.value, len(keep), len(scan.records) - len(keep),
                                        sum(b - a for a, b in scan.bad))
    clear_damage_note(path, root)
    return RepairResult(kept, dropped_records, dropped_bytes)
