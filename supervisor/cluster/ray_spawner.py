"""The `Spawner` seam over Ray: workers on node hosts of a Ray cluster.

Cluster mode's front half (`[cluster] backend = "ray"`); the node half is
`supervisor.cluster.nodehost`.  The daemon's `WorkerOwner` is unchanged: it gets,
for each worker, a pid and a local socket it speaks framed msgpack on, as
from the zygote.  Here that socket is one end of a local socketpair; two
bridge tasks pump the other end's bytes through Ray:

    WorkerOwner ══ socketpair ══ bridge ── host.send(pid, bytes) ──►  worker
                                        ◄─ host.frames(pid) ───────  (streaming generator)

Placement: each worker holds a one-bundle placement group of the
configured custom resource (`[cluster] resource`, one slot); Ray chooses
the node, so capacity is Ray's bookkeeping, not ours, and no Ray actor
(~40 MiB) exists per session: the node's one node host forks the worker.
The group is removed once the worker's process group is empty, which
gives the slot back.

Draining (`sessionctl drain`, `supervisor.cluster.drain`): a node marked draining
gets no new worker.  The mark is kept by the node's host (so that every
front learns it: a draining host refuses `spawn`, and the front that tried
places again), and each front keeps the marks it knows in a label
selector on every placement group it asks for (`ray.io/node-id` is not
one of them), so Ray itself places the slot elsewhere.  A front re-reads
the marks it knows from their hosts every few seconds, so an undo on one
front reaches the others.

Pids: the pid WorkerOwner sees is a handle of this front's (above any real
pid_max), never the number on the worker's node, so nothing on the front's
machine (the memory sweep's /proc reads, cgroups, pidfds) can act on a
stranger that has that number here.  `placement(pid)` gives the real pid
and the node's address for `status`.

Memory: the node host measures each worker's tree (RSS, as the sweep does
on one machine) and sends the figure on the same stream when it changes;
`reported_rss` feeds it to the daemon's sweep (`ProcTable.remote`), which
decides caps as on one machine and kills through `kill_tree`.

Leases: a node host keeps a front's workers only while that front renews
its lease (`[cluster] front_lease_secs`), so a front that dies does not
leave workers running on the nodes: Ray does not cancel a dead caller's
streaming call, and an idle worker's stream would never notice.

Exits: the frames stream ends with the worker's exit (code or signal, as
its zygote decoded it), classified by WorkerOwner as any other.  A stream
that breaks (the node host's actor or its whole node died) is a lost
worker: `on_worker_lost(pid, why)`, with a detail that starts
NODE_LOST_PREFIX ("node_lost: ") and names the node, which the daemon
reports as `node_lost` (whatever it tried first), so a turn it was running
resumes or fails saying so.  Kills and signals are actor calls that the
node host carries out through its pidfds; `tree_alive` is what the stream
last said (the node host says "gone" once the worker's group is empty).
What the front hears of a worker comes through its node host and Ray:
before missed heartbeats are blamed on the worker, its node host is asked
how long it has had nothing from it (`node_silence`).

A node host that does not answer (its process frozen, or its machine cut
off while Ray has not yet declared it dead): a kill it does not carry out
in time, or a spawn or a question it does not answer, makes the front
give up on it as on a lost node (its workers are lost, "node_lost: ...
did not answer"; the sessions restart elsewhere from the store) and place
nothing there for a while.  If it wakes up, it carries out the kills it
was sent, and its workers' lease from this front runs out: nothing a
stale worker sends reaches a session, as its bridge is gone.

Every value from a node host is checked before use: a stream item that is
not bytes or a well-formed exit ends that worker as lost.

Runs in the daemon's loop; `connect()` (ray.init, which starts threads)
runs before it, in a daemon that forks nothing afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import socket
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from ipc.contract import NODE_LOST_PREFIX
from supervisor.config import ClusterSettings
from supervisor.host.proctable import REMOTE_PIDS
from supervisor.cluster.nodehost import checked_exit, checked_silence, checked_usage, recv_batch
from supervisor.spawn.pidfd import PidFd
from supervisor.cluster.ray_spares import SpareWorkers
from ipc.install import install_command
from supervisor.spawn.seams import SpawnerDied

__all__ = ["RaySpawner"]

log = logging.getLogger("sessiond.cluster")

_SIGKILL = signal.SIGKILL  # (the spawner has a method named `signal`)
# How long a worker may wait for a free slot somewhere before `request` fails.
PLACE_TIMEOUT_SECS = 15.0
# A spare worker is placed only where a slot is free about at once.
_SPARE_PLACE_SECS = 0.5
_PLACE_RETRY_SECS = 0.25
_HOST_NAME = "sessiond-nodehost-{node_id}"
# The label every Ray node carries with its own id (Ray sets it).
_NODE_ID_LABEL = "ray.io/node-id"
# What a draining node host answers `spawn` with.
DRAINING = "draining"
# How long telling a node host about its mark (or asking it) may take.
_MARK_ASK_SECS = 5.0
# The least time a node host is given to start a worker, carry out a kill
# (its exit on the stream) or answer a question before the front stops
# waiting for it (else: the front's lease, the time a host gives a silent front).
_MIN_ANSWER_SECS = 5.0
# How long a node host that did not answer gets no new worker from this front.
_SHUN_SECS = 30.0
# How often a placement that waits looks whether a node came back into use.
_RESELECT_SECS = 0.25
_actor_class: Any = None  # ray.remote(NodeHost), made once


class _Remote:
    """A worker on a node host, seen from the front."""

    __slots__ = ("bridge", "exited", "gone", "group", "host", "ip", "node_id", "node_pid", "procs", "rss", "sock")

    def __init__(self, host: Any, node_id: str, ip: str, node_pid: int, sock: socket.socket,
                 group: Any) -> None:
        self.host = host
        self.node_id = node_id
        self.ip = ip
        self.node_pid = node_pid
        self.sock = sock  # our end of the bridge
        self.group = group  # its placement group: its slot
        self.exited = False
        self.gone = False
        self.rss: int | None = None  # its tree's RSS, as its node host last measured it
        self.procs: int | None = None  # and the number of processes in it
        self.bridge: list[asyncio.Task[None]] = []


class RaySpawner:
    def __init__(self, settings: ClusterSettings) -> None:
        self.on_exit: Callable[[int, int | None, int | None], None] = lambda pid, code, sig: None
        self.on_zygote_lost: Callable[[], None] = lambda: None
        # A worker lost with its node or node host: (pid, why), a crash naming the node.
        self.on_worker_lost: Callable[[int, str], None] = lambda pid, why: self.on_exit(pid, None, _SIGKILL)
        self._settings = settings
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pids = itertools.count(REMOTE_PIDS)
        self._workers: dict[int, _Remote] = {}
        self._hosts: dict[str, Any] = {}  # node id -> node host actor handle
        self._ips: dict[str, str] = {}  # node id -> its address as Ray reports it
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        # Nodes known to be draining (node id -> address): no new worker there.
        self._draining: dict[str, str] = {}
        # How many times this front set or cleared each node's mark: a
        # re-read of the host's mark asked before the last one is stale.
        self._marks_set: dict[str, int] = {}
        # Nodes whose host did not answer in time -> loop time until which
        # this front places nothing there.
        self._shunned: dict[str, float] = {}
        self._answer_secs = max(settings.front_lease_secs, _MIN_ANSWER_SECS)
        # Who this front is to node hosts, for its lease on its workers.
        self._front = f"{socket.gethostname()[:40]}-{uuid.uuid4().hex[:16]}"
        self._next_raid = 0.0  # (loop time) when _short_of_slots may next ask other fronts' spares
        self._spares = SpareWorkers(lambda: self._new_worker(_SPARE_PLACE_SECS, spare=True),
                                    self._usable_spare, self.kill_tree, self._spawn_task)

    # ---------------------------------------------------------------- set-up

    def connect(self) -> None:
        """Join the Ray cluster (before the daemon's loop: ray.init blocks
        and starts threads).  Raises SpawnerDied saying what is wrong."""
        try:
            import ray
        except ImportError:
            raise SpawnerDied("[cluster] backend = \"ray\" needs Ray, which is not installed: "
                              f"{install_command('cluster')}") from None
        if ray.is_initialized():
            return
        try:
            ray.init(
                address=self._settings.address or "auto", namespace=self._settings.namespace,
                log_to_driver=False, configure_logging=False, include_dashboard=False,
            )
        except Exception as exc:  # ConnectionError, or whatever ray.init raises
            raise SpawnerDied(f"cannot join the Ray cluster at "
                              f"{self._settings.address or 'RAY_ADDRESS or this machine'}: {exc}") from None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._spawn_task(self._renew_leases())

    async def _renew_leases(self) -> None:
        """Tell every node host that runs a worker of ours that we are
        alive, a few times per lease (a lost renewal is not yet a loss)."""
        secs = self._settings.front_lease_secs
        while not self._closing:
            await asyncio.sleep(secs / 4)
            for host in {id(r.host): r.host for r in self._workers.values() if not r.gone}.values():
                with contextlib.suppress(Exception):
                    host.lease.remote(self._front, secs)
            for node_id in list(self._draining):
                self._spawn_task(self._reread_mark(node_id))

    async def _reread_mark(self, node_id: str) -> None:
        """Keep a known mark only while its node host still holds it (an
        undo from another front clears it there).  A host that does not
        answer keeps it: its node may be dead, and Ray places nothing there."""
        asked_at = self._marks_set.get(node_id, 0)
        try:
            held = await asyncio.wait_for(self._host(node_id).draining.remote(), _MARK_ASK_SECS)
        except Exception:
            return
        # An answer to a question asked before this front set the mark
        # again says nothing of the mark now.
        if held is False and self._marks_set.get(node_id, 0) == asked_at:
            self._draining.pop(node_id, None)

    @property
    def zygote_pid(self) -> int:
        return 0  # the zygotes are on the nodes

    def keep_spares(self, count: int) -> None:
        """Keep `count` workers placed and waiting (supervisor.cluster.ray_spares)."""
        self._spares.keep(count)

    def _short_of_slots(self) -> None:
        """A worker waits for a slot: a spare's is its, this front's own
        first, else (once a second) one of another front's, through the
        node hosts."""
        if len(self._spares):
            self._spares.give_slot_back()
            return
        now = asyncio.get_running_loop().time()
        if now >= self._next_raid:
            self._next_raid = now + 1.0
            self._spawn_task(self._take_a_spare_slot())

    async def _take_a_spare_slot(self) -> None:
        import ray

        for node in await asyncio.to_thread(ray.nodes):
            node_id = node.get("NodeID")
            if not node.get("Alive") or not isinstance(node_id, str) or node_id in self._avoided():
                continue
            try:
                host = await asyncio.to_thread(ray.get_actor, _HOST_NAME.format(node_id=node_id),
                                               self._settings.namespace)
                if await asyncio.wait_for(host.drop_spare.remote(), _MARK_ASK_SECS) is True:
                    return
            except Exception:
                continue  # no host there yet, or it does not answer

    async def _claim_spare(self, pid: int) -> bool:
        """Whether the spare's node host lets it have a session (not on a
        node marked draining since, by any front)."""
        remote = self._workers.get(pid)
        if remote is None or remote.gone:
            return False
        try:
            return await asyncio.wait_for(remote.host.claim.remote(remote.node_pid), self._answer_secs) is True
        except Exception:
            return False

    def _usable_spare(self, pid: int) -> bool:
        remote = self._workers.get(pid)
        return (remote is not None and not remote.exited and not remote.gone
                and remote.node_id not in self._avoided())

    def placement(self, pid: int) -> tuple[int, str | None]:
        remote = self._workers.get(pid)
        return (remote.node_pid, remote.ip) if remote is not None else (pid, None)

    def node_of(self, pid: int) -> str | None:
        """The Ray node id a worker runs on (None: not one of ours)."""
        remote = self._workers.get(pid)
        return remote.node_id if remote is not None and not remote.gone else None

    def reported_rss(self, pid: int) -> int | None:
        """The RSS of a worker and its descendants as its node host last
        measured it (`ProcTable.remote`: what the memory sweep sees)."""
        remote = self._workers.get(pid)
        return remote.rss if remote is not None and not remote.exited else None

    def reported_procs(self, pid: int) -> int | None:
        """The number of processes in a worker's tree (itself included) as
        its node host last counted them (`ProcTable.remote_procs`: the
        sweep's max_processes, where the kernel does not count it)."""
        remote = self._workers.get(pid)
        return remote.procs if remote is not None and not remote.exited else None

    # ---------------------------------------------------------------- spawning

    def request(self) -> asyncio.Future[tuple[int, socket.socket]]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, socket.socket]] = loop.create_future()
        if self._closing:
            fut.set_exception(SpawnerDied("the spawner is closed"))
            return fut
        self._spawn_task(self._place(fut))
        return fut

    async def _place(self, fut: asyncio.Future[tuple[int, socket.socket]]) -> None:
        while (spare := await self._spares.take_soon()) is not None:
            if await self._claim_spare(spare[0]):
                if fut.done() or self._closing:
                    self._spares.discard(spare)
                else:
                    fut.set_result(spare)
                return
            self._spares.discard(spare)
        try:
            pid, ours = await self._new_worker(PLACE_TIMEOUT_SECS, self._short_of_slots)
        except BaseException as exc:
            if not fut.done():
                fut.set_exception(exc if isinstance(exc, SpawnerDied)
                                  else SpawnerDied(f"cannot place a worker: {exc}"))
            if not isinstance(exc, Exception):
                raise
            return
        if fut.done() or self._closing:  # nobody waits for it any more
            ours.close()
            self.kill_tree(pid)
        else:
            fut.set_result((pid, ours))

    async def _new_worker(self, wait_secs: float, short_of_slots: Callable[[], None] | None = None,
                          spare: bool = False) -> tuple[int, socket.socket]:
        """A worker placed and forked somewhere, its bridge running: its
        pid (ours) and our end of its socket."""
        group, node_id, host, node_pid = await self._spawn_somewhere(wait_secs, short_of_slots, spare)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        theirs.setblocking(False)
        pid = next(self._pids)
        remote = _Remote(host, node_id, self._ips[node_id], node_pid, theirs, group)
        self._workers[pid] = remote
        remote.bridge = [self._spawn_task(self._to_worker(pid, remote)),
                         self._spawn_task(self._from_worker(pid, remote))]
        return pid, ours

    async def _spawn_somewhere(self, wait_secs: float, short_of_slots: Callable[[], None] | None,
                               spare: bool) -> tuple[Any, str, Any, int]:
        """A slot from Ray, then a worker from that node's host: (its
        placement group, node id, node host, pid there).  A node host that
        cannot be reached is most often on a node that died and that Ray
        has not yet declared dead (it still places slots there): give the
        slot back and ask again, for up to `wait_secs`.  `short_of_slots`
        is called while no slot is free (a spare then gives its own)."""
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        resource = self._settings.resource
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_secs
        while True:
            avoid = self._avoided()
            group = placement_group(
                [{resource: 1}], strategy="STRICT_PACK",
                bundle_label_selector=[{_NODE_ID_LABEL: f"!in({','.join(avoid)})"}] if avoid else None,
            )
            try:
                if not await self._placed(group, avoid, deadline, wait_secs, short_of_slots):
                    remove_placement_group(group)  # a node came back into use: ask again
                    continue
                # (A query of Ray's head: off the loop, which serves every session.)
                table = await asyncio.to_thread(placement_group_table, group)
                node_id = table["bundles_to_node_id"][0]
                if not isinstance(node_id, str):
                    raise SpawnerDied(f"Ray placed the worker on an unnamed node ({node_id!r})")
                if node_id not in self._ips:
                    await self._learn_ip(node_id)
                host = self._host(node_id)
                try:
                    node_pid = await self._spawn_on(host, spare)
                except Exception as exc:
                    self._hosts.pop(node_id, None)
                    self._shunned[node_id] = loop.time() + _SHUN_SECS
                    if loop.time() + _PLACE_RETRY_SECS >= deadline:
                        raise SpawnerDied(f"the node host on {self._ips.get(node_id, node_id)} cannot "
                                          f"start a worker: {exc}") from None
                    log.warning("the node host on %s cannot start a worker (%s); placing it again",
                                self._ips.get(node_id, node_id), type(exc).__name__)
                    with contextlib.suppress(Exception):
                        remove_placement_group(group)
                    await asyncio.sleep(_PLACE_RETRY_SECS)
                    continue
                if node_pid == DRAINING:  # marked by another front: learn it, place again
                    log.info("node %s is draining; placing the worker elsewhere", self._ips[node_id])
                    self._draining[node_id] = self._ips[node_id]
                    with contextlib.suppress(Exception):
                        remove_placement_group(group)
                    continue
                if not isinstance(node_pid, int) or isinstance(node_pid, bool) or node_pid <= 0:
                    raise SpawnerDied(f"the node host on {self._ips[node_id]} answered {node_pid!r}, "
                                      "not a pid")
                return group, node_id, host, node_pid
            except BaseException:
                with contextlib.suppress(Exception):
                    remove_placement_group(group)
                raise

    def _avoided(self) -> list[str]:
        """The nodes a placement leaves out: draining, or shunned for now."""
        now = asyncio.get_running_loop().time()
        return sorted({*self._draining, *(n for n, until in self._shunned.items() if until > now)})

    async def _placed(self, group: Any, avoid: list[str], deadline: float, wait_secs: float,
                      short_of_slots: Callable[[], None] | None) -> bool:
        """Wait for Ray to place the group: True once it is, False as soon
        as a node it leaves out is back in use (a drain undone: the slot
        may be there).  SpawnerDied at the deadline."""
        loop = asyncio.get_running_loop()
        ready = asyncio.ensure_future(group.ready())
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(ready), min(_RESELECT_SECS, deadline - loop.time()))
                    return True
                except asyncio.TimeoutError:
                    if loop.time() >= deadline:
                        left_out = f" ({len(avoid)} node(s) left out: draining or not answering)" if avoid else ""
                        raise SpawnerDied(
                            f"no node of the Ray cluster has a free {self._settings.resource!r} slot{left_out} "
                            f"(waited {wait_secs:g}s): start nodes with "
                            f"--resources '{{\"{self._settings.resource}\": N}}' or free some") from None
                    if avoid and not set(avoid) <= set(self._avoided()):
                        return False
                    if short_of_slots is not None:
                        short_of_slots()
        finally:
            ready.cancel()

    async def _spawn_on(self, host: Any, spare: bool) -> Any:
        """The node host's answer to `spawn`, within the answer time; a
        worker it starts after that is killed when its pid comes."""
        call: asyncio.Task[Any] = asyncio.ensure_future(host.spawn.remote(self._front,
                                                                          self._settings.front_lease_secs, spare))
        try:
            return await asyncio.wait_for(asyncio.shield(call), self._answer_secs)
        except asyncio.TimeoutError:
            def late(done: asyncio.Task[Any]) -> None:
                if not done.cancelled() and done.exception() is None and isinstance(done.result(), int):
                    with contextlib.suppress(Exception):
                        host.kill_tree.remote(done.result(), int(_SIGKILL))

            call.add_done_callback(late)
            raise TimeoutError(f"no answer within {self._answer_secs:g}s") from None

    async def _learn_ip(self, node_id: str) -> None:
        """The node's address as Ray reports it (for `status`, and logs),
        asked of Ray's head off the loop."""
        import ray

        for node in await asyncio.to_thread(ray.nodes):
            if node.get("NodeID") == node_id and isinstance(node.get("NodeManagerAddress"), str):
                self._ips[node_id] = node["NodeManagerAddress"]

    def _host(self, node_id: str) -> Any:
        """The node host of that node: found by name, or created there
        (detached: it outlives this front; pinned: it is that machine's)."""
        host = self._hosts.get(node_id)
        if host is not None:
            return host
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from supervisor.cluster.nodehost import NodeHost

        self._ips.setdefault(node_id, node_id[:12])
        global _actor_class
        if _actor_class is None:
            _actor_class = ray.remote(NodeHost)
        host = _actor_class.options(
            name=_HOST_NAME.format(node_id=node_id), namespace=self._settings.namespace,
            get_if_exists=True, lifetime="detached", max_restarts=-1, num_cpus=0,
            max_concurrency=10_000,
            # Every frame is a call or a stream item: none of them is worth
            # a task event to Ray's head (its dashboard's task list).
            enable_task_events=False,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote()
        self._hosts[node_id] = host
        return host

    # ---------------------------------------------------------------- draining

    @property
    def draining(self) -> dict[str, str]:
        """The nodes this front keeps new workers off: node id -> address."""
        return dict(self._draining)

    async def find_node(self, name: str, alive: bool = True) -> tuple[str, str]:
        """(node id, address) of the node called `name` (its address as
        Ray reports it, or its node id); with `alive`, a live one only.
        Raises LookupError saying which nodes there are."""
        import ray

        nodes = [n for n in await asyncio.to_thread(ray.nodes)
                 if isinstance(n.get("NodeID"), str) and isinstance(n.get("NodeManagerAddress"), str)]
        live = [n for n in nodes if n.get("Alive")]
        found = [n for n in live if name in (n["NodeID"], n["NodeManagerAddress"])]
        if not found and not alive:
            found = [n for n in nodes if name in (n["NodeID"], n["NodeManagerAddress"])][-1:]
        if len(found) == 1:
            node_id, ip = found[0]["NodeID"], found[0]["NodeManagerAddress"]
            self._ips[node_id] = ip
            return node_id, ip
        if found:
            raise LookupError(f"{len(found)} live nodes have the address {name}: name one by its "
                              f"Ray node id ({', '.join(n['NodeID'] for n in found)})")
        known = ", ".join(sorted({n["NodeManagerAddress"] for n in live})) or "none"
        raise LookupError(f"no live node {name!r} in the Ray cluster (live nodes: {known})")

    async def mark_draining(self, node_id: str, ip: str, on: bool, alive: bool = True) -> None:
        """Keep new workers off the node (or no longer): here at once, and
        on its node host, which tells the other fronts.  A host that
        cannot be told (its node is dying) is only logged: this front
        keeps the mark it set."""
        self._marks_set[node_id] = self._marks_set.get(node_id, 0) + 1
        if on:
            self._draining[node_id] = ip
        else:
            self._draining.pop(node_id, None)
        if not alive:
            return  # nothing to tell, and no host to make there
        try:
            await asyncio.wait_for(self._host(node_id).set_draining.remote(on), _MARK_ASK_SECS)
        except Exception as exc:
            log.warning("cannot tell the node host on %s that it is %s: %s", ip,
                        "draining" if on else "in use again", type(exc).__name__)
        if on:  # again: a re-read of the host's old answer may have crossed the call
            self._draining[node_id] = ip
            self._spares.prune()

    # ---------------------------------------------------------------- the bridge

    async def _to_worker(self, pid: int, remote: _Remote) -> None:
        """What WorkerOwner writes, to the worker, in order: one call in
        flight at a time, carrying all that piled up meanwhile (b"": closed)."""
        while data := await recv_batch(remote.sock):
            try:
                if not await remote.host.send.remote(remote.node_pid, data):
                    return  # the worker is gone; its exit comes on the stream
            except Exception:
                return  # the host is gone; the stream says how

    async def _from_worker(self, pid: int, remote: _Remote) -> None:
        loop = asyncio.get_running_loop()
        why = ""
        try:
            async for ref in remote.host.frames.remote(remote.node_pid):
                item = _value_now(ref)
                if item is _NOT_YET:
                    item = await ref
                if isinstance(item, bytes):
                    if not remote.exited:
                        with contextlib.suppress(OSError):
                            await loop.sock_sendall(remote.sock, item)
                    continue
                usage = checked_usage(item)
                if usage is not None:
                    remote.rss, remote.procs = usage
                    continue
                exit_ = checked_exit(item)
                if exit_ is not None and not remote.exited:
                    remote.exited = True
                    with contextlib.suppress(OSError):
                        remote.sock.shutdown(socket.SHUT_WR)  # the frames before it, then EOF
                    code, sig, detail = exit_
                    if detail:  # the node host knows more than a status: say it
                        self.on_worker_lost(pid, detail)
                    else:
                        self.on_exit(pid, code, sig)
                elif item == ("gone",) and remote.exited:
                    return
                elif exit_ is None:
                    why = f"its node host sent {type(item).__name__}, not a frame"
                    return
            why = "its node host ended the stream without an exit"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Its node died, or its node host did (and its zygote and
            # workers with it): Ray says which only by the error's type.
            why = f"{NODE_LOST_PREFIX}lost the node host on {remote.ip} ({type(exc).__name__})"
        finally:
            if why:
                self._lost(pid, remote, why)
            remote.gone = True
            self._forget(pid, remote)

    def _forget(self, pid: int, remote: _Remote) -> None:
        from ray.util.placement_group import remove_placement_group

        if self._workers.get(pid) is remote:
            del self._workers[pid]
        for task in remote.bridge:
            if task is not asyncio.current_task():
                task.cancel()
        remote.sock.close()
        with contextlib.suppress(Exception):
            remove_placement_group(remote.group)  # its slot, back to Ray

    def _spawn_task(self, coro: Any) -> asyncio.Task[Any]:
        assert self._loop is not None, "attach() first"
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---------------------------------------------------------------- signals

    def signal(self, pid: int, sig: int) -> None:
        remote = self._workers.get(pid)
        if remote is not None and not remote.gone:
            remote.host.signal.remote(remote.node_pid, int(sig))

    def kill_tree(self, pid: int, others: Iterable[PidFd] = (), sig: int = _SIGKILL) -> None:
        # `others` are pidfds of this machine; a remote worker's descendants
        # are the node's to find (its zygote hunts the strays of a kill).
        remote = self._workers.get(pid)
        if remote is not None and not remote.gone:
            remote.host.kill_tree.remote(remote.node_pid, int(sig))
            if sig == _SIGKILL and self._loop is not None:
                self._loop.call_later(self._answer_secs, self._kill_unanswered, pid, remote)

    def _kill_unanswered(self, pid: int, remote: _Remote) -> None:
        self._give_up(pid, remote, f"did not carry out a kill within {self._answer_secs:g}s")

    async def node_silence(self, pid: int) -> float | None:
        """How long the worker's node host has had nothing from it
        (supervisor.core.silence); None once it is gone or lost (a host
        that does not answer in time, or cannot be reached: as above)."""
        remote = self._workers.get(pid)
        if remote is None or remote.gone or remote.exited:
            return None
        try:
            answer = await asyncio.wait_for(remote.host.silent_for.remote(remote.node_pid), self._answer_secs)
        except asyncio.TimeoutError:
            with contextlib.suppress(Exception):
                remote.host.kill_tree.remote(remote.node_pid, _SIGKILL)  # carried out if it wakes
            self._give_up(pid, remote, f"did not answer within {self._answer_secs:g}s")
            return None
        except Exception as exc:  # its node died, or its node host did (the stream says so too)
            self._lost(pid, remote, f"{NODE_LOST_PREFIX}lost the node host on {remote.ip} ({type(exc).__name__})")
            return None
        return None if remote.exited else checked_silence(answer)

    def _give_up(self, pid: int, remote: _Remote, what: str) -> None:
        """The node host did not answer in time: give up on it as on a lost
        node, unless an exit came since (its "gone" may take longer)."""
        if self._workers.get(pid) is not remote or remote.gone or remote.exited:
            return
        if self._loop is not None:
            self._shunned[remote.node_id] = self._loop.time() + _SHUN_SECS
        self._hosts.pop(remote.node_id, None)
        self._lost(pid, remote, f"{NODE_LOST_PREFIX}the node host on {remote.ip} {what}")
        remote.gone = True
        self._forget(pid, remote)

    def _lost(self, pid: int, remote: _Remote, why: str) -> None:
        if not remote.exited:
            remote.exited = True
            log.warning("worker %d on %s: %s", remote.node_pid, remote.ip, why)
            self.on_worker_lost(pid, why)

    def tree_alive(self, pid: int, others: Iterable[PidFd] = ()) -> bool:
        remote = self._workers.get(pid)
        return remote is not None and not remote.gone

    def close(self) -> None:
        """Kill every worker of ours and give their slots back."""
        self._closing = True
        self._spares.close()
        for pid, remote in list(self._workers.items()):
            if not remote.gone:
                with contextlib.suppress(Exception):
                    remote.host.kill_tree.remote(remote.node_pid, _SIGKILL)
            remote.gone = True
            self._forget(pid, remote)
        for task in list(self._tasks):
            task.cancel()


_NOT_YET = object()


def _value_now(ref: Any) -> Any:
    """A stream item's value without a trip through asyncio (most often
    already here: small ones come inline with the report; 0.2 ms, not the
    0.3 of an await), or _NOT_YET."""
    import ray

    try:
        return ray.get(ref, timeout=0)
    except ray.exceptions.GetTimeoutError:
        return _NOT_YET
