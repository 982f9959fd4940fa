"""How a session directory loads: which snapshot, which logs after it, and
whether anything in them is damaged, read without changing it (`plan`,
`read`: any thread); then, once it is opened, what a load changes on disk
(`settle`: a torn tail cut, a fallback made current, stale logs removed;
on the loop).  Runs in the daemon, for the file store
(supervisor.store.files) at load and at every other read that must not read
past damage."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.errors import StoreDamaged
from supervisor.logtag import tagged
from supervisor.store.logscan import LogScan, describe_damage, read_scan, read_snapshot
from supervisor.store.replay import DAMAGE_NOTE, read_damage_note
from supervisor.store.sessiondir import Listing, fsync_dir, listing, read_fence
from supervisor.store.state_store import LIFE_EVENTS_KEPT, LoadedSession, Meta, Snapshot, check_stored_id

__all__ = ["Plan", "Read", "check_damage", "meta_from_log", "meta_in", "plan", "read", "settle"]

log = logging.getLogger("sessiond.store")


@dataclass(slots=True)
class Plan:
    """How a session directory loads: which snapshot, which logs."""

    snap: Snapshot | None
    base: int  # logs >= base are replayed
    gens: list[int]  # the logs replayed, in order
    scans: dict[int, LogScan]
    fallback: str = ""  # non-empty: the snapshot was bad; why
    stale: list[int] = field(default_factory=list)  # logs older than the fallback's: folded into both snapshots


def plan(path: Path, found: Listing | None = None) -> Plan | None:
    """Read a session directory without changing it; `StoreDamaged` if it
    cannot be loaded as it is; None if a create was cut short there (no
    snapshot, no byte of log: never acknowledged, so it never existed).
    `found`: the directory's listing, if read already; only the files it
    names are opened."""
    sid, where = path.name, str(path)
    found = found if found is not None else listing(path)
    names = found.names
    snap, why = read_snapshot(f"{where}/snapshot") if "snapshot" in names else (None, "")
    fallback = ""
    if why:
        prev, prev_why = read_snapshot(f"{where}/snapshot.prev") if "snapshot.prev" in names else (None, "")
        base = prev.gen if prev is not None else 0
        if prev_why or f"log.{base}" not in names:
            meta = prev.meta if prev is not None else meta_from_log(path / "log.0")
            raise StoreDamaged(
                sid,
                f"{why} and no previous generation is kept to fall back to; its state is "
                f"lost: `sessionctl rm {sid}` deletes it",
                meta=meta, repairable=False,
            )
        snap, fallback = prev, why
    base = snap.gen if snap is not None else 0
    gens = [g for g in found.gens if g >= base] or [base]
    scans = {g: read_scan(f"{where}/log.{g}") for g in gens}
    if "snapshot" not in names and "snapshot.prev" not in names and not any(s.size for s in scans.values()):
        return None
    check_damage(path, snap, scans, noted=DAMAGE_NOTE in names)
    if snap is None and not any(isinstance(r, Meta) for s in scans.values() for _, _, r in s.records):
        raise StoreDamaged(sid, f"{path}: no metadata record (not a session directory?)",
                           repairable=False)
    # After a fallback `snapshot.prev` becomes `snapshot`: no older log is stale then.
    stale = [] if fallback else _stale(path, snap, found)
    return Plan(snap, base, gens, scans, fallback, stale)


def _stale(path: Path, snap: Snapshot | None, found: Listing) -> list[int]:
    """Logs older than the previous snapshot's (a checkpoint cut short
    before it deleted them).  That snapshot is read only where such a log
    may exist: it continues at a log older than the current one's."""
    if "snapshot.prev" not in found.names:
        return []
    older = [g for g in found.gens if snap is None or g < snap.gen - 1]
    if not older:
        return []
    prev, _ = read_snapshot(path / "snapshot.prev")
    return [g for g in older if prev is not None and g < prev.gen]


def check_damage(path: Path, snap: Snapshot | None, scans: dict[int, LogScan], noted: bool = True) -> None:
    """`StoreDamaged` where the logs `scans` hold damage followed by intact
    records, or journal replay left a note (supervisor.store.replay) of
    records a damaged journal lost.  The one check of every read, at load
    and while the daemon runs (a worker's boot, a resumed turn's steps,
    history, export), so that none reads past what the next start would
    refuse.  `noted` False: the directory holds no damage note (its
    listing said so)."""
    sid = path.name
    lost, _ = read_damage_note(path) if noted else ("", [])
    damaged = [(g, scan) for g, scan in scans.items() if scan.damaged]
    if not damaged and not lost:
        return
    meta = snap.meta if snap is not None else meta_in(scans.get(min(scans, default=0)))
    if damaged:
        g, scan = damaged[0]
        why = describe_damage(f"log.{g}", scan)
        raise StoreDamaged(sid, f"{lost}. {why}" if lost else why, meta=meta)
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


@dataclass(slots=True)
class Read:
    """A session directory read through: its plan, the session it holds,
    and the fencing generation its last writer took."""

    plan: Plan
    loaded: LoadedSession
    fence: int


def read(path: Path, found: Listing | None = None) -> Read | None:
    """The session in `path`, read without changing anything (any thread:
    files only, no state of the store's); `StoreDamaged` and None as `plan`."""
    p = plan(path, found)
    if p is None:
        return None
    snap, loaded = p.snap, None
    if snap is not None:
        loaded = LoadedSession(meta=snap.meta, turns=snap.turns, seq=snap.seq, mark=snap.mark,
                               usage=dict(snap.usage), lifecycle=list(snap.lifecycle))
    for g in p.gens:
        for _, _, rec in p.scans[g].records:
            if loaded is None and isinstance(rec, Meta):
                loaded = LoadedSession(meta=rec)
            elif loaded is not None:
                loaded.apply(rec)
    assert loaded is not None  # the plan checked there is a Meta
    check_stored_id(path.name, loaded.meta)
    del loaded.lifecycle[:-LIFE_EVENTS_KEPT]
    return Read(p, loaded, read_fence(path))


def settle(path: Path, p: Plan) -> int:
    """What loading `p` changes on disk, on the loop, before anything is
    written: the previous generation made the current one after a
    fallback (so the next rotation keeps a good snapshot as its fallback),
    a torn tail cut, logs older than the fallback's removed.  Returns the
    size of the log appended to next.  Nothing is written for a directory
    that needs none of it."""
    if p.fallback:
        tagged(log, path.name).warning("%s; restored from the previous generation (%s and log(s) %s)",
                                       p.fallback, "snapshot.prev" if p.snap else "no snapshot",
                                       ", ".join(map(str, p.gens)))
        if p.snap is not None:
            os.replace(path / "snapshot.prev", path / "snapshot")
        else:
            (path / "snapshot").unlink()
        fsync_dir(path)
    for g in p.gens:
        scan = p.scans[g]
        torn = scan.torn_at
        if torn is not None:
            tagged(log, path.name).warning("log.%d: dropping %d bytes of a torn last record at offset %d",
                                           g, scan.size - torn, torn)
            with open(path / f"log.{g}", "r+b") as f:
                f.truncate(torn)
                os.fsync(f.fileno())
    for g in p.stale:
        (path / f"log.{g}").unlink(missing_ok=True)
    last = p.scans[p.gens[-1]]
    return last.torn_at if last.torn_at is not None else last.size
