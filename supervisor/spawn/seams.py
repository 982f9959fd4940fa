"""The seams where other machines and stores plug in, as typed Protocols.

`Spawner`: start a worker for a session and hand back its pid and a framed
connection's socket, signal it, kill its whole tree, say whether anything of
the tree is left, report exits (code or signal, decoded once) through
`on_exit`, and say where a worker runs (`placement`); a worker ordered
ahead and not used is killed when it comes (`drop_pending`), and a spawner
whose workers die with their machine says so, and asks that machine before
a worker's silence is blamed on the worker (`LosesWorkers`).  The zygote
(`supervisor.spawn.spawner.ZygoteSpawner`) is the first implementation, Ray node
hosts (`supervisor.cluster.ray_spawner`) the second; `tests/test_spawner_contract.py`
is the suite every implementation must pass.  The state store's seam is
`supervisor.store.state_store.StateStore`.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

# Re-exported with the protocol whose callers catch it (core/, cluster/).
from supervisor.errors import SpawnerDied
from supervisor.spawn.pidfd import PidFd

__all__ = ["LosesWorkers", "Pending", "Spawner", "SpawnerDied", "drop_pending"]

_SIGKILL = signal.SIGKILL  # (the protocol has a method named `signal`)

# A worker ordered ahead (`Spawner.request`): its pid and its socket's end, once forked.
Pending = asyncio.Future[tuple[int, socket.socket]]


class Spawner(Protocol):
    # Called for every worker's exit: (pid, exit code or None, signal or None).
    on_exit: Callable[[int, int | None, int | None], None]
    # Called when every worker was lost at once (the zygote died).
    on_zygote_lost: Callable[[], None]

    @property
    def zygote_pid(self) -> int:
        """The process every worker and tool descends from (0 if none now)."""
        ...

    def request(self) -> asyncio.Future[tuple[int, socket.socket]]:
        """Order a worker now; resolves to its pid and the daemon's end of
        its socket, or fails with SpawnerDied."""
        ...

    def keep_spares(self, count: int) -> None: ...

    def signal(self, pid: int, sig: int) -> None:
        """Signal a worker's whole process group."""
        ...

    def kill_tree(self, pid: int, others: Iterable[PidFd] = (), sig: int = _SIGKILL) -> None:
        """Signal a worker's group and its descendants that left it."""
        ...

    def tree_alive(self, pid: int, others: Iterable[PidFd] = ()) -> bool: ...

    def placement(self, pid: int) -> tuple[int, str | None]:
        """Where a worker runs: its pid on its machine and that machine's
        address (None: this one).  A spawner whose workers run elsewhere
        hands out pids that are handles of its own, never a number of this
        machine's, so nothing here acts on a stranger by that number."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class LosesWorkers(Protocol):
    """A spawner whose workers run on other machines and can be lost with
    them (RaySpawner)."""

    on_worker_lost: Callable[[int, str], None]

    async def node_silence(self, pid: int) -> float | None:
        """How long the worker's own machine has had nothing from it, in
        seconds (what this machine hears adds the way here); None once the
        worker is gone or was lost (its exit is told: `on_exit`,
        `on_worker_lost`)."""
        ...


def drop_pending(spawner: Spawner, pending: Pending | None) -> None:
    """A worker was ordered but will not be used: kill it when it comes
    (runs in the daemon's loop)."""
    if pending is None:
        return

    def discard(fut: Pending) -> None:
        if not fut.cancelled() and fut.exception() is None:
            pid, sock = fut.result()
            sock.close()
            spawner.signal(pid, signal.SIGKILL)

    pending.add_done_callback(discard)
