"""The expensive half of the memory and disk sweep, run off the loop.

Runs in the daemon, in one thread of its own ("sessiond-measure"), one batch
at a time.  The loop (`supervisor.core.sweep`) decides what to read, in priority
order, and hands a batch over; this thread reads what the budget allows and
hands the batch back; the loop applies the figures and decides (the pure
functions of `supervisor.core.limits`) and kills (through `WorkerOwner`).  What a
batch did not get to is asked again by the next one.

What is read here and why it is not read on the loop:

- `/proc/PID/smaps_rollup` (PSS): the kernel walks the process's page
  tables under its mmap lock, 0.3-0.5 ms for a 30 MiB Python process;
  511 of them were 262 ms of the loop a sweep.
- `/proc/PID/fd/*`: a listing and a readlink a descriptor, to find the
  memfds (and POSIX shm) a process holds open.  Their pages are nowhere
  in its RSS when it filled them with write() instead of a mapping.
- statvfs of the private /tmp (and /dev, where /dev/shm lives) of a
  process in the sandbox's own mount namespace: a tmpfs's pages are in
  nobody's RSS either.
- the workspace's walk (`supervisor.host.diskquota.DiskWalk`), a slice a batch.

Budget: `PROC_READS` units a batch, a smaps_rollup or a statvfs costing one
and an fd listing one plus one per `FDS_PER_UNIT` descriptors; the walk has
its own (`WALK_ENTRIES`).  Each read costs a few syscalls with the GIL
released, so the loop is not held for more than a little Python between them.

Nothing here takes a lock the zygote's fork could inherit held (no logging,
no imports after start): the daemon forks the zygote again if it dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from supervisor.host.diskquota import DiskWalk

__all__ = [
    "FDS_PER_UNIT", "PROC_READS", "THREAD_NAME", "WALK_ENTRIES", "Kind", "Measurer", "Read", "host_identity",
    "name_thread", "run_batch",
]

# Reads of /proc a batch (one batch a sweep at most): at ~0.4 ms for the
# dearest (smaps_rollup of a 30 MiB process), ~25 ms of the thread's time.
PROC_READS = 64
# An fd listing costs a unit per this many descriptors (readlink each).
FDS_PER_UNIT = 64
# Most descriptors of one process looked at (RLIMIT_NOFILE's usual 1,024 soft
# limit, and the hard one's 4,096 on most distributions); more is a listing
# of its own, the next time round.
MAX_FDS = 4096
# Directory entries of workspace walks a batch (an lstat each, ~2 us).
WALK_ENTRIES = 4096


# The thread's name as `top -H` and /proc/PID/task/TID/comm show it (15 bytes at most).
THREAD_NAME = "sd-measure"


def name_thread() -> None:
    """Name the measuring thread for the kernel (an initializer of its pool)."""
    with contextlib.suppress(OSError), open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(THREAD_NAME)


class Kind(enum.Enum):
    PSS = "pss"
    FDS = "fds"
    TMPFS = "tmpfs"
    DISK = "disk"


@dataclass(slots=True)
class Read:
    """One thing to read, and (once `done`) what was read."""

    kind: Kind
    session: str
    pid: int = 0
    walk: DiskWalk | None = None
    rss: int = 0  # PSS: the process's RSS when asked
    tick: int = 0  # PSS: the sweep that asked
    # Its place among reads of its kind: the sessions' reads interleave, so
    # that one session with many processes does not hold the others back.
    rank: tuple[float, int] = (0.0, 0)
    done: bool = False
    pss: int | None = None  # PSS: None when the kernel would not say
    held: dict[tuple[int, int], int] = field(default_factory=dict)  # FDS
    mnt_ns: int = 0  # FDS: its mount namespace (inode), 0 if unreadable
    # FDS: its /tmp or /dev is not the daemon's: a sandbox's own namespace
    # (the zygote's and its workers' namespace differs from the daemon's
    # only by covers over closed directories: session_worker/worker/_reach.py).
    own_fs: bool = False
    tmpfs: int = 0  # TMPFS: bytes used


@dataclass(slots=True, frozen=True)
class HostIdentity:
    """What a process of the daemon's own mount namespace sees."""

    mnt_ns: int
    tmp_dev: int
    dev_dev: int


def host_identity() -> HostIdentity:
    def ino(path: str) -> int:
        try:
            return os.stat(path).st_ino
        except OSError:
            return 0

    def dev(path: str) -> int:
        try:
            return os.stat(path).st_dev
        except OSError:
            return -1

    return HostIdentity(ino("/proc/self/ns/mnt"), dev("/tmp"), dev("/dev"))


