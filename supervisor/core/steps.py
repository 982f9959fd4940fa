"""Durable steps inside a turn: the pure rules (no I/O).

Runs in the daemon.  A handler marks its work with `ctx.step(key, fn)`; the
worker sends each step's result (`StepDone`), the ledger journals it as a
`Step` record and answers `StepSaved` once it is durable (one group-commit
flush, the same journal and fencing as the turn's records).  When the
worker dies mid-turn, the ledger keeps the turn open (`Suspension`) and,
once the restarted worker is ready, hands it the same turn with its steps
(`Input.resumed`).  What is decided here, apart from the I/O:

* which deaths a turn resumes after (`resumes_after`): not a turn timeout
  (the turn ran out of time; resuming would only run it out again) nor an
  exit the daemon asked for (stop, restart, rm, hibernate);
* what the handler is told killed it (`cause_of`): the one phrase the agent
  puts in the interrupted tool's result;
* whether a step may be journaled (`step_problem`): its turn, its order, and
  the operator's size caps (a handler is untrusted for size).
"""

from __future__ import annotations

import signal

from ipc import messages as m
from ipc.contract import ExitReason
from ipc.settings import SessionSettings

__all__ = ["DAEMON_STOPPED", "cause_of", "resumes_after", "step_problem", "step_size"]

# The reason a turn resumes with after the daemon itself died during it.
DAEMON_STOPPED = "daemon_stopped"

# A step's key and kind are the handler's words, not data: bounded apart.
MAX_KEY_CHARS = 512
MAX_KIND_CHARS = 32
# What a step costs besides its result (its record, its entry here): counted
# against max_turn_steps_mb, so that a flood of empty steps is bounded too.
STEP_OVERHEAD_BYTES = 64

_NOT_RESUMED = frozenset({ExitReason.KILLED_TURN_TIMEOUT.value, ExitReason.STOPPED.value})


def resumes_after(settings: SessionSettings, info: m.ExitInfo) -> bool:
    """Whether a turn whose worker exited so is kept open to resume."""
    return settings.agent.worker.retry_aborted_turn and info.reason not in _NOT_RESUMED


def cause_of(info: m.ExitInfo, settings: SessionSettings) -> str:
    """What killed the worker, as the handler (and the model) is told:
    "memory cap of 64 MiB reached", "the worker crashed (signal SIGKILL)"."""
    limits = settings.agent.limits
    match info.reason:
        case ExitReason.KILLED_MEMORY:
            return f"memory cap of {limits.max_memory_mb} MiB reached"
        case ExitReason.KILLED_PROCESSES:
            return f"process limit of {limits.max_processes} reached"
        case ExitReason.KILLED_HEARTBEAT:
            return "the worker stopped answering (missed heartbeats) and was killed"
        case ExitReason.BOOT_FAILED:
            return "the worker failed to start again"
        case ExitReason.NODE_LOST:
            return f"the worker was lost with its node ({info.detail})"
    how = f"signal {_signame(info.signal)}" if info.signal else f"exit code {info.code}"
    return f"the worker crashed ({how})"


def step_size(key: str, result: bytes) -> int:
    """What a journaled step counts against `max_turn_steps_mb`."""
    return len(result) + len(key.encode()) + STEP_OVERHEAD_BYTES


def step_problem(settings: SessionSettings, turn: int | None, steps: list[m.StepResult],
                 step_bytes: int, msg: m.StepDone) -> str:
    """Why step `msg` cannot be journaled ('' when it can)."""
    if len(msg.key) > MAX_KEY_CHARS or len(msg.kind) > MAX_KIND_CHARS:
        return (f"step {msg.n}'s key or kind is too long ({len(msg.key)} and {len(msg.kind)} characters; "
                f"at most {MAX_KEY_CHARS} and {MAX_KIND_CHARS})")
    if msg.turn != turn:
        return f"step {msg.n} names turn {msg.turn}, but turn {turn} is running"
    if msg.n != len(steps):
        return f"step {msg.n} came out of order: {len(steps)} step(s) are journaled"
    ws = settings.agent.worker
    if len(msg.result) > ws.max_step_kb * 1024:
        return (f"step {msg.n} ({msg.key!r}) is {len(msg.result)} bytes, over "
                f"agent.worker.max_step_kb = {ws.max_step_kb}")
    if step_bytes + step_size(msg.key, msg.result) > ws.max_turn_steps_mb * 1024 * 1024:
        return (f"the turn's steps would hold {step_bytes + step_size(msg.key, msg.result)} bytes, over "
                f"agent.worker.max_turn_steps_mb = {ws.max_turn_steps_mb}")
    return ""


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)
