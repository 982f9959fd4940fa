"""The session state machine and the restart policy: pure logic, no I/O.

    starting ─ready─> idle ─input─> running ─turn_end─> idle
                       ▲              │ interrupt
                       │              ▼
                       └─turn_end─ interrupting
    idle ─hibernate─> hibernated ─spawn─> starting
    (any live) ─exit─> crashed ─backoff─> restarting ─spawn─> starting
                          └─give_up─> failed ─restart─> starting
    (any) ─stop─> stopping ─stopped─> stopped ─restart─> starting
    (any) ─delete─> deleted
    damaged ─repair─> hibernated      (its stored state failed to load; only
                                       repair or delete leave it: nothing runs)
    (any) ─damage─> damaged           (a read while it lives found its log damaged)

The session manager asks `transition()` for every change and emits the
result as a `StateChanged` event; an illegal move raises instead of leaving
a session in a state nobody planned for.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field

from supervisor.errors import InvalidTransition

__all__ = [
    "AT_REST",
    "InvalidTransition",
    "RestartDecision",
    "RestartPolicy",
    "State",
    "Trigger",
    "TRANSITIONS",
    "transition",
]


class State(enum.StrEnum):
    STARTING = "starting"
    IDLE = "idle"
    RUNNING = "running"
    INTERRUPTING = "interrupting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    CRASHED = "crashed"
    RESTARTING = "restarting"
    FAILED = "failed"
    HIBERNATED = "hibernated"
    DELETED = "deleted"
    DAMAGED = "damaged"  # stored state unreadable; kept untouched for the operator


class Trigger(enum.StrEnum):
    SPAWN = "spawn"  # a worker is being started
    READY = "ready"  # the worker booted
    INPUT = "input"
    INTERRUPT = "interrupt"
    TURN_END = "turn_end"
    EXIT = "exit"  # the worker died when we did not ask it to
    BACKOFF = "backoff"  # the restart delay began
    GIVE_UP = "give_up"  # restart intensity exceeded, or a boot failure at create
    HIBERNATE = "hibernate"
    STOP = "stop"
    STOPPED = "stopped"
    RESTART = "restart"  # the operator asked
    DELETE = "delete"
    REPAIR = "repair"  # the operator repaired its stored state
    DAMAGE = "damage"  # a read of its stored state (a boot, history, export) found damage
    RELEASE = "release"  # another daemon took it over: no worker here (supervisor.core.fencing)


S, T = State, Trigger

# States in which a worker process exists (or is being made).
LIVE = frozenset({S.STARTING, S.IDLE, S.RUNNING, S.INTERRUPTING})
# States a session rests in, with no worker and none on its way (the
# store's handle then holds no files open: SessionLog.at_rest).
AT_REST = frozenset({S.HIBERNATED, S.STOPPED, S.FAILED})

TRANSITIONS: dict[tuple[State, Trigger], State] = {
    (S.HIBERNATED, T.SPAWN): S.STARTING,
    (S.RESTARTING, T.SPAWN): S.STARTING,
    (S.STARTING, T.READY): S.IDLE,
    (S.IDLE, T.INPUT): S.RUNNING,
    (S.RUNNING, T.INTERRUPT): S.INTERRUPTING,
    (S.RUNNING, T.TURN_END): S.IDLE,
    (S.INTERRUPTING, T.TURN_END): S.IDLE,
    (S.IDLE, T.HIBERNATE): S.HIBERNATED,
    (S.CRASHED, T.BACKOFF): S.RESTARTING,
    # Loaded with the turn the daemon died in: restarted to resume it.
    (S.HIBERNATED, T.BACKOFF): S.RESTARTING,
    # No room to restart (max_concurrent_sessions, all busy): wait for input.
    (S.RESTARTING, T.HIBERNATE): S.HIBERNATED,
    (S.CRASHED, T.GIVE_UP): S.FAILED,
    (S.STARTING, T.GIVE_UP): S.FAILED,
    (S.FAILED, T.RESTART): S.STARTING,
    (S.STOPPED, T.RESTART): S.STARTING,
    (S.HIBERNATED, T.RESTART): S.STARTING,
    (S.CRASHED, T.RESTART): S.STARTING,
    (S.RESTARTING, T.RESTART): S.STARTING,
    (S.STOPPING, T.STOPPED): S.STOPPED,
    (S.DAMAGED, T.REPAIR): S.HIBERNATED,
    # Held by another daemon now: here it is as one with no worker.
    (S.STOPPING, T.RELEASE): S.HIBERNATED,
    (S.STOPPED, T.RELEASE): S.HIBERNATED,
    (S.FAILED, T.RELEASE): S.HIBERNATED,
    (S.CRASHED, T.RELEASE): S.HIBERNATED,
    (S.RESTARTING, T.RELEASE): S.HIBERNATED,
}
for _s in LIVE:
    TRANSITIONS[(_s, T.EXIT)] = S.CRASHED
for _s in State:
    if _s not in (S.STOPPED, S.DELETED, S.STOPPING, S.DAMAGED):
        TRANSITIONS[(_s, T.STOP)] = S.STOPPING
    if _s is not S.DELETED:
        TRANSITIONS[(_s, T.DELETE)] = S.DELETED
    if _s not in (S.DELETED, S.DAMAGED):
        TRANSITIONS[(_s, T.DAMAGE)] = S.DAMAGED


def transition(state: State, trigger: Trigger) -> State:
    try:
        return TRANSITIONS[(state, trigger)]
    except KeyError:
        raise InvalidTransition(state, trigger) from None


@dataclass(slots=True, frozen=True)
class RestartDecision:
    restart: bool
    delay_secs: float
    attempts_in_window: int


@dataclass(slots=True)
class RestartPolicy:
    """Erlang/OTP-style restart intensity with exponential backoff.

    At most `max_attempts` restarts within any `window_secs`; the delay
    before restart k (1-based, counted within the window) is
    `initial_ms * 2**(k-1)`, capped at `max_ms`.  Boot failures count like
    any other failure, so a handler that cannot start ends in `failed`
    after a few spaced attempts instead of a tight respawn loop.
    """

    max_attempts: int
    window_secs: float
    initial_ms: int
    max_ms: int
    _failures: collections.deque[float] = field(default_factory=collections.deque)

    def on_failure(self, now: float) -> RestartDecision:
        failures = self._failures
        failures.append(now)
        while failures and failures[0] <= now - self.window_secs:
            failures.popleft()
        n = len(failures)
        if n > self.max_attempts:
            return RestartDecision(False, 0.0, n)
        delay_ms = min(self.initial_ms * (2 ** (n - 1)), self.max_ms)
        return RestartDecision(True, delay_ms / 1000.0, n)

    def not_charged(self) -> RestartDecision:
        """A restart that is not the worker's failure (the store could not
        save what it sent): soon, and not counted within the window."""
        return RestartDecision(True, self.initial_ms / 1000.0, len(self._failures))

    def reset(self) -> None:
        self._failures.clear()
