"""The daemon <-> zygote link's messages (supervisor.spawn.spawner in the
daemon, session_worker.zygote in the zygote): framed and tagged as every
message of ipc/messages.py, whose rules they follow."""

from __future__ import annotations

from ipc.wirebase import Msg

__all__ = ["SpawnWorker", "KeepSpares", "Spawned", "SpawnFailed", "Exited", "Preloaded", "ToZygote", "FromZygote"]


class SpawnWorker(Msg, tag="spawn"):
    """Hand over a worker: a spare one if there is one, else a new fork."""

    token: int


class KeepSpares(Msg, tag="spares"):
    """How many booted-but-unassigned workers to keep ready."""

    count: int


class Spawned(Msg, tag="spawned"):
    """Sent with the daemon's end of the worker's socket attached (SCM_RIGHTS)."""

    token: int
    pid: int


class SpawnFailed(Msg, tag="spawn_failed"):
    """No worker for this order: fork failed (EAGAIN or ENOMEM at the task
    or memory ceiling, after retries; EMFILE...), and the zygote lives on."""

    token: int
    errno: int
    message: str = ""


class Exited(Msg, tag="exited"):
    pid: int
    code: int | None = None
    signal: int | None = None


class Preloaded(Msg, tag="preloaded"):
    """The zygote's first word, when the daemon gave it modules to preload or
    sessions of their own uids: empty `error` when they are in, else what
    failed (naming the module or the directory, and the fix)."""

    error: str = ""


ToZygote = SpawnWorker | KeepSpares
FromZygote = Spawned | SpawnFailed | Exited | Preloaded
