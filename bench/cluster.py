"""Cluster mode's cost per session, against one machine, side by side.

    .venv/bin/python bench/cluster.py [--n 40] [--json]

Starts a real local Ray cluster (tests/ray_cluster.py: a head and two
worker nodes on loopback addresses, with 50 slots each) and a real
PostgreSQL (tests/pg_server.py), then three daemons:

- `one machine`: the zygote and the file store (the default);
- `one machine + pg`: the zygote and the PostgreSQL store (what the store
  alone costs);
- `cluster`: workers on Ray node hosts and the PostgreSQL store;
- `cluster, no spares`: the same with `spare_workers = 0` (every create
  waits for a placement group and a fork on a node).

In interleaved rounds (one of each per round, so the machine's noise hits
all three alike), each daemon gets: create -> ready (an echo session,
removed again), a session ping (daemon -> worker -> daemon), and a durable
echo turn.  Then the idle memory each more session costs (PSS over
every process it touches: on the cluster, Ray's nodes included), and the
recovery time after a node is killed (its raylet and
everything on it, SIGKILL) with the health-check settings of
tests/ray_cluster.py (0.5 s x 3): from the kill to a session that was on
it answering a turn from the other node.

Everything is on this one machine: the "remote" workers are local
processes, so the cluster figures are Ray's overhead, not a network's.

Goals (issue 15): create -> ready <= 3x, ping <= 3x, durable echo turn
<= 2x of one machine with a local PostgreSQL; idle memory per session
<= 1.5x; recovery <= 10 s.
"""

from __future__ import annotations

import _path  # (first: the checkout on sys.path, not bench/)

import sys

sys.path.insert(1, str(_path.REPO / "tests"))

import statistics
import time

import psutil

import tomli_w

from bench import _common as c

from pg_server import PgServer
from ray_cluster import HEALTH_ENV, NODE_IPS, RayCluster

from supervisor.ctl.client import Client

IDLE_SESSIONS = 20
IDLE_ROUNDS = 3

BASE = """
[agent.limits]
max_concurrent_sessions = 200
[agent.worker]
heartbeat_interval_secs = 1.0
"""


def _timed(fn: object) -> int:
    began = time.perf_counter_ns()
    fn()  # type: ignore[operator]
    return time.perf_counter_ns() - began


def _pss_kib(roots: list[int]) -> int:
    """PSS of every process in the trees of `roots` (KiB)."""
    pids: set[int] = set()
    for root in roots:
        try:
            pids.update([root, *(ch.pid for ch in psutil.Process(root).children(recursive=True))])
        except psutil.NoSuchProcess:
            pass
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration, ValueError):
            pass  # gone meanwhile, or a kernel thread
    return total


def _idle_memory(cl: Client, roots: list[int]) -> float:
    """KiB of PSS each of IDLE_SESSIONS more idle sessions adds."""
    before = _pss_kib(roots)
    made = [cl.create(handler="echo").id for _ in range(IDLE_SESSIONS)]
    for sid in made:
        cl.send_text(sid, "x")
    after = _pss_kib(roots)
    for sid in made:
        cl.remove(sid)
    return (after - before) / IDLE_SESSIONS


