"""Reading the daemon's journal back after a crash (supervisor.store.journal
writes it): the record format, and `replay`, run when the store opens,
before any session loads.  Runs in the daemon (or a tool that opens the
store), with no other writer of these files.

    record  u32 length | u32 crc32 | msgpack[session, log gen, offset, fence gen, the log frame]

Every journal not locked by a live daemon (flock) is read through, damage
and all: a bad record does not end the read (the bytes after it are
searched, offset by offset, for the next record that checks out, as a
log's are).  Each record whose bytes the session's log does not reach yet
is written at its offset, provided the session's fence still holds the
generation that wrote it (a newer writer owns the session otherwise) and
no tombstone (a removed session) follows it.  A log that already reaches a
record's end is left alone: damage in the middle of a log stays for
`repair` to see.

What a crash can leave, and what becomes of it:
* a torn last batch (a record cut short, or never written: zeros) was
  never acknowledged: dropped with a warning, the journal deleted;
* damage (bad bytes followed by intact records, or a whole record failing
  its checksum): every record that checks out is restored all the same.  A
  session whose log it cannot complete (a record lost in the damage, which
  the log does not hold either) is left damaged: the records after the gap
  are written at their own offsets, so the log shows the hole, and a note
  (`ID/journal-damage`) says why; it loads as damaged (`StoreDamaged`)
  until `repair`.  The journal is never deleted then: it is kept as
  `.journal/damaged/NAME` until every session it damaged is repaired
  (`clear_damage_note`), and the error log names it and them.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

__all__ = ["DAMAGED_DIR", "DAMAGE_NOTE", "REC", "TOMBSTONE", "JRec", "clear_damage_note", "encoder",
           "fsync_path", "read_damage_note", "replay"]

log = logging.getLogger("sessiond.store")

REC = struct.Struct(">II")
_FENCE = struct.Struct(">Q")
TOMBSTONE = -1


class JRec(msgspec.Struct, array_like=True):
    sid: str
    log: int  # the log file's generation; TOMBSTONE: the session was removed
    offset: int
    fence: int
    frame: bytes


encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(JRec)


def fsync_path(path: str | Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0) | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DAMAGED_DIR = "damaged"  # <sessions>/.journal/damaged/: damaged journals, kept as evidence
DAMAGE_NOTE = "journal-damage"  # <sessions>/ID/journal-damage: why the session is damaged
# No record is bigger than a worker frame (1 GiB) plus its envelope; a larger
# length read while resynchronising is garbage, not a record.
_MAX_RECORD = (1 << 30) + 4096


@dataclass(slots=True)
class _Read:
    """One journal read through, damage and all."""

    name: str
    records: list[JRec] = field(default_factory=list)
    at: list[int] = field(default_factory=list)  # where each record starts
    # [start, end) byte ranges that are not intact records, torn tail excluded.
    bad: list[tuple[int, int]] = field(default_factory=list)
    # Damaged records decoded without their checksum: a guess at whose they
    # were (sid, log, offset), never their content.
    guesses: list[tuple[int, JRec]] = field(default_factory=list)  # (where, guess)
    torn: int = 0  # bytes of a torn last batch dropped


def _record_at(data: memoryview, pos: int, check: bool = True) -> tuple[JRec, int] | None:
    if len(data) - pos < REC.size:
        return None
    length, crc = REC.unpack_from(data, pos)
    end = pos + REC.size + length
    if length > _MAX_RECORD or end > len(data) or length == 0:
        return None
    body = data[pos + REC.size : end]  # a view: no copy for every offset tried
    if check and zlib.crc32(body) != crc:
        return None
    try:
        return _decoder.decode(body), end
    except msgspec.DecodeError:
        return None


_SECTOR = 512


def _torn_tail(data: bytes, pos: int) -> bool:
    """Bad bytes at the very end that a power loss can leave (never
    acknowledged): a record cut short, or one whose last sector never
    reached the disk (zeros).  A complete record failing its checksum
    otherwise is damage: a flipped bit does not zero a sector."""
    if len(data) - pos < REC.size:
        return True
    length, _ = REC.unpack_from(data, pos)
    end = pos + REC.size + length
    if length == 0 or end > len(data):
        return True
    last_sector = max(pos + REC.size, (end - 1) // _SECTOR * _SECTOR)
    return not any(data[last_sector:end])


def _read_journal(path: Path) -> _Read:
    """Every intact record, in order.  Damage does not end the read: the
    bytes after a bad record are searched, offset by offset, for the next
    record that checks out (length sane, checksum, decodes), as a log's
    are (supervisor.store.logscan)."""
    raw = path.read_bytes()
    data = memoryview(raw)
    out = _Read(path.name)
    pos = 0
    while pos < len(data):
        found = _record_at(data, pos)
        if found is not None:
            out.records.append(found[0])
            out.at.append(pos)
            pos = found[1]
            continue
        nxt = pos + 1
        while nxt < len(data) and _record_at(data, nxt) is None:
            nxt += 1
        if nxt == len(data) and _torn_tail(raw, pos):
            out.torn = len(data) - pos
            log.warning("journal %s: %d byte(s) after offset %d unreadable (a torn last batch, never "
                        "acknowledged); dropped", path.name, out.torn, pos)
            break
        out.bad.append((pos, nxt))
        guess = _record_at(data, pos, check=False)
        if guess is not None and guess[0].frame:
            out.guesses.append((pos, guess[0]))
        pos = nxt
    return out


def _fence_of(session_dir: Path) -> int:
    try:
        raw = (session_dir / "fence").read_bytes()
    except FileNotFoundError:
        return -1
    return _FENCE.unpack(raw[: _FENCE.size])[0] if len(raw) >= _FENCE.size else 0


def replay(jdir: Path, root: Path) -> set[str]:
    """Restore into the session logs what unlocked journals hold and the
    logs lack; delete those journals.  Returns the sessions they wrote
    (those last used: the daemon's start loads them first).

    A damaged journal (bad bytes followed by intact records, or a complete
    record failing its checksum) is replayed all the same, record by
    record; a session whose log it cannot complete (a record lost in the
    damage that the log does not hold) gets a note (`journal-damage`) that
    makes it load as damaged until `repair`, and the journal is kept, as
    `.journal/damaged/NAME`, until every such session is repaired."""
    found = _gather(jdir)
    restored, notes = _restore(root, found)
    for sid, lines in notes.items():
        _note_damage(root / sid, lines, [r.name for r in found.damaged])
    _settle(jdir, found)
    for read in found.damaged:
        _say_damaged(jdir, read, sorted(notes))
    if restored:
        log.warning("restored %d record(s) from the journal into session logs", restored)
    return {sid for sid, _ in found.by_log}


@dataclass(slots=True)
class _Found:
    """What the unlocked journals hold, gathered in file order."""

    held: list[tuple[int, Path]] = field(default_factory=list)  # locked journals (fd, path)
    by_log: dict[tuple[str, int], list[JRec]] = field(default_factory=dict)
    damaged: list[_Read] = field(default_factory=list)
    suspects: dict[str, list[tuple[JRec, str]]] = field(default_factory=dict)  # sid: (guessed record, journal)

    def suspect(self, guess: JRec, journal: str) -> None:
        self.suspects.setdefault(guess.sid, []).append((guess, journal))


def _gather(jdir: Path) -> _Found:
    """Lock and read every journal no live daemon holds."""
    found = _Found()
    for path in sorted(jdir.glob("*.wal")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # a live daemon's
            continue
        found.held.append((fd, path))
        read = _read_journal(path)
        if read.bad:
            found.damaged.append(read)
        # Guesses and records in file order: a tombstone drops only what precedes it.
        guesses = deque(read.guesses)
        for at, rec in zip(read.at, read.records):
            while guesses and guesses[0][0] < at:
                found.suspect(guesses.popleft()[1], read.name)
            if rec.log == TOMBSTONE:
                for key in [k for k in found.by_log if k[0] == rec.sid]:
                    del found.by_log[key]
                found.suspects.pop(rec.sid, None)
            else:
                found.by_log.setdefault((rec.sid, rec.log), []).append(rec)
        for _, guess in guesses:
            found.suspect(guess, read.name)
    return found


def _restore(root: Path, found: _Found) -> tuple[int, dict[str, list[str]]]:
    """Write what the logs lack; returns the records written and, per
    session, what it lost to the damage (the notes that make it damaged)."""
    restored = 0
    fences: dict[str, int] = {}
    notes: dict[str, list[str]] = {}
    bad_names = ", ".join(r.name for r in found.damaged) or "none"
    for (sid, gen), recs in found.by_log.items():
        sdir = root / sid
        if sid not in fences:
            fences[sid] = _fence_of(sdir)
        recs = [r for r in recs if r.fence == fences[sid]]
        if not recs:
            continue  # removed, or a newer writer has it
        written, gaps = _replay_log(sdir, gen, recs)
        restored += written
        for a, b in gaps:
            notes.setdefault(sid, []).append(
                f"log.{gen}: bytes {a}-{b} are in no intact journal record (damaged journal(s): "
                f"{bad_names}); the records after them were restored")
    for sid, seen in found.suspects.items():
        sdir = root / sid
        fence = fences.get(sid, _fence_of(sdir))
        for guess, jname in seen:
            lpath = sdir / f"log.{guess.log}"
            if guess.fence != fence or not lpath.exists():
                continue
            if any(line.startswith(f"log.{guess.log}: ") for line in notes.get(sid, [])):
                continue  # the same loss, seen as a gap already
            end = guess.offset + len(guess.frame)
            if lpath.stat().st_size < end:
                notes.setdefault(sid, []).append(
                    f"log.{guess.log}: its record at {guess.offset}-{end} failed its checksum in the "
                    f"journal (damaged journal(s): {jname}) and the log does not hold it")
    return restored, notes


def _settle(jdir: Path, found: _Found) -> None:
    """Delete the replayed journals; keep the damaged ones aside."""
    keep = {r.name for r in found.damaged}
    if keep:
        (jdir / DAMAGED_DIR).mkdir(mode=0o700, exist_ok=True)
    for fd, path in found.held:
        if path.name in keep:
            os.rename(path, jdir / DAMAGED_DIR / path.name)
        else:
            path.unlink(missing_ok=True)
        os.close(fd)
    if found.held:
        fsync_path(jdir, directory=True)
    if keep:
        fsync_path(jdir / DAMAGED_DIR, directory=True)


def _say_damaged(jdir: Path, read: _Read, whose: list[str]) -> None:
    where = ", ".join(f"{a}-{b}" for a, b in read.bad[:4]) + (", ..." if len(read.bad) > 4 else "")
    log.error("journal %s is damaged at byte(s) %s; every record after the damage that checks out "
              "was restored; %s; the journal is kept as %s/%s/%s", read.name, where,
              (f"session(s) {', '.join(whose)} lost record(s) to it and are damaged until "
               "`sessionctl repair ID` (sessionctl ls shows them)") if whose else
              "no session's log lacks a record that it held, as far as can be told (a damaged "
              "record names no session any more: delete the kept journal once checked)",
              jdir.name, DAMAGED_DIR, read.name)


def _note_damage(sdir: Path, lines: list[str], journals: list[str]) -> None:
    """The note that makes a session load as damaged (supervisor.store.files)."""
    if not sdir.is_dir():
        return
    text = "; ".join(lines) + "".join(f"\njournal {name}" for name in journals) + "\n"
    path = sdir / DAMAGE_NOTE
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(sdir, directory=True)


def read_damage_note(sdir: Path) -> tuple[str, list[str]]:
    """(why the session is damaged, the kept journals named), or ("", [])."""
    try:
        text = (sdir / DAMAGE_NOTE).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "", []
    why, journals = [], []
    for line in text.splitlines():
        if line.startswith("journal "):
            journals.append(line[len("journal "):].strip())
        elif line.strip():
            why.append(line.strip())
    return "; ".join(why) or "the journal lost some of its records", journals


def clear_damage_note(sdir: Path, root: Path) -> None:
    """After a repair: the note goes, and each kept journal it named goes
    once no other session's note names it."""
    _, journals = read_damage_note(sdir)
    (sdir / DAMAGE_NOTE).unlink(missing_ok=True)
    fsync_path(sdir, directory=True)
    if not journals:
        return
    named: set[str] = set()
    for other in root.iterdir():
        if other.is_dir() and not other.name.startswith(".") and other != sdir:
            named.update(read_damage_note(other)[1])
    kept = root / ".journal" / DAMAGED_DIR
    for name in journals:
        if name not in named and (kept / name).exists():
            (kept / name).unlink()
            log.warning("damaged journal %s deleted: every session it damaged is repaired", name)


def _replay_log(sdir: Path, gen: int, recs: list[JRec]) -> tuple[int, list[tuple[int, int]]]:
    """Write into `log.<gen>` what it lacks; returns the records written
    and the gaps left: byte ranges no record covered, before records that
    were written all the same (at their own offsets, so that the log's
    damage shows where it is: `repair` drops or keeps what follows)."""
    log_path = sdir / f"log.{gen}"
    # Created here only if the journal says it was (log_created) and nothing
    # newer exists: else a missing log was folded into a snapshot and
    # deleted, or removed by hand, and stays missing.
    newest = max((int(p.name[4:]) for p in sdir.glob("log.*") if p.name[4:].isdigit()), default=-1)
    create = any(not r.frame for r in recs) and gen >= newest and sdir.is_dir()
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        return 0, []
    recs = [r for r in recs if r.frame]
    written = 0
    gaps: list[tuple[int, int]] = []
    try:
        size = os.fstat(fd).st_size
        for rec in recs:
            end = rec.offset + len(rec.frame)
            if end <= size:
                continue
            if rec.offset > size:
                log.error("%s: no intact journal record for bytes %d-%d; the records after them are "
                          "restored and the session is damaged until repaired", log_path, size, rec.offset)
                gaps.append((size, rec.offset))
            os.pwrite(fd, rec.frame, rec.offset)
            size = end
            written += 1
        if written:
            os.fsync(fd)
    finally:
        os.close(fd)
    if create:
        fsync_path(sdir, directory=True)
    return written, gaps
