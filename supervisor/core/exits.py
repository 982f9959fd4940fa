"""A worker's exit, classified once and told in words (pure).

Runs in the daemon.  `classify` says why a worker exited (`ExitReason`)
from what the daemon recorded of it (`WorkerOwner.kill`'s reason, a stop
it asked for, whether it said Ready) and its exit code; `describe_exit`
is the line a client, the log and the model read.
"""

from __future__ import annotations

import signal

from ipc import messages as m
from ipc.contract import ExitReason
from supervisor.core.session import WorkerProc

__all__ = ["classify", "describe_exit"]


def classify(worker: WorkerProc, code: int | None) -> ExitReason:
    """Why it exited: the stop asked for, the first kill's reason, a boot that never said Ready, or its code."""
    if worker.expected:
        return worker.stop_reason or ExitReason.STOPPED
    if worker.kill_reason is not None:
        return worker.kill_reason
    if not worker.booted:  # (a worker that said Ready and then exits, 3 or not, crashed)
        return ExitReason.BOOT_FAILED
    if code == 0:
        return ExitReason.EXITED
    return ExitReason.CRASHED


def describe_exit(info: m.ExitInfo | None) -> str:
    """e.g. "killed_memory: memory cap 64 MiB exceeded at 131 MiB (signal SIGKILL)"."""
    if info is None:
        return "no exit recorded"
    how = f"signal {_signame(info.signal)}" if info.signal else f"exit code {info.code}"
    return f"{info.reason}: {info.detail} ({how})" if info.detail else f"{info.reason} ({how})"


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)
