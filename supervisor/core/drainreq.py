"""`sessionctl drain`'s request checked, for every daemon: who may drain,
and what a node and a timeout may be (hostile input until checked).

Runs in the daemon's loop.  A daemon in cluster mode then drains the node
(supervisor.cluster.drain.Drainer); any other answers `no_nodes`, without
importing anything of supervisor/cluster/ (a plain daemon never does).
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Awaitable, Callable

from ipc import operator as op
from supervisor.errors import BadRequest, Conflict, PermissionDenied

__all__ = ["MAX_TIMEOUT_SECS", "check", "check_request", "no_nodes"]

MAX_TIMEOUT_SECS = op.DRAIN_MAX_TIMEOUT_SECS
_NODE_ID = re.compile(r"[0-9a-f]{16,128}")


def check_request(node: object, timeout_secs: object) -> tuple[str, float | None]:
    """The request's node and timeout, or BadRequest saying what is wrong:
    a node is an IP address or a Ray node id (hex); a timeout is a finite
    number of seconds, above 0, at most a week."""
    if not isinstance(node, str) or not node:
        raise BadRequest("name the node by its IP address (the `node` of `sessionctl --json ls`) "
                         "or its Ray node id")
    if not _NODE_ID.fullmatch(node):
        try:
            node = str(ipaddress.ip_address(node))
        except ValueError as exc:
            raise BadRequest(f"{node[:80]!r} is neither an IP address nor a Ray node id") from exc
    if timeout_secs is None:
        return node, None
    if (not isinstance(timeout_secs, (int, float)) or isinstance(timeout_secs, bool)
            or not math.isfinite(timeout_secs) or not 0 < timeout_secs <= MAX_TIMEOUT_SECS):
        raise BadRequest(f"timeout_secs must be a number of seconds above 0 and at most "
                         f"{MAX_TIMEOUT_SECS:g}, not {timeout_secs!r}")
    return node, float(timeout_secs)


def check(is_admin: Callable[[int], bool], msg: op.Drain, uid: int) -> tuple[str, float | None]:
    """The `Drain` request from `uid`: an admin's, its node and timeout checked."""
    if not is_admin(uid):
        raise PermissionDenied("draining a node is for admins (root or [daemon] admin_uids)")
    return check_request(msg.node, msg.timeout_secs)


def no_nodes(is_admin: Callable[[int], bool]) -> Callable[[op.Drain, int], Awaitable[op.DrainReply]]:
    """The `Drain` request's answer where every session runs on this machine:
    checked as anywhere, then refused."""

    async def handle(msg: op.Drain, uid: int) -> op.DrainReply:
        check(is_admin, msg, uid)
        raise Conflict("this daemon runs every session on this machine ([cluster] backend = \"off\"): "
                       "there is no node to drain")

    return handle
