"""Cluster mode's wiring into the daemon (`[cluster] backend = "ray"`).

Kept apart from `supervisor.daemon` so that Ray is imported only when
cluster mode is on (it is the optional `cluster` extra), and so that what
changes between one machine and many is in one place:

- no local zygote: every worker runs on a node host (`supervisor.nodehost`);
- no cgroups on the front: the workers are not on this machine (the node's
  zygote, the worker's own rlimits and sandbox still confine them);
- the memory sweep reads remote workers' figures from their node hosts;
- a worker lost with its node is a crash that names the node.

Runs in the daemon.
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

from supervisor.config import Config
from supervisor.ray_spawner import RaySpawner
from supervisor.seams import SpawnerDied

if TYPE_CHECKING:
    from supervisor.manager import SessionManager

__all__ = ["ClusterUnavailable", "join", "wire"]

log = logging.getLogger("sessiond.cluster")


class ClusterUnavailable(Exception):
    """Cluster mode cannot start; the text says what to fix."""


def join(cfg: Config) -> RaySpawner:
    """Join the Ray cluster (before the daemon's loop exists: ray.init
    blocks and starts threads, and nothing is forked after it)."""
    spawner = RaySpawner(cfg.cluster)
    try:
        spawner.connect()
    except SpawnerDied as exc:
        raise ClusterUnavailable(f"[cluster] address = {cfg.cluster.address!r}: {exc}") from None
    log.info("cluster mode: workers run on Ray node hosts with free %r slots (namespace %r)",
             cfg.cluster.resource, cfg.cluster.namespace)
    return spawner


def wire(spawner: RaySpawner, manager: SessionManager) -> None:
    """Remote workers' memory as their nodes measure it, for the sweep; a
    worker lost with its node: a crash whose detail names the node."""
    manager.proc_table.remote = spawner.reported_rss
    manager.proc_table.remote_procs = spawner.reported_procs
    spawner.on_worker_lost = lambda pid, why: manager.workers.on_exit(pid, None, signal.SIGKILL, detail=why)
