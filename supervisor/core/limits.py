"""Measuring sessions' memory, and the pure decisions about limits.

A session's memory is the RSS of its worker plus every descendant (a tool
that allocates 2 GiB is the session's).  One sweep reads each process once,
through the `ProcTable` (supervisor.host.proctable: /proc files opened for
one session's batch and closed before `measure` returns), so the cost per
sweep is proportional to processes, not to sessions x processes, and the
daemon holds no /proc file of a session's between sweeps.

A descendant stays counted after it re-parents (a tool that double-forks
lands on the zygote, our subreaper): once seen as a session's, a pid is
tracked until it exits, and it is killed with the session, through the
pidfd the table took when it was first seen (never by a number that may
be reused).

The PSS of a session's processes, the memory they hold outside any
mapping and the workspace's size are read off the loop (`supervisor.host.measure`,
a thread of the daemon); this module holds what was read and the pure
decisions on it (`pss_estimate`, `settled_figure`, `read_order`,
`unmapped_total`, `disk_over`, `disk_verdict`).

Runs in the daemon's loop; it reads nothing of the host itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

from supervisor.host.proctable import CLOCK_TICKS, REMOTE_PIDS, ProcTable
from supervisor.spawn.pidfd import PidFd

__all__ = [
    "CPU_SAMPLE_SECS",
    "HEARTBEATS_MISSED",
    "MemoryVerdict",
    "PssEstimate",
    "PssRead",
    "STARVED_SHARE",
    "STARVED_STRETCH_MAX",
    "SessionMemory",
    "DiskVerdict",
    "disk_over",
    "disk_verdict",
    "heartbeat_overdue",
    "idle_expired",
    "memory_verdict",
    "own_silence",
    "patience",
    "pss_estimate",
    "read_order",
    "settled_figure",
    "turn_deadline_left",
    "unmapped_total",
]

# A session's CPU % is measured over at least this long (`ls`, `top`):
# a /proc/PID/stat read per process of its tree, not at every sweep.
CPU_SAMPLE_SECS = 1.0
MIB = 1024 * 1024


@dataclass(slots=True, frozen=True)
class PssRead:
    """One process's PSS as the measuring thread read it."""

    pss: int  # bytes (its RSS where the kernel would not say)
    rss: int  # its RSS at the sweep that asked: growth since is counted in full
    tick: int  # that sweep's number: the oldest reads are refreshed first


