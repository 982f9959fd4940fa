"""The zygote (run by the zygote process: forked by the daemon before it has
a thread or a loop, or started by exec, `python -P -m session_worker.zygote`,
by the daemon after a death and by a Ray node host): `zygote_main` prepares
and preloads, then `Zygote.serve` forks a worker per order, reaps, reports
exits and hunts strays (server.py); `__main__.py` is the exec entry.  After
fork, `_worker_child` runs briefly in the new worker before `run_worker`.

May import: ipc/, session_worker.errors and the worker's code it preloads
(session_worker.worker, session_worker.echo, session_worker.agent).  The
daemon imports `session_worker.zygote` by name in the forked child
(supervisor.spawn.spawner) and calls `zygote_main`: this face.
"""

from __future__ import annotations

from session_worker.zygote.server import Zygote, zygote_main

__all__ = ["Zygote", "zygote_main"]
