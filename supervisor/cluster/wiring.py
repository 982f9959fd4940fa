"""Cluster mode's wiring into the daemon (`[cluster] backend = "ray"`).

Kept apart from `supervisor.daemon` so that Ray is imported only when
cluster mode is on (it is the optional `cluster` extra), and so that what
changes between one machine and many is in one place:

- no local zygote: every worker runs on a node host (`supervisor.cluster.nodehost`);
- no cgroups on the front: the workers are not on this machine (the node's
  zygote, the worker's own rlimits and sandbox still confine them);
- the memory sweep reads remote workers' figures from their node hosts
  (the spawner is the manager's `remote`, supervisor.daemon);
- a worker lost with its node is a crash that names the node (the
  spawner's `on_worker_lost`, routed by supervisor.core.workers);
- joining checks the head first (reachable; Ray's token authentication,
  `[cluster] auth_token_file`), so a start fails in one line, not after
  Ray's own minutes of retries.

Runs in the daemon.
"""

from __future__ import annotations

import logging
import os
import socket
import stat

from supervisor.config import Config
from supervisor.cluster.ray_spawner import RaySpawner
from supervisor.errors import ClusterUnavailable
from supervisor.spawn.seams import SpawnerDied

__all__ = ["ClusterUnavailable", "join"]

# How long joining waits for the Ray head's port to answer at all.
_CONNECT_TIMEOUT_SECS = 5.0

log = logging.getLogger("sessiond.cluster")


def join(cfg: Config) -> RaySpawner:
    """Join the Ray cluster (before the daemon's loop exists: ray.init
    blocks and starts threads, and nothing is forked after it)."""
    if cfg.cluster.auth_token_file:
        use_token(cfg.cluster.auth_token_file)
    spawner = RaySpawner(cfg.cluster)
    try:
        _check_reachable(cfg.cluster.address)
        _check_token(cfg.cluster.address)
        spawner.connect()
    except SpawnerDied as exc:
        raise ClusterUnavailable(f"[cluster] address = {cfg.cluster.address!r}: {exc}") from None
    log.info("cluster mode: workers run on Ray node hosts with free %r slots (namespace %r)",
             cfg.cluster.resource, cfg.cluster.namespace)
    return spawner


def use_token(path: str) -> None:
    """Speak to Ray with the token in `path` (Ray's token authentication:
    every gRPC call carries it; a cluster started with RAY_AUTH_MODE=token
    refuses calls without it).  The file must be the daemon's own: a token
    others can read is anyone's way into every node."""
    where = f"[cluster] auth_token_file = {path!r}"
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            token = f.read(4097).strip()
    except OSError as exc:
        raise ClusterUnavailable(f"{where}: cannot read it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ClusterUnavailable(f"{where}: not a regular file")
    if st.st_mode & 0o077:
        raise ClusterUnavailable(f"{where}: others may read it (mode {stat.S_IMODE(st.st_mode):o}); "
                                 f"chmod 600 it")
    if not token or len(token) > 4096:
        raise ClusterUnavailable(f"{where}: holds no token" if not token else f"{where}: too long for a token")
    # Read by Ray's C++ side at ray.init, in this process only: the daemon
    # forks nothing afterwards, and node hosts do not pass it on (see
    # supervisor.spawn.spawner: the zygote's environment has no RAY_ variable).
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.abspath(path)
    os.environ.pop("RAY_AUTH_TOKEN", None)


def _check_reachable(address: str) -> None:
    """ray.init retries an unreachable head for minutes, saying so only in
    its own log lines: try the head's port first, and say it in one line."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or address.startswith(("ray://", "auto")):
        return  # "auto", empty, or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_SECS).close()
    except OSError as exc:
        raise SpawnerDied(f"cannot reach the Ray head at {address}: {exc.strerror or exc}") from None


def _check_token(address: str) -> None:
    """ray.init retries a refused token for 20 s, then says only that it
    could not connect: ask the head's GCS once, and say why in one line.
    (Ray's GcsClient; anything but a refusal is left to ray.init.)"""
    if not address or address.startswith(("ray://", "auto")):
        return
    try:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]
        from ray.exceptions import AuthenticationError
    except ImportError:
        return
    try:
        GcsClient(address=address).cluster_id
    except AuthenticationError:
        if os.environ.get("RAY_AUTH_MODE") == "token":
            raise SpawnerDied(f"the Ray cluster at {address} refused this daemon's token (from "
                              f"{os.environ.get('RAY_AUTH_TOKEN_PATH') or 'the environment'}): "
                              "not the token its nodes were started with") from None
        raise SpawnerDied(f"the Ray cluster at {address} requires token authentication: set "
                          "[cluster] auth_token_file to a file holding its token") from None
    except Exception:
        return