def main() -> int:
    p = c.arg_parser(__doc__ or "")
    p.add_argument("--n", type=int, default=40, help="rounds (default 40)")
    args = p.parse_args()
    report = c.Report("cluster", args.json)
    report.say("starting PostgreSQL and a 3-node Ray cluster ...")
    pg = PgServer()
    c.on_exit(pg.close)
    cluster = RayCluster(slots=50)
    c.on_exit(cluster.close)
    setups = {
        "one machine": BASE,
        "one machine + pg": BASE + tomli_w.dumps({"store": {"backend": "postgres", "dsn": pg.fresh_dsn()}}),
        "cluster": BASE + tomli_w.dumps({
            "store": {"backend": "postgres", "dsn": pg.fresh_dsn()},
            "cluster": {"backend": "ray", "address": cluster.address, "auth_token_file": str(cluster.token_file)},
        }),
        # Without spare workers on the nodes: every create waits for a
        # placement group and a fork there (the build before them).
        "cluster, no spares": BASE + tomli_w.dumps({
            "daemon": {"spare_workers": 0},
            "store": {"backend": "postgres", "dsn": pg.fresh_dsn()},
            "cluster": {"backend": "ray", "address": cluster.address, "auth_token_file": str(cluster.token_file)},
        }),
    }
    daemons = {name: c.BenchDaemon(config, tag="sdc").start(timeout=60) for name, config in setups.items()}
    clients = {name: Client(d.socket) for name, d in daemons.items()}
    sids = {name: cl.create(handler="echo").id for name, cl in clients.items()}
    samples: dict[str, dict[str, list[int]]] = {name: {"create": [], "ping": [], "turn": []} for name in setups}
    for name, cl in clients.items():  # warm up: the node hosts are made by the first create
        cl.remove(cl.create(handler="echo").id)
        cl.send_text(sids[name], "warm")
    for _ in range(args.n):
        for name, cl in clients.items():
            made: list[str] = []
            samples[name]["create"].append(_timed(lambda: made.append(cl.create(handler="echo").id)))
            cl.remove(made[0])
            samples[name]["ping"].append(_timed(lambda: cl.ping(sids[name])))
            samples[name]["turn"].append(_timed(lambda: cl.send_text(sids[name], "x")))
    rows = []
    medians: dict[str, dict[str, float]] = {}
    for name in setups:
        medians[name] = {}
        row = [name]
        for what in ("create", "ping", "turn"):
            s = c.summarize(samples[name][what])
            medians[name][what] = s["median_us"]
            row.append(c.fmt_us(medians[name][what]))
        rows.append(row)
    report.table(["", "create -> ready", "session ping", "durable echo turn"], rows)
    report.figures["medians_us"] = medians

    # Idle memory per session: what K more idle sessions (each has served
    # a turn) add to every process they touch, PSS.  One machine: the
    # daemon and its tree (zygote, workers).  Cluster: the front's tree and
    # every Ray node's (raylet, GCS, node hosts, their zygotes, workers),
    # so Ray's own bookkeeping per session (a placement group each) counts.
    trees = {"one machine + pg": [daemons["one machine + pg"].pid],
             "cluster": [daemons["cluster"].pid, *(proc.pid for proc in cluster.nodes.values())]}
    per_session: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(IDLE_ROUNDS):
        for name, roots in trees.items():
            per_session[name].append(_idle_memory(clients[name], roots))
    idle_mib = {name: statistics.median(v) / 1024 for name, v in per_session.items()}
    report.say(f"idle memory per session (PSS, {IDLE_SESSIONS} more idle sessions, median of {IDLE_ROUNDS}): "
               + ", ".join(f"{name} {mib:.2f} MiB" for name, mib in idle_mib.items()))
    report.figures["idle_mib_per_session"] = idle_mib

    # Recovery after a node kill.
    cl = clients["cluster"]
    victim = cl.status(sids["cluster"]).node
    other = next(ip for ip in NODE_IPS if ip != victim)
    began = time.monotonic()
    cluster.kill_node(victim)
    while True:
        st = cl.status(sids["cluster"])
        if st.state == "idle" and st.node == other:
            break
        if time.monotonic() - began > 60:
            raise RuntimeError("the session did not come back within 60 s")
        time.sleep(0.02)
    cl.send_text(sids["cluster"], "after")
    recovery = time.monotonic() - began
    report.say(f"recovery after a node kill (health check {HEALTH_ENV['RAY_health_check_period_ms']} ms x "
               f"{HEALTH_ENV['RAY_health_check_failure_threshold']}): {recovery:.2f} s")
    report.figures["recovery_secs"] = recovery
    for cl_ in clients.values():
        cl_.close()

    base, clus = medians["one machine + pg"], medians["cluster"]
    report.goal("create->ready <= 3x one machine with pg", clus["create"] / base["create"], 3.0,
                f"{clus['create'] / base['create']:.2f}x (without spares on the nodes "
                f"{medians['cluster, no spares']['create'] / base['create']:.2f}x)")
    report.goal("session ping <= 3x", clus["ping"] / base["ping"], 3.0, f"{clus['ping'] / base['ping']:.2f}x")
    report.goal("durable echo turn <= 2x", clus["turn"] / base["turn"], 2.0,
                f"{clus['turn'] / base['turn']:.2f}x")
    ratio = idle_mib["cluster"] / idle_mib["one machine + pg"]
    report.goal("idle memory per session <= 1.5x", ratio, 1.5,
                f"{ratio:.2f}x ({idle_mib['cluster']:.2f} vs {idle_mib['one machine + pg']:.2f} MiB)")
    report.goal("recovery after a node kill <= 10 s", recovery, 10.0, f"{recovery:.2f} s")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
