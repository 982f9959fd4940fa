"""A worker's missed heartbeats judged: at once on this machine, after a
word from its node host on another (cluster mode).

Runs in the daemon's loop, called by the sweep (`supervisor.core.sweep`)
for a worker past its heartbeat allowance (HEARTBEATS_MISSED intervals).
On this machine such a worker is stuck (the daemon's own stalls are
excused by the sweep): it is killed, `killed_heartbeat`.

A worker on another machine is heard through its node host and Ray, and
their delays read as the worker's silence.  Seen on a busy 2-core machine:
a node host's loop held up for about a second while its worker beat on
time (two beats waiting in the socket when the host read again), so the
front killed a healthy worker as stuck; and a node that died was told as
the worker's missed heartbeats to the client (a `heartbeat` LimitExceeded)
before its loss.  So the spawner first asks the worker's node host how long
it has had nothing from the worker (`LosesWorkers.node_silence`), and:

- less than the allowance: the silence was on the way here, not the
  worker's; its heartbeat clock moves on to when its node last heard it;
- the allowance or more: the worker is silent where it runs: killed,
  `killed_heartbeat`, told so;
- no answer within the spawner's answer time, or no node host any more:
  the spawner has ended the worker as lost with its node (`node_lost`),
  which is what the client and the model are told.

One question per worker at a time; the sweep asks again once the moved-on
allowance runs out.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ipc.contract import ExitReason, LimitKind
from supervisor.core.events import EventLog
from supervisor.core.limits import HEARTBEATS_MISSED
from supervisor.core.session import Session, WorkerProc
from supervisor.core.workers import WorkerOwner
from supervisor.logtag import tagged
from supervisor.spawn.seams import LosesWorkers

__all__ = ["Silence"]

log = logging.getLogger("sessiond.manager")


class Silence:
    def __init__(self, events: EventLog, workers: WorkerOwner) -> None:
        self._events = events
        self._workers = workers
        self._asking: dict[int, asyncio.Task[None]] = {}  # worker pid -> the question to its node host

    def overdue(self, session: Session, worker: WorkerProc, now: float, interval: float) -> None:
        """`worker` has sent no heartbeat for more than its allowance
        (`interval` is the pace it beats at now)."""
        spawner = self._workers.spawner
        if not isinstance(spawner, LosesWorkers):
            self._kill(session, worker, now - worker.last_heartbeat, interval)
            return
        if worker.pid in self._asking:
            return
        tagged(log, session.id).info("no heartbeat from worker %d for %.1fs: asking its node host whether it is "
                                     "silent there", worker.pid, now - worker.last_heartbeat)
        task = asyncio.get_running_loop().create_task(self._ask(spawner, session, worker, interval))
        self._asking[worker.pid] = task
        task.add_done_callback(lambda _: self._asking.pop(worker.pid, None))

    async def _ask(self, spawner: LosesWorkers, session: Session, worker: WorkerProc, interval: float) -> None:
        asked = time.monotonic()
        there = await spawner.node_silence(worker.pid)
        if there is None or session.worker is not worker or worker.kill_reason is not None or worker.exited.done():
            return  # gone, or lost with its node: its exit says which
        if there < HEARTBEATS_MISSED * interval:
            self._workers.heard_from(worker, asked - there)
            tagged(log, session.id).info("worker %d: its node host heard from it %.1fs before it answered: "
                                         "held up on the way here, not stuck", worker.pid, there)
            return
        self._kill(session, worker, time.monotonic() - worker.last_heartbeat, interval,
                   f", nothing from it on its node for {there:.1f}s")

    def _kill(self, session: Session, worker: WorkerProc, silent: float, interval: float, there: str = "") -> None:
        self._events.emit_limit(session, LimitKind.HEARTBEAT, silent, HEARTBEATS_MISSED * interval)
        self._workers.kill(session, worker, ExitReason.KILLED_HEARTBEAT,
                           f"no heartbeat for {silent:.1f}s (interval {interval:g}s){there}: its event loop is stuck")

    def close(self) -> None:
        for task in list(self._asking.values()):
            task.cancel()