class Measurer:
    """The measuring thread, as the sweep sees it: a batch handed over
    (`submit`, on the loop), its reads back in a future of the loop."""

    def __init__(self) -> None:
        # One thread, one batch at a time; started at the first batch.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sessiond-measure", initializer=name_thread)
        self._host = host_identity()

    def submit(self, reads: list[Read]) -> asyncio.Future[list[Read]]:
        return asyncio.get_running_loop().run_in_executor(self._pool, run_batch, reads, self._host)

    def close(self) -> None:
        """A batch under way is let go (the daemon is stopping)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def run_batch(reads: list[Read], host: HostIdentity, budget: int = PROC_READS,
              walk_entries: int = WALK_ENTRIES) -> list[Read]:
    """Read in order until the budget is spent (in the measuring thread)."""
    spent = 0
    walks = sum(1 for read in reads if read.kind is Kind.DISK)
    # Each walk its share (a huge workspace does not hold the others' back).
    share = max(walk_entries // max(walks, 1), 256)
    for read in reads:
        if read.kind is Kind.DISK:
            if walk_entries > 0 and read.walk is not None:
                walk_entries -= read.walk.step(min(share, walk_entries))
                read.done = True
            continue
        if spent >= budget:
            continue
        if read.kind is Kind.PSS:
            read.pss = pss(read.pid)
            spent += 1
        elif read.kind is Kind.FDS:
            n = held_open(read, host)
            spent += 1 + n // FDS_PER_UNIT
        else:
            read.tmpfs = tmpfs_used(read.pid, host)
            spent += 1
        read.done = True
    return reads


def pss(pid: int) -> int | None:
    """smaps_rollup's Pss, in bytes; None if the kernel will not tell us (a
    non-root daemon and a non-dumpable process) or the process is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            data = f.read()
    except OSError:
        return None
    at = data.find(b"\nPss:")
    if at < 0:
        return None
    try:
        return int(data[at + 5:].split(None, 1)[0]) * 1024
    except (IndexError, ValueError):
        return None


def held_open(read: Read, host: HostIdentity) -> int:
    """The memfds (and, in the daemon's own mount namespace, POSIX shm
    files) the process holds open, by inode: fills `read.held`,
    `read.mnt_ns` and `read.own_fs`; returns the number of descriptors looked at.

    os.stat of /proc/PID/fd/N follows the link to the inode itself, so the
    size is that of the memfd even though it has no path.  Allocated
    blocks, not st_size: a sparse memfd costs nothing until written.  A
    /dev/shm file in a sandbox's own namespace lives on its /dev tmpfs,
    counted whole by `tmpfs_used`: not counted again here."""
    base = f"/proc/{read.pid}"
    try:
        read.mnt_ns = os.stat(f"{base}/ns/mnt").st_ino
    except OSError:
        read.mnt_ns = 0
    read.own_fs = bool(read.mnt_ns) and read.mnt_ns != host.mnt_ns and _own_fs(base, host)
    shm_too = not read.own_fs
    try:
        fds = os.listdir(f"{base}/fd")
    except OSError:
        return 0
    for name in fds[:MAX_FDS]:
        path = f"{base}/fd/{name}"
        try:
            target = os.readlink(path)
        except OSError:
            continue
        if not (target.startswith("/memfd:") or (shm_too and target.startswith("/dev/shm/"))):
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            read.held[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return min(len(fds), MAX_FDS)


def _own_fs(base: str, host: HostIdentity) -> bool:
    try:
        return (os.stat(f"{base}/root/tmp").st_dev != host.tmp_dev
                or os.stat(f"{base}/root/dev").st_dev != host.dev_dev)
    except OSError:
        return False


def tmpfs_used(pid: int, host: HostIdentity) -> int:
    """Bytes used on the private /tmp and /dev of a process in the
    sandbox's mount namespace.  Only a filesystem of its own counts: the
    host's /tmp or /dev (no namespaces, or a bind) is not the session's."""
    root = f"/proc/{pid}/root"
    try:
        root_dev = os.stat(root).st_dev
    except OSError:
        return 0
    total = 0
    seen: set[int] = set()
    for sub, host_dev in (("tmp", host.tmp_dev), ("dev", host.dev_dev)):
        path = f"{root}/{sub}"
        try:
            dev = os.stat(path).st_dev
            if dev in (root_dev, host_dev) or dev in seen:
                continue
            seen.add(dev)
            vfs = os.statvfs(path)
        except OSError:
            continue
        total += (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
    return total
