"""sessionctl's `drain` (the sessionctl process): the request's arguments
and its report.  Text for people; with --json one object:

    {"node", "node_id", "draining", "moved": [{"session", "node"}],
     "left": [{"session", "state", "reason"}], "elapsed_secs"}

The exit code is 0 once the node has no session left (or an undo is
done), 1 if the drain left some (the node stays marked either way)."""

from __future__ import annotations

import argparse
import json
import math

from ipc import operator as op
from supervisor.ctl.render import EXIT_FAILED, EXIT_OK

__all__ = ["drain_exit_code", "drain_json", "drain_text", "timeout_secs"]

_MAX_TIMEOUT_SECS = op.DRAIN_MAX_TIMEOUT_SECS


def timeout_secs(text: str) -> float:
    """--timeout: seconds above 0, at most a week (the daemon checks again)."""
    try:
        secs = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(secs) or not 0 < secs <= _MAX_TIMEOUT_SECS:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most {_MAX_TIMEOUT_SECS:g}, got {text}")
    return secs


def drain_json(reply: op.DrainReply) -> str:
    return json.dumps({
        "node": reply.node, "node_id": reply.node_id, "draining": reply.draining,
        "moved": [{"session": x.session, "node": x.node} for x in reply.moved],
        "left": [{"session": x.session, "state": x.state, "reason": x.reason} for x in reply.left],
        "elapsed_secs": reply.elapsed_secs,
    })


def drain_text(reply: op.DrainReply, undo: bool) -> str:
    who = f"{reply.node} (node {reply.node_id[:12]})"
    if undo:
        return f"{who} takes new sessions again\n"
    lines = [f"drained {who} in {reply.elapsed_secs:.1f}s: {len(reply.moved)} session(s) moved, "
             f"{len(reply.left)} left"]
    width = max((len(sid) for sid in [*(x.session for x in reply.moved), *(x.session for x in reply.left)]),
                default=0)
    lines += [f"  moved  {x.session:<{width}}  -> {x.node}" for x in reply.moved]
    lines += [f"  left   {x.session:<{width}}  {x.state}: {x.reason}" for x in reply.left]
    if reply.draining:
        lines.append(f"no new session is placed there until `sessionctl drain --undo {reply.node}`")
    return "\n".join(lines) + "\n"


def drain_exit_code(reply: op.DrainReply) -> int:
    return EXIT_FAILED if reply.left else EXIT_OK
