"""A worker's missed heartbeats judged: after a look at whether the machine
starved it of CPU here; after a word from its node host on another
(cluster mode).

Runs in the daemon's loop, called by the sweep (`supervisor.core.sweep`)
for a worker past its heartbeat allowance (HEARTBEATS_MISSED intervals);
the daemon's own stalls are excused by the sweep before that.

On this machine a silent worker is watched for a moment
(`supervisor.host.schedstat`).  A stuck loop runs (a busy loop) or sleeps
(a blocking call); a healthy worker on a busy machine waits, runnable, for
a CPU: workers run below the daemon's priority, so on a loaded machine they
are the first to wait, and seen here one was not run for 4.6 s at a time.
So a worker waiting for a CPU most of the moment is starved, not stuck:
its silence counts only the share it could run (`own_silence`), and its
heartbeat clock moves on by the rest.  Starvation stretches an allowance
ten times at most: a busy loop on a loaded machine waits too, and is
killed, only later.  A worker that could run and did not beat is killed,
`killed_heartbeat`.

A worker on another machine is heard through its node host and Ray, and
their delays read as the worker's silence.  Seen on a busy 2-core machine:
a node host's loop held up for about a second while its worker beat on
time (two beats waiting in the socket when the host read again), so the
front killed a healthy worker as stuck; and a node that died was told as
the worker's missed heartbeats to the client (a `heartbeat` LimitExceeded)
before its loss.  So the spawner first asks the worker's node host how long
the worker has been silent there, as its own (`LosesWorkers.node_silence`;
the host watches it for starvation the same way), and:

- less than the allowance: the silence was on the way here, or the
  machine's, not the worker's; its heartbeat clock moves on to match;
- the allowance or more: the worker is silent where it runs: killed,
  `killed_heartbeat`, told so;
- no answer within the spawner's answer time, or no node host any more:
  the spawner has ended the worker as lost with its node (`node_lost`),
  which is what the client and the model are told.

One question per worker at a time; a beat that comes meanwhile ends it,
and the sweep asks again once the moved-on allowance runs out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from ipc.contract import ExitReason, LimitKind
from supervisor.core.events import EventLog
from supervisor.core.recorder import Recorder
from supervisor.core.limits import HEARTBEATS_MISSED, STARVED_SHARE, own_silence
from supervisor.core.session import Session, WorkerProc
from supervisor.core.workers import WorkerOwner
from supervisor.host import schedstat
from supervisor.logtag import tagged
from supervisor.spawn.seams import LosesWorkers

__all__ = ["Silence"]

log = logging.getLogger("sessiond.manager")

# A starved worker is logged as a warning at most this often (the first of
# many when the machine is loaded), as info otherwise.
STARVED_WARN_SECS = 60.0


class Silence:
    def __init__(self, events: EventLog, workers: WorkerOwner, metrics: Recorder) -> None:
        self._events = events
        self._workers = workers
        self._metrics = metrics
        self._warned_at = -math.inf  # a starved worker's line is a warning once a minute, else info
        self._asking: dict[int, asyncio.Task[None]] = {}  # worker pid -> the look at it

    def overdue(self, session: Session, worker: WorkerProc, now: float, interval: float) -> None:
        """`worker` has sent no heartbeat for more than its allowance
        (`interval` is the pace it beats at now)."""
        if worker.pid in self._asking:
            return
        spawner = self._workers.spawner
        remote = spawner if isinstance(spawner, LosesWorkers) else None
        if remote is not None:
            tagged(log, session.id).info("no heartbeat from worker %d for %.1fs: asking its node host whether "
                                         "it is silent there", worker.pid, now - worker.beat_at)
        task = asyncio.get_running_loop().create_task(self._ask(remote, session, worker, interval))
        self._asking[worker.pid] = task
        task.add_done_callback(lambda _: self._asking.pop(worker.pid, None))

    async def _ask(self, remote: LosesWorkers | None, session: Session, worker: WorkerProc,
                   interval: float) -> None:
        asked, clock, beat = time.monotonic(), worker.last_heartbeat, worker.beat_at
        waiting = None
        if remote is not None:
            own = await remote.node_silence(worker.pid)
        else:
            waiting = await schedstat.waiting_share(worker.pid)
            own = own_silence(asked - beat, waiting)
        if own is None or session.worker is not worker or worker.kill_reason is not None or worker.exited.done():
            return  # gone, or lost with its node: its exit says which
        if worker.beat_at == beat and worker.last_heartbeat != clock:
            return  # the daemon's stall was excused meanwhile (the sweep says so): judged again from there
        heard = worker.beat_at != beat  # a beat came meanwhile
        if heard or own < HEARTBEATS_MISSED * interval:
            self._workers.heard_from(worker, asked - own)
            if remote is not None:
                said = "it beat meanwhile" if heard else (f"its node host counts {own:.1f}s of silence as its own "
                                                         "(a wait for a CPU there is not)")
                tagged(log, session.id).info("worker %d: %s: held up on the way here, not stuck", worker.pid, said)
            elif heard:
                tagged(log, session.id).info("worker %d beat while it was watched: not stuck", worker.pid)
            else:
                self._starved(session, worker, asked - beat, waiting or 0.0, own)
            return
        if remote is not None:
            there = f", nothing from it on its node for {own:.1f}s"
        elif waiting is not None and waiting >= STARVED_SHARE:
            there = (f"; starved of CPU, waiting for one {waiting:.0%} of a {schedstat.PROBE_SECS:g}s look, but "
                     "silent longer than starvation excuses")
        else:
            there = ""
        self._kill(session, worker, time.monotonic() - worker.beat_at, interval, there)

    def _starved(self, session: Session, worker: WorkerProc, silent: float, waiting: float, own: float) -> None:
        self._metrics.worker_starved()
        level, now = logging.INFO, time.monotonic()
        if now - self._warned_at >= STARVED_WARN_SECS:
            level, self._warned_at = logging.WARNING, now
        tagged(log, session.id).log(
            level, "worker %d silent for %.1fs, waiting for a CPU %.0f%% of a %gs look: starved by the machine's "
            "load, not stuck; %.1fs of the silence counts against its heartbeat allowance "
            "(sessiond_workers_starved_total counts these)", worker.pid, silent, 100 * waiting,
            schedstat.PROBE_SECS, own)

    def _kill(self, session: Session, worker: WorkerProc, silent: float, interval: float, there: str) -> None:
        self._events.emit_limit(session, LimitKind.HEARTBEAT, silent, HEARTBEATS_MISSED * interval)
        self._workers.kill(session, worker, ExitReason.KILLED_HEARTBEAT,
                           f"no heartbeat for {silent:.1f}s (interval {interval:g}s){there}: its event loop is stuck")

    def close(self) -> None:
        for task in list(self._asking.values()):
            task.cancel()
