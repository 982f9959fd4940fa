"""Every exception the daemon (the sessiond process) defines, in one tree.

One module for the whole package, the leaf every folder of supervisor/ may
import: the core catches the store's and the spawner's errors without
importing a backend, a backend (files, memory, PostgreSQL, Ray) raises from
the same module the core catches from, and a reader finds every class a
request can meet here.  The client's side (sessionctl, supervisor.client)
has its own tree in supervisor/ctl/errors.py, the worker's in
session_worker/errors.py, the wire's in ipc/errors.py.

Answered to a client (the server maps each to an ipc Error{code, message}):

    SessiondError(code, message)        answered as ipc Error{code, message}
    ├── NotFound                        not_found: no such session
    ├── BadRequest                      bad_request: malformed or invalid arguments
    ├── Conflict                        conflict: the session's state forbids it now
    ├── Capacity                        capacity: no room for another live worker
    ├── LimitError                      limit_exceeded
    ├── PermissionDenied                permission_denied
    ├── NoSpace                         no_space: the state directory's disk is full
    └── Internal                        internal: our fault (zygote gone, I/O error)

The daemon's own (the core turns them into one of the above, or into a
session's state, at the point that knows what they mean):

    StartupError                        the daemon cannot start; the text says what to fix (startup.py)
    ClusterUnavailable                  cluster mode cannot start: Ray or its token (cluster/wiring.py)
    ConfigError                         config.toml or a --set value cannot be used (config.py)
    OverrideError                       a --set a client may not make; names the key (core/overrides.py)
    InvalidTransition                   no such state transition: a bug of ours, answered as internal
    StoreError                          a write did not become durable; nothing was acknowledged
    ├── StoreFull                       for want of space (ENOSPC, EDQUOT, EFBIG; PostgreSQL's disk)
    ├── IdTaken (also FileExistsError)  a create found its id taken by another daemon
    ├── Fenced                          a newer generation opened the session for writing
    │   └── NotHeld                     this front does not hold the session (core/fencing.py)
    ├── HeldElsewhere                   a claim refused: another daemon is running a turn of it
    ├── StoreDamaged                    the stored session is corrupt; loading must not paper over it
    ├── Unreachable                     PostgreSQL could not be reached within retry_secs
    └── Diverged                        PostgreSQL: the log does not end where this writer thought
    SpawnerDied                         no worker can be had now (the spawner's seam)
    └── ZygoteDied                      the zygote died or cannot be reached (spawn/spawner.py)
    SandboxUnavailable                  sandbox.mode = "required" on a host that cannot provide it
    NoLoopDevice                        no loop device for a workspace's disk image (spawn/diskimage.py)
    AncestryChanged                     a peer's ancestry kept changing while it was walked

Signals raised and caught inside one module (never escape it):

    AncestryMoved                       api/peer.py: an ancestor changed mid-walk; walk again
    AncestryHidden                      api/peer.py: part of the ancestry is alive but hidden

Anything else escaping a request handler is logged with its traceback and
answered as `internal`; the daemon never dies of one request.
"""

from __future__ import annotations

from typing import Any

from ipc.messages import ErrorCode

__all__ = [
    "AncestryChanged",
    "AncestryHidden",
    "AncestryMoved",
    "BadRequest",
    "Capacity",
    "ClusterUnavailable",
    "ConfigError",
    "Conflict",
    "Diverged",
    "Fenced",
    "HeldElsewhere",
    "IdTaken",
    "Internal",
    "InvalidTransition",
    "LimitError",
    "NoLoopDevice",
    "NoSpace",
    "NotFound",
    "NotHeld",
    "OverrideError",
    "PermissionDenied",
    "SandboxUnavailable",
    "SessiondError",
    "SpawnerDied",
    "StartupError",
    "StoreDamaged",
    "StoreError",
    "StoreFull",
    "Unreachable",
    "ZygoteDied",
]

# ---------------------------------------------------------------- answered to a client

class SessiondError(Exception):
    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(SessiondError):
    code = ErrorCode.NOT_FOUND


class BadRequest(SessiondError):
    code = ErrorCode.BAD_REQUEST


class Conflict(SessiondError):
    code = ErrorCode.CONFLICT


class Capacity(SessiondError):
    code = ErrorCode.CAPACITY


class LimitError(SessiondError):
    code = ErrorCode.LIMIT_EXCEEDED


class PermissionDenied(SessiondError):
    code = ErrorCode.PERMISSION_DENIED


class Internal(SessiondError):
    code = ErrorCode.INTERNAL


class NoSpace(SessiondError):
    """Nothing was saved for want of space.  Sent as `internal` to clients
    that did not say they know `no_space` (see ipc.messages.NEW_ERROR_CODES)."""

    code = ErrorCode.NO_SPACE


