"""How much of a moment a process spent waiting for a CPU: the kernel's
scheduler statistics of its main thread (`/proc/PID/schedstat`: time on a
CPU, then time runnable but waiting for one, in nanoseconds).

Asked of a worker silent past its heartbeat allowance before it is judged
stuck (supervisor.core.silence on this machine, the node host's
`silent_for` on another).  A worker whose loop is stuck runs (a busy loop)
or sleeps (a blocking call); one the machine starves of CPU waits,
runnable, for most of the while.  Measured on a 2-core machine: a nice-10
worker doing 50 ms of work every 0.5 s beside 20 busy loops went 4.6 s at
a time without running, 98% of it waiting for a CPU; one held to 2% of a
CPU by a CFS bandwidth limit (a unit's `CPUQuota=`) went 0.96 s, the same
way.  Workers run below the daemon's priority (`[daemon] session_nice`),
so on a busy machine they are the first to wait.

Where the kernel keeps no such statistics (built without
CONFIG_SCHED_INFO) or the process is gone, the answer is None and the
silence is judged as it stands.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["PROBE_SECS", "waiting_share"]

# How long a silent worker is watched, and how often its state is read
# meanwhile.  Long against the scheduler's slices (milliseconds), short
# against any heartbeat allowance.
PROBE_SECS = 0.2
_LOOKS = 10


def _times_ns(pid: int) -> tuple[int, int] | None:
    """(time on a CPU, time waited for one), as far as the kernel has
    counted it: a wait is added when it ends, as the task gets a CPU."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            ran, waited = f.read().split()[:2]
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


def _runnable(pid: int) -> bool | None:
    """Whether its main thread is running or waiting to (state R)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"R"
    except (OSError, IndexError):
        return None


async def waiting_share(pid: int, secs: float = PROBE_SECS) -> float | None:
    """The share (0 to 1) of the next `secs` that process `pid` spent
    runnable but waiting for a CPU; None, at once, where that cannot be
    read.

    The kernel adds a wait to the process's statistics only when it ends,
    so a wait still going on is seen as the share of looks that found it
    runnable less the share of the time it ran; a wait that ended within
    the probe, from the statistics."""
    first, began = _times_ns(pid), time.monotonic()
    if first is None:
        return None
    runnable = 0
    for _ in range(_LOOKS):
        await asyncio.sleep(secs / _LOOKS)
        state = _runnable(pid)
        if state is None:
            return None
        runnable += state
    last, ended = _times_ns(pid), time.monotonic()
    if last is None or ended <= began:
        return None
    window = ended - began
    ran, waited = ((b - a) / 1e9 / window for a, b in zip(first, last, strict=True))
    return min(max(runnable / _LOOKS - ran, waited, 0.0), 1.0)
