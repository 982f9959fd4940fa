"""The daemon <-> zygote link's messages (supervisor.spawn.spawner in the
daemon, session_worker.zygote in the zygote): framed and tagged as every
message of ipc/messages.py, whose rules they follow."""

from __future__ import annotations

from ipc.messages import _Msg

__all__ = ["SpawnWorker", "KeepSpares", "Spawned", "SpawnFailed", "Exited", "ToZygote", "FromZygote"]


class SpawnWorker(_Msg, tag="spawn"):
    """Hand over a worker: a spare one if there is one, else a new fork."""

    token: int


class KeepSpares(_Msg, tag="spares"):
    """How many booted-but-unassigned workers to keep ready."""

    count: int


class Spawned(_Msg, tag="spawned"):
    """Sent with the daemon's end of the worker's socket attached (SCM_RIGHTS)."""

    token: int
    pid: int


class SpawnFailed(_Msg, tag="spawn_failed"):
    """No worker for this order: fork failed (EAGAIN or ENOMEM at the task
    or memory ceiling, after retries; EMFILE...), and the zygote lives on."""

    token: int
    errno: int
    message: str = ""


class Exited(_Msg, tag="exited"):
    pid: int
    code: int | None = None
    signal: int | None = None


ToZygote = SpawnWorker | KeepSpares
FromZygote = Spawned | SpawnFailed | Exited
