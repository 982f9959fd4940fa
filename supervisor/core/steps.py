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
* whether a step's start or end may be journaled (`step_problem`): its
  turn, its number, and the operator's size caps (a handler is untrusted
  for size and for how many steps it keeps in flight);
* what a resumed turn is told (`plan_resume`), from the turn's step
  records read back from the store.

Steps may overlap (docs/agent.md, "Durable steps"): a step is known by its
number `n`, the order in which the turn *started* it, and its key; its
records come in the order steps began (`StepStart`) and ended (`Step`).
After a death, a step that began and did not end was in flight; the
daemon holds only those (and byte counts) in memory, never a result.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ipc import messages as m
from ipc.contract import ExitReason
from ipc.settings import SessionSettings
from supervisor.store.state_store import STEP_OVERHEAD_BYTES, Step, StepRecord, StepStart

__all__ = ["DAEMON_STOPPED", "MAX_STEPS_IN_FLIGHT", "ResumePlan", "cause_of", "plan_resume", "resumes_after",
           "step_problem"]

# The reason a turn resumes with after the daemon itself died during it.
DAEMON_STOPPED = "daemon_stopped"

# A step's key and kind are the handler's words, not data: bounded apart.
MAX_KEY_CHARS = 512
MAX_KIND_CHARS = 32
# Steps begun and not ended at once: the daemon holds each one's key until
# it ends (the agent runs at most max_tool_calls_per_turn at once).
MAX_STEPS_IN_FLIGHT = 1024
# A step number fits the records' and the wire's integers everywhere.
_MAX_STEP_NUMBER = 1 << 31

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


def step_problem(settings: SessionSettings, turn: int | None, step_bytes: int, flying: Mapping[int, str],
                 msg: m.StepBegun | m.StepDone) -> str:
    """Why step `msg`'s start or end cannot be journaled ('' when it can).
    `step_bytes`: what the turn's step records hold so far; `flying`: the
    steps of this worker begun and not ended (number -> key)."""
    if len(msg.key) > MAX_KEY_CHARS or len(msg.kind) > MAX_KIND_CHARS:
        return (f"step {msg.n}'s key or kind is too long ({len(msg.key)} and {len(msg.kind)} characters; "
                f"at most {MAX_KEY_CHARS} and {MAX_KIND_CHARS})")
    if msg.turn != turn:
        return f"step {msg.n} names turn {msg.turn}, but turn {turn} is running"
    if not 0 <= msg.n < _MAX_STEP_NUMBER:
        return f"step number {msg.n} is out of range"
    began = flying.get(msg.n)
    ws = settings.agent.worker
    if isinstance(msg, m.StepBegun):
        if began is not None:
            return f"step {msg.n} ({msg.key!r}) began twice"
        if len(flying) >= MAX_STEPS_IN_FLIGHT:
            return f"step {msg.n} ({msg.key!r}) would be more than {MAX_STEPS_IN_FLIGHT} steps in flight at once"
        size = len(msg.key.encode()) + STEP_OVERHEAD_BYTES
    else:
        if began is not None and began != msg.key:
            return f"step {msg.n} began as {began!r} and ended as {msg.key!r}"
        if len(msg.result) > ws.max_step_kb * 1024:
            return (f"step {msg.n} ({msg.key!r}) is {len(msg.result)} bytes, over "
                    f"agent.worker.max_step_kb = {ws.max_step_kb}")
        size = len(msg.result) + len(msg.key.encode()) + STEP_OVERHEAD_BYTES
    if step_bytes + size > ws.max_turn_steps_mb * 1024 * 1024:
        return (f"the turn's steps would hold {step_bytes + size} bytes, over "
                f"agent.worker.max_turn_steps_mb = {ws.max_turn_steps_mb}")
    return ""


@dataclass(slots=True, frozen=True)
class ResumePlan:
    """What a resumed turn is told: its journaled results and the steps in
    flight (by number), and where it resumes (the lowest number not ended)."""

    steps: list[m.StepResult]
    in_flight: list[m.StepInFlight]
    step: int

    def resumed(self, reason: str, cause: str, uncertain: bool) -> m.Resumed:
        running = self.in_flight[0].key if self.in_flight else ""
        return m.Resumed(reason=reason, cause=cause, step=self.step, running=running, uncertain=uncertain,
                         steps=self.steps, in_flight=self.in_flight)


def plan_resume(records: Iterable[StepRecord]) -> ResumePlan:
    """The turn's step records (`StepStart`, `Step`: in the order they were
    journaled, from every run of the turn so far) as a resume: a step
    ended (a result, or a failure: run again) is never in flight; the
    first record of a number counts (a worker is untrusted)."""
    ended: dict[int, Step] = {}
    began: dict[int, StepStart] = {}
    for rec in records:
        if isinstance(rec, Step):
            ended.setdefault(rec.n, rec)
        else:
            began.setdefault(rec.n, rec)
    step = 0
    while step in ended:
        step += 1
    return ResumePlan(
        steps=[m.StepResult(key=s.key, result=s.result, n=n) for n, s in sorted(ended.items()) if not s.failed],
        in_flight=[m.StepInFlight(n=n, key=b.key) for n, b in sorted(began.items()) if n not in ended],
        step=step,
    )


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)
