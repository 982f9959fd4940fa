"""Another front, as far as drain marks go: joins the Ray cluster and
marks a node draining through its node host, then, once told on stdin,
unmarks it.  For tests/test_cluster.py (joining Ray starts threads, which
the test process must not have).

    python tests/ray_other_front.py ADDRESS NODE_IP

Prints "marked" once the node host holds the mark, "unmarked" after.
"""

from __future__ import annotations

import asyncio
import sys

from supervisor.config import ClusterSettings
from supervisor.cluster.ray_spawner import RaySpawner


async def _run(address: str, ip: str) -> None:
    spawner = RaySpawner(ClusterSettings(backend="ray", address=address))
    spawner.connect()
    spawner.attach(asyncio.get_running_loop())
    node_id, ip = await spawner.find_node(ip)
    await spawner.mark_draining(node_id, ip, True)
    print("marked", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    await spawner.mark_draining(node_id, ip, False)
    print("unmarked", flush=True)
    spawner.close()


if __name__ == "__main__":
    asyncio.run(_run(sys.argv[1], sys.argv[2]))
