"""How a session directory loads, read without changing it: which snapshot,
which logs after it, and whether anything in them is damaged.  Runs in the
daemon, for the file store (supervisor.store.files) at load and at every
other read that must not read past damage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from supervisor.errors import StoreDamaged
from supervisor.store.logscan import LogScan, describe_damage, read_scan, read_snapshot
from supervisor.store.replay import read_damage_note
from supervisor.store.sessiondir import log_gens
from supervisor.store.state_store import Meta, Snapshot

__all__ = ["Plan", "check_damage", "meta_from_log", "meta_in", "plan"]


@dataclass(slots=True)
class Plan:
    """How a session directory loads: which snapshot, which logs."""

    snap: Snapshot | None
    base: int  # logs >= base are replayed
    gens: list[int]  # the logs replayed, in order
    scans: dict[int, LogScan]
    fallback: str = ""  # non-empty: the snapshot was bad; why


def plan(path: Path) -> Plan:
    """Read a session directory without changing it; `StoreDamaged` if it
    cannot be loaded as it is."""
    sid = path.name
    snap, why = read_snapshot(path / "snapshot")
    fallback = ""
    if why:
        prev, prev_why = read_snapshot(path / "snapshot.prev")
        base = prev.gen if prev is not None else 0
        if prev_why or not (path / f"log.{base}").exists():
            meta = prev.meta if prev is not None else meta_from_log(path / "log.0")
            raise StoreDamaged(
                sid,
                f"{why} and no previous generation is kept to fall back to; its state is "
                f"lost: `sessionctl rm {sid}` deletes it",
                meta=meta, repairable=False,
            )
        snap, fallback = prev, why
    base = snap.gen if snap is not None else 0
    gens = [g for g in log_gens(path) if g >= base] or [base]
    scans = {g: read_scan(path / f"log.{g}") for g in gens}
    check_damage(path, snap, scans)
    if snap is None and not any(isinstance(r, Meta) for s in scans.values() for _, _, r in s.records):
        raise StoreDamaged(sid, f"{path}: no metadata record (not a session directory?)",
                           repairable=False)
    return Plan(snap, base, gens, scans, fallback)


def check_damage(path: Path, snap: Snapshot | None, scans: dict[int, LogScan]) -> None:
    """`StoreDamaged` where the logs `scans` hold damage followed by intact
    records, or journal replay left a note (supervisor.store.replay) of
    records a damaged journal lost.  The one check of every read, at load
    and while the daemon runs (a worker's boot, a resumed turn's steps,
    history, export), so that none reads past what the next start would
    refuse."""
    sid = path.name
    lost, _ = read_damage_note(path)
    meta = snap.meta if snap is not None else meta_in(scans.get(min(scans, default=0)))
    for g, scan in scans.items():
        if scan.damaged:
            why = describe_damage(f"log.{g}", scan)
            raise StoreDamaged(sid, f"{lost}. {why}" if lost else why, meta=meta)
    if lost:
        raise StoreDamaged(sid, f"{lost}. `sessionctl repair {sid}` accepts the loss (the log keeps every "
                           f"intact record), `sessionctl rm {sid}` deletes the session", meta=meta)


def meta_in(scan: LogScan | None) -> Meta | None:
    if scan is not None:
        for _, _, rec in scan.records:
            if isinstance(rec, Meta):
                return rec
    return None


def meta_from_log(path: Path) -> Meta | None:
    return meta_in(read_scan(path))