# ---------------------------------------------------------------- configuration


class StartupError(Exception):
    """The daemon cannot start; the text tells the operator what to fix."""


class ClusterUnavailable(Exception):
    """Cluster mode cannot start; the text says what to fix."""


class OverrideError(Exception):
    """An override a client may not make; the text names the key and why."""


class InvalidTransition(Exception):
    """No transition from this state on this trigger (core/states.py)."""

    def __init__(self, state: Any, trigger: Any) -> None:
        super().__init__(f"no transition from {state} on {trigger}")
        self.state = state
        self.trigger = trigger


class ConfigError(Exception):
    """A config file or an override that cannot be used; the text says which
    key, in which file, and why."""


# ---------------------------------------------------------------- the store


class StoreError(Exception):
    """A write that did not become durable; nothing was acknowledged."""


class StoreFull(StoreError):
    """The write failed for want of space (ENOSPC, EDQUOT, EFBIG)."""


class IdTaken(StoreError, FileExistsError):
    """A create found its id taken after all (another daemon on the same
    database created it first); the handle it returned writes nothing."""


class Fenced(StoreError):
    """This writer's generation is older than the session's: someone else
    opened the session for writing since."""

    def __init__(self, session: str, mine: int, current: int) -> None:
        super().__init__(
            f"session {session}: this writer holds generation {mine} but generation {current} "
            "has opened the session since; refusing to write (another daemon shares this "
            "state directory or database and took the session over)"
        )
        self.session = session
        self.mine = mine
        self.current = current


class NotHeld(Fenced):
    """A write for a session this daemon does not hold (released, or
    never claimed since it started)."""

    def __init__(self, session: str) -> None:
        StoreError.__init__(self, f"session {session} is held by another daemon; this daemon writes "
                                  "nothing for it until it claims it back (its next input, restart or stop)")
        self.session = session
        self.mine = self.current = 0


class HeldElsewhere(StoreError):
    """A claim refused: another daemon sharing the database holds the
    session and is running a turn of it (nothing was written)."""

    def __init__(self, session: str, holder: str, turn: int) -> None:
        super().__init__(
            f"session {session} is running turn {turn} on another daemon ({holder}); "
            "wait for the turn to end, or interrupt it there, then ask again")
        self.session = session
        self.holder = holder
        self.turn = turn


class StoreDamaged(StoreError):
    """The stored session is corrupt in a way that loading must not paper
    over.  `meta` is what could still be read (None: nothing); `repairable`
    says whether `repair()` can do anything about it."""

    def __init__(self, session: str, reason: str, meta: Any = None,
                 repairable: bool = True) -> None:
        super().__init__(f"session {session}: {reason}")
        self.session = session
        self.reason = reason
        # A supervisor.store.state_store.Meta, or None.  Typed loosely: this
        # leaf imports none of the store's model (the store imports it).
        self.meta = meta
        self.repairable = repairable


class Unreachable(StoreError):
    """The PostgreSQL server could not be reached within `retry_secs`:
    whatever was being written did not land (a commit names its start, so a
    late landing of it is found, not repeated, by the next attempt)."""


class Diverged(StoreError):
    """The session's log does not end where this writer thought: a commit
    reported failed (its server went away before the reply) did land.  The
    log learns where it really ends, so its next commit lands after it."""

    def __init__(self, session: str, log_end: int, expected: int) -> None:
        super().__init__(f"session {session}: its log ends at {log_end}, this writer expected "
                         f"{expected} (a commit reported failed had landed); refusing this one")
        self.log_end = log_end


# ---------------------------------------------------------------- starting workers


class SpawnerDied(Exception):
    """No worker can be had right now (the zygote died and is being
    restarted, or the spawner is closed); the text says which."""


class ZygoteDied(SpawnerDied):
    """The zygote died, or cannot be reached: ZygoteSpawner's SpawnerDied."""


class SandboxUnavailable(Exception):
    """`sandbox.mode = "required"` on a host that cannot provide it."""


class NoLoopDevice(Exception):
    """No loop device could be had for a workspace's disk image (all taken,
    or none can be opened here); the core answers it as `capacity`."""


# ---------------------------------------------------------------- the control socket's peers


class AncestryChanged(Exception):
    """The peer's ancestry kept changing while it was being walked."""


class AncestryMoved(Exception):
    """An ancestor exited or was re-parented while it was read: walk again
    (raised and caught inside api/peer.py)."""


class AncestryHidden(Exception):
    """Part of the ancestry is alive but hidden from us (raised and caught
    inside api/peer.py)."""