@dataclass(slots=True)
class SessionMemory:
    """What the last sweep saw of one session's processes."""

    rss_bytes: int = 0
    pids: set[int] = field(default_factory=set)  # worker excluded
    high: bool = False  # above memory_high_mb at the last sweep
    # Owned handles of the tracked descendants, to kill them by (not by pid).
    pidfds: dict[int, PidFd] = field(default_factory=dict)
    # Each process's RSS at the last sweep, the worker included.
    rss_by_pid: dict[int, int] = field(default_factory=dict)
    # What the measuring thread has read (supervisor.host.measure), applied on
    # the loop; an entry goes with its process.
    pss_reads: dict[int, PssRead] = field(default_factory=dict)
    waited: int = 0  # sweeps over the cap by RSS with PSS reads missing
    # Memory no mapping shows: memfds (and, outside a mount namespace of
    # the session's own, POSIX shm) each process holds open, by inode
    # (dev, ino) -> allocated bytes; when each process's fds were last read.
    held: dict[int, dict[tuple[int, int], int]] = field(default_factory=dict)
    held_at: dict[int, float] = field(default_factory=dict)
    # A process in the sandbox's own mount namespace, whose /tmp (and /dev)
    # tmpfs the session fills; 0 = none seen (no namespaces).
    sandbox_pid: int = 0
    tmpfs_bytes: int = 0
    tmpfs_at: float = 0.0
    # The workspace's allocated bytes and its files and directories at the
    # end of the last walk (None: no walk finished for this worker yet),
    # and when that walk ended.
    disk_bytes: int | None = None
    disk_inodes: int | None = None
    disk_at: float = 0.0
    # A stop for a limit the session cannot be restarted out of is under way.
    stopping: bool = False
    # CPU: the tree's clock ticks at the last sample, when (monotonic), and
    # the share of one core used between the two last samples (None: not
    # two samples yet).
    cpu_ticks: int | None = None
    cpu_at: float = 0.0
    cpu_percent: float | None = None
    # The worker's start time (clock ticks after boot) when first measured:
    # with its pid, the process itself (0: not measured yet).
    worker_start: int = 0

    def at_rest(self) -> SessionMemory:
        """What a session keeps of its figures once its worker and every
        process of its tree are gone: the last walk of its workspace (`ls`
        shows it), in an instance whose tables are shared read-only empties
        (a session at rest is never measured: WorkerOwner gives each new
        worker fresh figures).  Its handles are closed."""
        self.close()
        if self.disk_bytes is None and self.disk_inodes is None:
            return _RESTING
        return _resting(disk_bytes=self.disk_bytes, disk_inodes=self.disk_inodes, disk_at=self.disk_at)

    def escapees(self) -> list[PidFd]:
        """Handles of every tracked descendant: the ones that left the
        worker's process group are reached only through these."""
        return list(self.pidfds.values())

    def close(self) -> None:
        if not self.pidfds:
            return  # (a resting instance's table is read-only)
        for fd in self.pidfds.values():
            fd.close()
        self.pidfds.clear()

    def measure(self, table: ProcTable, worker_pid: int) -> int:
        """Sum the RSS of the worker, its descendants and known escapees:
        one batch of the table's, ended before this returns, so the daemon
        holds no /proc file of the session's between sweeps."""
        try:
            return self._measure(table, worker_pid)
        finally:
            table.release()

    def _worker(self, table: ProcTable, pid: int) -> tuple[int | None, list[int]]:
        """The worker's RSS and children, read this batch: its `children`
        first, then its `stat` (resident pages and start time in one read),
        whose start time, once it matches the one first seen, proves both
        files the worker's (it held the number from its start until the
        second open).  (None, []) when it is gone or another process has
        its number."""
        if pid >= REMOTE_PIDS:
            return table.rss(pid), []
        kids = table.children(pid)
        figures = table.stat(pid)
        if figures is None:
            return None, []
        rss, _, start = figures
        if not self.worker_start:
            self.worker_start = start  # first seen: as trusted as the spawn that named it
        elif start != self.worker_start:
            return None, []
        return rss, kids

    def _measure(self, table: ProcTable, worker_pid: int) -> int:
        by_pid = self.rss_by_pid
        by_pid.clear()
        rss, kids = self._worker(table, worker_pid)
        if rss is not None:
            by_pid[worker_pid] = rss
        if not self.pids and not kids:
            # The common case, an idle worker with no tools: two files read.
            self.rss_bytes = rss or 0
            self._forget_gone()
            return self.rss_bytes
        # A pid tracked from an earlier pass is read only as the process
        # its pidfd names (checked after each of its files is opened).
        for pid in self.pids:
            handle = self.pidfds.get(pid)
            if handle is not None:
                table.vouch(pid, handle)
        total = rss or 0
        stack = [*kids, *(p for p in self.pids if table.vouched(p))]
        while stack:
            pid = stack.pop()
            if pid in by_pid:
                continue
            size = table.rss(pid)
            if size is None:
                continue
            by_pid[pid] = size
            total += size
            stack.extend(table.children(pid))
        seen = set(by_pid)
        seen.discard(worker_pid)
        self.pids = seen
        for pid in [p for p in self.pidfds if p not in seen or not table.vouched(p)]:
            # Gone (or a zombie): nothing to kill; or reaped, its number now
            # another descendant's, which gets a handle of its own below.
            self.pidfds.pop(pid).close()
        for pid in seen:
            if pid not in self.pidfds:
                # In this batch, after its statm was read: see ProcTable.pidfd.
                handle = table.pidfd(pid)
                if handle is not None:
                    self.pidfds[pid] = handle
        self._forget_gone()
        self.rss_bytes = total
        return total

    def sample_cpu(self, table: ProcTable, now: float) -> None:
        """Sum the CPU ticks of the processes the last `measure` saw (the
        worker and its descendants; their reaped children's included) and
        set `cpu_percent` against the previous sample.  A process that
        exits unreaped takes its ticks with it: a drop reads as 0 %.  One
        batch of the table's, ended before this returns; each pid is read
        as the process `measure` saw (the worker by its start time, the
        others through their pidfds), never by number alone."""
        try:
            ticks = 0
            for pid in self.rss_by_pid:
                handle = self.pidfds.get(pid)
                worker = pid not in self.pids
                if handle is not None:
                    table.vouch(pid, handle)
                elif not worker:
                    continue  # no handle: never read by number
                figures = table.stat(pid)
                if figures is None:
                    continue
                if worker and figures[2] != self.worker_start:
                    continue  # the worker's number, another process's now
                ticks += figures[1]
        finally:
            table.release()
        if self.cpu_ticks is not None and now > self.cpu_at:
            self.cpu_percent = max(0.0, (ticks - self.cpu_ticks) / CLOCK_TICKS / (now - self.cpu_at) * 100)
        self.cpu_ticks, self.cpu_at = ticks, now

    def _forget_gone(self) -> None:
        """Drop what was read of processes that are gone (cheap when the
        tables are empty, the common case)."""
        alive = self.rss_by_pid
        for table in (self.pss_reads, self.held, self.held_at):
            if len(table) > len(alive) or any(p not in alive for p in table):
                for pid in [p for p in table if p not in alive]:
                    del table[pid]
        if self.sandbox_pid and self.sandbox_pid not in alive:
            # Another process of that namespace, if any, is found by the
            # next fd listing (within HELD_EVERY_SECS); none: the tmpfs went
            # with the namespace.
            self.sandbox_pid = self.tmpfs_bytes = 0

    def unmapped(self) -> int:
        """Memfds and shm held (each inode once) plus the private tmpfs."""
        return unmapped_total(self.held.values(), self.tmpfs_bytes)


