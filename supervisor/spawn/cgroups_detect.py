"""Which cgroups the daemon may manage, found once at start (`[daemon]
cgroups = "auto"`; the order and what each gives: `supervisor.spawn.cgroups`).
Runs in the daemon only."""

from __future__ import annotations

import os

from supervisor.spawn import cgroups_v1, cgroups_v2
from supervisor.spawn.cgroups import Cgroups

__all__ = ["detect"]


def detect(setting: str, nice: int = 0) -> tuple[Cgroups | None, str]:
    """(Cgroups, '') where the daemon may manage cgroups, else (None, why).
    `nice`: the sessions' CPU weight as a nice level (0: the daemon's)."""
    if setting == "off":
        return None, "[daemon] cgroups = off"
    v2, why_v2 = cgroups_v2.detect(nice)
    if v2 is not None:
        return v2, ""
    if os.geteuid() != 0:
        return None, f"{why_v2}; cgroup v1 is for a root daemon only"
    v1, why_v1 = cgroups_v1.detect(nice)
    if v1 is not None:
        return v1, ""
    return None, f"{why_v2}; {why_v1}"
