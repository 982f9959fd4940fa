"""Create -> session ready, against a Popen baseline and a fork floor.

    .venv/bin/python bench/spawn.py [--n 200] [--popen-n 30] [--json]

What is timed:
* create: `AsyncClient.create(handler="echo")` through a real daemon; the
  reply comes once the worker (forked by the zygote) has booted and said
  Ready and the session's log is fsync'd.  Sessions are removed in batches of
  `--batch` (50), so at most that many are alive at once.
* popen: `subprocess.Popen([python, -c, "import session_worker.worker.main,
  session_worker.echo; <send one frame>"])` with one end of a socketpair;
  the parent waits for the frame.  What a session would cost without the
  zygote.
* fork floor: fork + socketpair handshake (child sends one framed message,
  parent waits for it) from a small helper process (only os/socket/struct
  imported), and the same from a zygote-like helper (session_worker preloaded,
  gc.freeze()).  What no spawner can beat.

The baselines run between the create batches, so machine noise falls on both.
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import asyncio
import json
import socket
import subprocess
import time

from bench import _common as c

import msgspec

from ipc import messages as m
from supervisor.ctl.client import AsyncClient

CONFIG = """
[agent.limits]
max_concurrent_sessions = 1000
"""

_POPEN_CHILD = """
import os, socket, sys
import session_worker.worker.main, session_worker.echo
from ipc import messages as m
from ipc.framing import encode_frame
s = socket.socket(fileno=int(sys.argv[1]))
s.sendall(encode_frame(m.Ready(pid=os.getpid())))
"""

# Runs in a helper process: N fork + socketpair handshakes; prints the times
# (ns) as JSON.  argv: N, "bare" | "zygote".
_FORK_HELPER = r"""
import os, socket, struct, sys, time, json
n, kind = int(sys.argv[1]), sys.argv[2]
if kind in ("zygote", "boot"):
    # What the real zygote holds: the daemon's modules (it is a fork of the
    # daemon) plus its own preloads.
    import gc, supervisor.cli, supervisor.daemon, session_worker.zygote.server
    session_worker.zygote.server._preload()
    from ipc import messages as m
    from ipc.framing import encode_frame
    def payload():
        return encode_frame(m.Ready(pid=os.getpid()))
    if kind == "boot":
        import msgspec
        from supervisor.config import load_config
        from ipc.framing import FrameParser
        settings = msgspec.msgpack.encode(load_config(None).session_settings())
        boot_frame = encode_frame(m.Boot(session="bench", handler="echo", settings=settings,
                                         workspace=sys.argv[3], depth=0, turns=0))
        bye_frame = encode_frame(m.Shutdown())
        from_worker = msgspec.msgpack.Decoder(m.FromWorker)
    gc.collect(); gc.freeze()
else:
    HDR = struct.Struct(">I")
    def payload():
        body = b"\x82\xa4type\xa5ready\xa3pid" + struct.pack(">BI", 0xce, os.getpid())
        return HDR.pack(len(body)) + body
def recv_frame(s):
    buf = b""
    while len(buf) < 4:
        chunk = s.recv(65536)
        if not chunk: raise EOFError
        buf += chunk
    need = 4 + int.from_bytes(buf[:4], "big")
    while len(buf) < need:
        chunk = s.recv(65536)
        if not chunk: raise EOFError
        buf += chunk
    return buf
def boot_once():
    from session_worker.worker.main import run_worker
    t0 = time.perf_counter_ns()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        a.close()
        code = 1
        try:
            code = run_worker(b)
        finally:
            os._exit(code)
    b.close()
    a.sendall(boot_frame)
    parser = FrameParser(from_worker, 1 << 30)
    ready = False
    while not ready:
        data = a.recv(65536)
        if not data: raise EOFError("worker died before Ready")
        ready = any(isinstance(x, m.Ready) for x in parser.feed(data))
    dt = time.perf_counter_ns() - t0
    a.sendall(bye_frame)
    while a.recv(65536):
        pass
    a.close()
    os.waitpid(pid, 0)
    return dt
out = []
for _ in range(n):
    if kind == "boot":
        out.append(boot_once())
        continue
    t0 = time.perf_counter_ns()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        a.close()
        try:
            b.sendall(payload())
        finally:
            os._exit(0)
    b.close()
    recv_frame(a)
    out.append(time.perf_counter_ns() - t0)
    a.close()
    os.waitpid(pid, 0)