# ---------------------------------------------------------------- pure decisions


@dataclass(slots=True, frozen=True)
class PssEstimate:
    total: int  # PSS where read (plus RSS growth since), RSS where not
    known: int  # the read part alone: sum of min(PSS read, RSS now)
    unread: int  # processes with no PSS read yet


def pss_estimate(rss: Mapping[int, int], reads: Mapping[int, PssRead]) -> PssEstimate:
    """A session's PSS from reads that may be partial or a few sweeps old.

    A process never read counts its RSS (never below its PSS).  A process
    read earlier counts that PSS plus whatever its RSS grew by since: new
    pages are its own until it forks, so a tool that allocates after its
    read is not hidden by the stale figure.  `known` takes only the read
    part, each capped by the RSS now (PSS is never above RSS): what the
    session holds at least, whatever the unread processes turn out to be."""
    total = known = unread = 0
    for pid, now in rss.items():
        read = reads.get(pid)
        if read is None:
            total += now
            unread += 1
        else:
            total += read.pss + max(0, now - read.rss)
            known += min(read.pss, now)
    return PssEstimate(total, known, unread)


# Sweeps a session over its cap by RSS may wait for missing PSS reads on
# top of twice the sweeps needed to read every process once.
PATIENCE_SLACK = 5


def patience(processes: int, budget: int) -> int:
    """How many sweeps a session over its cap by RSS, not yet read in full,
    is given before its unread processes count their RSS: twice a full
    round of reads at `budget` a sweep, and a few more."""
    rounds = -(-processes // max(budget, 1))
    return 2 * rounds + PATIENCE_SLACK


def settled_figure(est: PssEstimate, extra: int, cap_bytes: int, waited: int, limit: int) -> int | None:
    """The figure to judge a session by, or None: not known well enough
    yet to kill, and not yet waited for long enough.

    Safe both ways.  Under the cap counting RSS for the unread: under it
    by PSS too, no need to wait.  Over it by the read part alone: over
    whatever the rest holds, kill now.  Between the two, wait for the
    reads: a session that forks faster than they are made cannot wait
    for ever, after `limit` sweeps the estimate stands (the unread count
    their RSS), so none escapes; and one that is under its cap by PSS is
    read in full well within `limit` (its processes are read oldest
    first, at a budget a sweep), so none is killed for what we could not
    read in time.  `extra` (unmapped memory) is known, not estimated."""
    if est.unread == 0 or est.total + extra <= cap_bytes:
        return est.total + extra
    if est.known + extra > cap_bytes:
        return est.known + extra
    if waited < limit:
        return None
    return est.total + extra


def read_order(rss: Mapping[int, int], reads: Mapping[int, PssRead], budget: int,
               stale_before: int | None = None) -> list[int]:
    """Which processes' PSS to read this sweep: never read first (largest
    RSS first: they move the figure most), then the oldest reads, those
    made before sweep `stale_before` only (a read's RSS growth since is
    counted anyway: refreshing is for what RSS does not show, sharers
    gone, and need not be every sweep)."""
    unread = sorted((p for p in rss if p not in reads), key=lambda p: -rss[p])
    if len(unread) >= budget:
        return unread[:budget]
    stale = sorted((p for p in rss if p in reads and (stale_before is None or reads[p].tick < stale_before)),
                   key=lambda p: reads[p].tick)
    return unread + stale[:budget - len(unread)]


def unmapped_total(held: Iterable[Mapping[tuple[int, int], int]], tmpfs_bytes: int) -> int:
    """Bytes held outside any mapping: every inode once, however many
    processes (or fds) hold it, plus the session's private tmpfs."""
    inodes: dict[tuple[int, int], int] = {}
    for one in held:
        inodes.update(one)
    return sum(inodes.values()) + tmpfs_bytes


def disk_over(used_bytes: int, max_disk_mb: int | None) -> bool:
    """A workspace over its quota.  `used_bytes` may come from a walk not
    finished yet: blocks counted are held, so a partial sum over the cap
    is over it already."""
    return max_disk_mb is not None and used_bytes > max_disk_mb * MIB


@dataclass(slots=True, frozen=True)
class DiskVerdict:
    """Why a workspace's session is stopped: the limit's kind (a LimitKind
    value, "" for none: an unreadable directory is no figure), its figure
    and limit, and the detail its stop says."""

    kind: str
    value: float
    limit: float
    detail: str


def disk_verdict(used_bytes: int, inodes: int, unreadable: str, max_disk_mb: int | None,
                 max_disk_inodes: int | None) -> DiskVerdict | None:
    """A walked workspace over a cap, or that could not be walked whole
    (fail closed: what an unreadable directory holds cannot be counted);
    None when it is within both.  Figures of a walk not finished yet count:
    what was counted is held."""
    fix = "then `sessionctl restart`"
    if disk_over(used_bytes, max_disk_mb):
        assert max_disk_mb is not None
        return DiskVerdict("disk", used_bytes / MIB, max_disk_mb,
                           f"workspace holds {used_bytes / MIB:.0f} MiB, over max_disk_mb = {max_disk_mb}: "
                           f"remove files from it, {fix}")
    if max_disk_inodes is not None and inodes > max_disk_inodes:
        return DiskVerdict("disk_inodes", inodes, max_disk_inodes,
                           f"workspace holds {inodes} files and directories, over max_disk_inodes = "
                           f"{max_disk_inodes}: remove some, {fix}")
    if unreadable and (max_disk_mb is not None or max_disk_inodes is not None):
        return DiskVerdict("", 0.0, 0.0,
                           f"workspace holds a directory the daemon cannot read ({unreadable!r}), so its "
                           f"disk quota cannot be measured: make it readable (chmod u+rx) or remove it, {fix}")
    return None


@dataclass(slots=True, frozen=True)
class MemoryVerdict:
    kill: bool = False
    high_crossed: bool = False  # newly above memory_high_mb: tell once
    high_cleared: bool = False


_OK = MemoryVerdict()
_KILL = MemoryVerdict(kill=True)
_CROSSED = MemoryVerdict(high_crossed=True)
_CLEARED = MemoryVerdict(high_cleared=True)


def memory_verdict(rss_bytes: int, max_mb: int, high_mb: int | None, was_high: bool) -> MemoryVerdict:
    """What one sweep's figure means for one session (runs per session per
    sweep: shared constant verdicts, no allocation)."""
    if rss_bytes > max_mb * MIB:
        return _KILL
    above = high_mb is not None and rss_bytes > high_mb * MIB
    if above and not was_high:
        return _CROSSED
    if was_high and not above:
        return _CLEARED
    return _OK


# Missed heartbeats before a worker's loop counts as stuck.
HEARTBEATS_MISSED = 3


def heartbeat_overdue(now: float, last_heartbeat: float, interval_secs: float, booted: bool) -> bool:
    """A booted worker silent for more than HEARTBEATS_MISSED intervals: its
    event loop is stuck (a busy loop, a blocking call)."""
    return booted and now - last_heartbeat > HEARTBEATS_MISSED * interval_secs


# A silent worker that spent at least this share of a probe runnable but
# waiting for a CPU (supervisor.host.schedstat) is starved by the machine's
# load, not stuck...
STARVED_SHARE = 0.5
# ...and its silence counts as the part it could run, but starvation
# stretches an allowance at most this many times: a worker silent that many
# allowances is judged stuck however starved (a busy loop on a loaded
# machine also waits most of the time).
STARVED_STRETCH_MAX = 10


def own_silence(silent: float, waiting: float | None) -> float:
    """A worker's `silent` seconds as its own, given the share of a probe
    it spent waiting for a CPU (None: unknown): all of them unless it was
    starved, then the share it could run, at least 1/STARVED_STRETCH_MAX."""
    if waiting is None or waiting < STARVED_SHARE:
        return silent
    return silent * max(1.0 - waiting, 1.0 / STARVED_STRETCH_MAX)


def idle_expired(now: float, last_active: float, idle_secs: float, idle: bool, busy: bool) -> bool:
    """An idle session untouched for longer than session_timeout_secs, and
    not busy with anything else: time to hibernate it."""
    return idle and not busy and now - last_active > idle_secs


def turn_deadline_left(now: float, turn_started: float, timeout_secs: float) -> float:
    """Seconds left of a turn's timeout, counted from its start (0 when past)."""
    return max(timeout_secs - (now - turn_started), 0.0)


# Read-only stand-ins for the tables of a session at rest: a write raises
# (never one session's figures written into another's).
_NO_PIDS = cast(set[int], frozenset())
_NO_TABLE = cast(dict[Any, Any], MappingProxyType({}))


def _resting(**figures: Any) -> SessionMemory:
    return SessionMemory(pids=_NO_PIDS, pidfds=_NO_TABLE, rss_by_pid=_NO_TABLE, pss_reads=_NO_TABLE,
                         held=_NO_TABLE, held_at=_NO_TABLE, **figures)


_RESTING = _resting()


def resting_memory() -> SessionMemory:
    """A session's figures before it has a worker: one shared instance."""
    return _RESTING
