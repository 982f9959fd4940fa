"""Runs the `Spawner` contract suite against the Ray spawner, in a process
of its own: joining Ray starts threads, and the test process must stay
single-threaded (the zygote's contract forks from it).

    python tests/ray_contract_child.py ADDRESS

Prints one JSON line per check: {"check", "ok", "error", "secs"}.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_spawner_contract import CHECKS, Exits, remove_workspaces  # noqa: E402

from supervisor.config import ClusterSettings  # noqa: E402
from supervisor.cluster.ray_spawner import RaySpawner  # noqa: E402


async def _run(address: str) -> None:
    for check in CHECKS:
        began = time.monotonic()
        spawner = RaySpawner(ClusterSettings(backend="ray", address=address))
        spawner.connect()
        spawner.attach(asyncio.get_running_loop())
        exits: Exits = []
        spawner.on_exit = lambda pid, code, sig: exits.append((pid, code, sig))
        error = ""
        try:
            await asyncio.wait_for(check(spawner, exits), 60)
        except BaseException:
            error = traceback.format_exc()
        finally:
            spawner.close()
            remove_workspaces()
        print(json.dumps({"check": check.__name__.strip("_"), "ok": not error, "error": error,
                          "secs": round(time.monotonic() - began, 3)}), flush=True)


if __name__ == "__main__":
    asyncio.run(_run(sys.argv[1]))