print(json.dumps(out))
"""

_ready_decoder = msgspec.msgpack.Decoder(m.FromWorker)


def _recv_frame(s: socket.socket) -> bytes:
    buf = b""
    while len(buf) < 4:
        chunk = s.recv(65536)
        if not chunk:
            raise EOFError("the child closed its end before the handshake")
        buf += chunk
    need = 4 + int.from_bytes(buf[:4], "big")
    while len(buf) < need:
        chunk = s.recv(65536)
        if not chunk:
            raise EOFError("short frame")
        buf += chunk
    return buf[4:need]


def popen_once() -> int:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t0 = time.perf_counter_ns()
    proc = subprocess.Popen(
        [sys.executable, "-c", _POPEN_CHILD, str(b.fileno())],
        pass_fds=[b.fileno()], env=c.child_env(), stdin=subprocess.DEVNULL,
    )
    c.on_exit(proc.kill)
    try:
        b.close()
        msg = _ready_decoder.decode(_recv_frame(a))
        dt = time.perf_counter_ns() - t0
        assert isinstance(msg, m.Ready), msg
    finally:
        a.close()
        proc.wait(10)
    return dt


def fork_helper(n: int, kind: str, workspace: Path | None = None) -> list[int]:
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_HELPER, str(n), kind, str(workspace or "")],
        capture_output=True, text=True, env=c.child_env(), timeout=60,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"fork helper ({kind}) failed:\n{proc.stderr}")
    return list(json.loads(proc.stdout))


def store_create_times(root: Path, n: int) -> list[int]:
    from supervisor.store.files import Meta, SessionStore

    out = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        store = SessionStore.create(root, Meta(id=f"probe{time.monotonic_ns()}", handler="echo",
                                               created_at=time.time()))
        out.append(time.perf_counter_ns() - t0)
        store.remove()
    return out


async def create_batch(client: AsyncClient, count: int, times: list[int]) -> None:
    ids: list[str] = []
    try:
        for _ in range(count):
            t0 = time.perf_counter_ns()
            info = await client.create(handler="echo")
            times.append(time.perf_counter_ns() - t0)
            ids.append(info.id)
    finally:
        await asyncio.gather(*(client.remove(sid) for sid in ids))


def main() -> int:
    p = c.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=200, help="timed creates (default 200)")
    p.add_argument("--batch", type=int, default=50, help="live sessions at most (default 50)")
    p.add_argument("--popen-n", type=int, default=30, help="Popen baseline runs (default 30)")
    p.add_argument("--fork-n", type=int, default=200, help="fork-floor handshakes per kind (default 200)")
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    rep = c.Report("spawn", args.json)

    daemon = c.BenchDaemon(CONFIG, tag="sdb-spawn").start()
    rounds = max(1, -(-args.n // args.batch))
    create_ns: list[int] = []
    popen_ns: list[int] = []
    fork_bare: list[int] = []
    fork_zyg: list[int] = []
    boot_ns: list[int] = []
    store_ns: list[int] = []
    workspace = daemon.dir / "probe-workspace"
    probe_root = daemon.dir / "probe-sessions"
    probe_root.mkdir()

    async def run() -> None:
        client = await AsyncClient.connect(daemon.socket, client_name="bench-spawn")
        try:
            warm: list[int] = []
            await create_batch(client, args.warmup, warm)
            popen_once()
            fork_helper(5, "bare")
            c.quiet_gc()
            left_create, left_popen, left_fork = args.n, args.popen_n, args.fork_n
            for r in range(rounds):
                k = min(args.batch, left_create)
                await create_batch(client, k, create_ns)
                left_create -= k
                daemon.remember()
                kp = -(-left_popen // (rounds - r))
                for _ in range(kp):
                    popen_ns.append(popen_once())
                left_popen -= kp
                kf = -(-left_fork // (rounds - r))
                if kf:
                    fork_bare.extend(fork_helper(kf, "bare"))
                    fork_zyg.extend(fork_helper(kf, "zygote"))
                    boot_ns.extend(fork_helper(max(1, kf // 2), "boot", workspace))
                    store_ns.extend(store_create_times(probe_root, kf))
                left_fork -= kf
        finally:
            await client.close()

    try:
        asyncio.run(run())
    finally:
        daemon.cleanup()

    s_create = c.summarize(create_ns)
    s_popen = c.summarize(popen_ns)
    s_bare = c.summarize(fork_bare)
    s_zyg = c.summarize(fork_zyg)
    s_boot = c.summarize(boot_ns)
    s_store = c.summarize(store_ns)
    speedup = s_popen["median_us"] / s_create["median_us"]
    rep.figures = {"create": s_create, "popen": s_popen, "fork_bare": s_bare, "fork_zygote_like": s_zyg,
                   "worker_boot_no_daemon": s_boot, "store_create": s_store,
                   "popen_over_create": speedup}

    def row(name: str, s: dict[str, float]) -> list[str]:
        return [name, str(int(s["n"])), c.fmt_us(s["median_us"]), c.fmt_us(s["p99_us"]),
                c.fmt_us(s["min_us"]), f"{s['median_us'] / s_create['median_us']:.2f}x"]

    rep.say(f"spawn: create -> ready, {daemon.state_dir.parent} on this machine, "
            f"{args.batch} live at most")
    rep.table(
        ["what", "n", "median", "p99", "min", "vs create"],
        [
            row("create -> ready (daemon, echo)", s_create),
            row("Popen + import + handshake", s_popen),
            row("fork floor: bare python", s_bare),
            row("fork floor: zygote-like parent", s_zyg),
            row("  part: fork + run_worker -> Ready", s_boot),
            row("  part: SessionStore.create", s_store),
        ],
    )
    rep.say("(parts: the worker's boot from a zygote-like parent without the daemon, and the durable\n"
            " session directory on the same filesystem: the two largest pieces of a create)")
    rep.goal("create->ready median <= 3 ms", s_create["median_us"], 3000,
             f"{s_create['median_us'] / 1000:.2f} ms")
    rep.goal("create->ready >= 30x faster than Popen", speedup, 30,
             f"{speedup:.1f}x", higher_is_better=True)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
