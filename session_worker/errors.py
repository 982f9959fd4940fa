"""Errors of the worker side: run by the zygote (which imports everything
before it forks), by each session's worker, by a handler inside it, and by
the MCP lister.
The tool host (toolhost/host.py) is a standalone standard-library script and
imports none of this; its failures reach the worker as messages, which
worker/sandbox.py turns into these.

    TurnFailure(reason, record)     a handler fails the current turn; `record` is still committed
    └── StepError                   a step (ctx.step) could not be journaled, or a resumed turn
                                    asked for other steps than it journaled
    SpawnError                      a sub-agent could not be run; the model reads the message
    CommandRefused                  `ctx.run` did not run the command: bash not enabled, a
                                    permission rule or the user said no, no sandbox to run it in
    HandlerLoadError                a handler name that resolves to no factory (the boot fails)
    SandboxError                    the tools' host could not be started or has gone away
    ├── CommandError                the host is up but could not start this command
    └── OrderNotSent                the host was gone before it took the order: safe to start
                                    it again (raised and caught inside worker/sandbox.py)
    UnsupportedArch                 no seccomp syscall table for this machine: run without
                                    seccomp, and say so
    ClosedPython                    the zygote cannot open the daemon's Python to the session
                                    uids (worker/_reach.py); the daemon's start-up fails with it
    StopWhileIdle                   SIGTERM while the worker waits for its first input
                                    (raised and caught inside worker/main.py)

The agent handler's own tree (AgentError: the provider's failures, tools that
cannot load) is session_worker/agent/_errors.py: it stays inside the agent,
which maps it to TurnFailure at one place.  Errors that cross to the daemon
are never these objects: a turn's failure, a boot's failure go out as the
ipc messages' typed fields (reason, exit code), never pickled.

TurnFailure, SpawnError and CommandRefused are also importable from session_worker.handler,
the interface a handler's author programs against (docs/agent.md).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ClosedPython",
    "CommandError",
    "CommandRefused",
    "HandlerLoadError",
    "OrderNotSent",
    "SandboxError",
    "SpawnError",
    "StepError",
    "StopWhileIdle",
    "TurnFailure",
    "UnsupportedArch",
]


# ---------------------------------------------------------------- a handler's


class TurnFailure(Exception):
    """Fails the current turn; `record` (if not None) is still committed."""

    def __init__(self, reason: str, record: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.record = record


class StepError(TurnFailure):
    """A durable step failed as a step (too large, not msgpack-able, not
    saved, or not the step a resumed turn journaled at that place)."""


class SpawnError(Exception):
    """A sub-agent could not be run; the message is readable by the model."""


class CommandRefused(Exception):
    """`ctx.run` did not run the command; the message says why (readable by a model)."""


class HandlerLoadError(Exception):
    """A handler name that cannot be resolved to a factory."""


# ---------------------------------------------------------------- the tools' sandbox


class SandboxError(Exception):
    """The tool host could not be started or has gone away."""


class CommandError(SandboxError):
    """The host is up but could not start this command."""


class OrderNotSent(SandboxError):
    """The host was gone before it took the order: safe to start it again."""


class ClosedPython(Exception):
    """The session uids cannot read the daemon's Python, and the zygote
    cannot open it to them (it lacks CAP_SYS_ADMIN)."""


class UnsupportedArch(Exception):
    """No syscall table for this machine: run without seccomp, and say so."""


# ---------------------------------------------------------------- the worker's own


class StopWhileIdle(Exception):
    """SIGTERM while the worker waits for its first input (see worker/main.py's `_Link`)."""
