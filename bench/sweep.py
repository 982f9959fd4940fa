"""The memory sweep's cost to everyone else: the daemon's `ping` latency
while one session is over its cap by RSS but not by PSS (issue 21).

One session (handler `bench._sweep_handler:forker`) starts a 20 MiB Python
process and N - 1 forks of it sharing its pages: ~28 MiB x N of RSS
summed, far under the 1 GiB cap by PSS.  Every sweep (100 ms) the daemon
must then count that session's PSS.  The old sweep read every process's
smaps_rollup on the loop (511 processes: 262 ms a pass); the new one has
the measuring thread read a budget of them a sweep.

Both run in the same invocation, one after the other: "old" is the code of
`--old` (default: the commit this branch forked from main), extracted with
`git archive` and put first on the daemon's PYTHONPATH; "new" is this
checkout.  For each: ping p50/p99/max with no children (the baseline),
then with N.  `[daemon] cgroups = "off"`: the sweep's own path.

    .venv/bin/python bench/sweep.py [--children 511] [--secs 5] [--old REF] [--json]
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

import msgspec
import psutil

from bench import _common as c
from ipc import messages as m
from ipc.framing import encode_frame
from supervisor.ctl.client import Client

_reply = msgspec.msgpack.Decoder(m.Reply)
CONFIG = """
[agent]
allowed_handlers = ["agent", "echo", "bench._sweep_handler:*"]
[agent.limits]
max_processes = 4096
memory_poll_interval_ms = 100
[daemon]
cgroups = "off"
"""


def _request(s: socket.socket, msg: Any) -> Any:
    s.sendall(encode_frame(msg))
    while True:
        reply = _reply.decode(c.recv_frame(s))
        if getattr(reply, "id", None) == getattr(msg, "id", None):
            return reply


def pings(path: Path, secs: float) -> list[float]:
    """Round trips of `ping`, one after the other, for `secs` (in ms)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(path))
    try:
        _request(s, m.Hello(protocol=m.PROTOCOL_VERSION, client="bench-sweep"))
        out: list[float] = []
        end = time.monotonic() + secs
        rid = 0
        while time.monotonic() < end:
            rid += 1
            t0 = time.perf_counter()
            reply = _request(s, m.Ping(id=rid))
            out.append((time.perf_counter() - t0) * 1000)
            assert isinstance(reply, m.Pong), reply
            time.sleep(0.002)  # a client asking, not a flood
        return out
    finally:
        s.close()


def fork_base() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "merge-base", "HEAD", "main"], capture_output=True, text=True)
    return out.stdout.strip() or "HEAD"


def extract(ref: str, into: Path) -> None:
    """The daemon's and worker's packages of `ref`, into `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "supervisor", "ipc", "session_worker"],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def cpu_secs(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run(label: str, pythonpath: str | None, children: int, secs: float) -> dict[str, Any]:
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    with c.BenchDaemon(CONFIG, tag=f"sweep-{label}", env=env) as d:
        with Client(d.socket) as client:
            sid = client.create(session="forker", handler="bench._sweep_handler:forker").id
            deadline = time.monotonic() + 10  # until a sweep has measured it
            while client.status(sid).rss_bytes is None and time.monotonic() < deadline:
                time.sleep(0.02)
            cpu0 = cpu_secs(d.pid)
            base = sorted(pings(d.socket, secs))
            base_cpu = (cpu_secs(d.pid) - cpu0) / secs
            client.send_text(sid, str(children))
            count = len(psutil.Process(d.pid).children(recursive=True))
            cpu0 = cpu_secs(d.pid)
            loaded = sorted(pings(d.socket, secs))
            loaded_cpu = (cpu_secs(d.pid) - cpu0) / secs
            info = client.status(sid)
            alive = info.last_exit is None
            client.remove(sid)
    return {"label": label, "base": _figures(base), "loaded": _figures(loaded),
            "base_cpu": base_cpu, "loaded_cpu": loaded_cpu, "processes": count, "spared": alive,
            "figure": info.rss_bytes}


def _figures(ms: list[float]) -> dict[str, float]:
    return {"n": len(ms), "p50": c.percentile(ms, 50), "p99": c.percentile(ms, 99), "max": ms[-1]}


def main() -> int:
    p = c.arg_parser(__doc__ or "")
    p.add_argument("--children", type=int, default=511)
    p.add_argument("--secs", type=float, default=5.0)
    p.add_argument("--old", default=None, help="git ref of the old sweep (default: the fork point from main)")
    args = p.parse_args()
    out = c.Report("sweep", args.json)
    old_ref = args.old or fork_base()
    results = []
    with tempfile.TemporaryDirectory(prefix="sweep-old-") as tmp:
        extract(old_ref, Path(tmp))
        old_path = os.pathsep.join([tmp, str(REPO)])
        results.append(run(f"old ({old_ref[:8]})", old_path, args.children, args.secs))
    results.append(run("new", None, args.children, args.secs))
    out.say(f"ping latency (ms) of the daemon, one session, then that session with {args.children} "
            f"processes over its cap by RSS, under it by PSS:")
    rows = []
    for r in results:
        for phase in ("base", "loaded"):
            s = r[phase]
            rows.append([r["label"], "no children" if phase == "base" else f"{r['processes']} processes",
                         f"{s['p50']:.2f}", f"{s['p99']:.2f}", f"{s['max']:.2f}",
                         f"{r[phase + '_cpu'] * 100:.0f}%",
                         "" if phase == "base" else ("spared" if r["spared"] else "KILLED")])
    out.table(["code", "session", "p50", "p99", "max", "daemon CPU", ""], rows)
    out.figures["runs"] = results
    new = results[-1]
    out.goal("new: ping p99 with the children (ms)", new["loaded"]["p99"], 20.0,
             f"{new['loaded']['p99']:.2f} ms <= 20 ms: the sweep's reads do not stall the loop")
    return out.finish()


if __name__ == "__main__":
    sys.exit(main())
