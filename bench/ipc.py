"""IPC round trips through a real daemon, against raw socket baselines, and the
same on uvloop.

    .venv/bin/python bench/ipc.py [--n 20000] [--turns 2000] [--no-uvloop] [--json]

What is timed (each a median and p99 over --n, or --turns for turns):
(a) session ping: `AsyncClient.ping(session_id)`: client -> daemon -> worker
    -> daemon -> client, no disk.
(b) echo turn: `AsyncClient.send_text(sid, <100 bytes>)`: input appended and
    fdatasync'd, Accepted, the worker streams three deltas, the commit is
    appended and fdatasync'd, TurnDone.  Two fdatasyncs per turn, so the
    fdatasync of a 100-byte append on the same filesystem is printed beside.
(c) baseline: one small framed msgpack message (a Ping) to a forked child
    that echoes it, blocking sockets on both ends: the floor of one hop.
    Also the same echo with the project's FramedProtocol on asyncio at both
    ends: one hop as the daemon's code pays it.
(d) daemon ping: `AsyncClient.ping()`: client -> daemon -> client, one hop.

All of these run in interleaved rounds so that noise falls on each alike.

Then the uvloop experiment (if uvloop is importable): two more daemons,
started through bench/_loop_launcher.py with the asyncio and the uvloop
policy (both under `python -O`, which uvloop needs: see that file), the
client in a `python -O` subprocess running the same rounds on either loop.
The bench checks that the daemon and the worker really run uvloop (the
launcher's log lines, and a handler that reports its running loop).
"""

from __future__ import annotations

import _path  # (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

from bench import _common as c

import msgspec

from ipc import messages as m
from ipc.connection import FramedProtocol
from ipc.framing import FrameEncoder
from supervisor.ctl.client import AsyncClient

LAUNCHER = _path.BENCH / "_loop_launcher.py"
TEXT = ("0123456789" * 10)[:100]
CONFIG = ""
ROUNDS = 10
_any_decoder = msgspec.msgpack.Decoder()
_request_decoder = msgspec.msgpack.Decoder(m.Request)


# ---------------------------------------------------------------- echo children (forked before any loop)


def _recv_exact(sock: socket.socket, n: int, buf: bytearray) -> bool:
    while len(buf) < n:
        chunk = sock.recv(65536)
        if not chunk:
            return False
        buf += chunk
    return True


def _raw_echo(sock: socket.socket) -> None:
    buf = bytearray()
    while True:
        if not _recv_exact(sock, 4, buf):
            return
        end = 4 + int.from_bytes(buf[:4], "big")
        if not _recv_exact(sock, end, buf):
            return
        sock.sendall(buf[:end])
        del buf[:end]


def _framed_echo(sock: socket.socket, kind: str) -> None:
    if kind == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        proto: FramedProtocol[Any] | None = None

        def on_message(msg: Any) -> None:
            assert proto is not None
            proto.send(msg)

        sock.setblocking(False)
        _, proto = await loop.create_unix_connection(
            lambda: FramedProtocol(_any_decoder, on_message=on_message), sock=sock
        )
        await proto.closed

    asyncio.run(main())


def fork_echo(target: Callable[..., None], *args: Any) -> tuple[int, socket.socket]:
    """Fork a child running `target(sock, *args)`; call before any loop runs."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            ours.close()
            target(theirs, *args)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    theirs.close()

    def stop() -> None:
        ours.close()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass

    c.on_exit(stop)
    return pid, ours


# ---------------------------------------------------------------- timed loops


def raw_pingpong(sock: socket.socket, count: int, out: list[int]) -> None:
    enc = FrameEncoder()
    buf = bytearray()
    sock.setblocking(True)
    for i in range(count):
        t0 = time.perf_counter_ns()
        sock.sendall(enc.encode(m.Ping(id=i, session="bench")))
        _recv_exact(sock, 4, buf)
        end = 4 + int.from_bytes(buf[:4], "big")
        _recv_exact(sock, end, buf)
        _request_decoder.decode(memoryview(buf)[4:end])
        out.append(time.perf_counter_ns() - t0)
        del buf[:end]


class FramedPeer:
    """The client half of the FramedProtocol echo, on the running loop."""

    def __init__(self, proto: FramedProtocol[Any]) -> None:
        self.proto = proto
        self.fut: asyncio.Future[Any] | None = None

    @classmethod
    async def connect(cls, sock: socket.socket) -> FramedPeer:
        loop = asyncio.get_running_loop()
        peer: FramedPeer | None = None

        def on_message(msg: Any) -> None:
            assert peer is not None and peer.fut is not None
            peer.fut.set_result(msg)

        dup = socket.socket(fileno=os.dup(sock.fileno()))
        dup.setblocking(False)
        _, proto = await loop.create_unix_connection(
            lambda: FramedProtocol(_request_decoder, on_message=on_message), sock=dup
        )
        peer = cls(proto)
        return peer

    async def run(self, count: int, out: list[int]) -> None:
        loop = asyncio.get_running_loop()
        for i in range(count):
            t0 = time.perf_counter_ns()
            self.fut = loop.create_future()
            self.proto.send(m.Ping(id=i, session="bench"))
            await self.fut
            out.append(time.perf_counter_ns() - t0)

    def close(self) -> None:
        # Detach without closing the shared socket: abort only our dup.
        transport = self.proto.transport
        if transport is not None:
            transport.abort()


async def session_pings(client: AsyncClient, sid: str, count: int, out: list[int]) -> None:
    for _ in range(count):
        t0 = time.perf_counter_ns()
        await client.ping(sid)
        out.append(time.perf_counter_ns() - t0)


async def daemon_pings(client: AsyncClient, count: int, out: list[int]) -> None:
    for _ in range(count):
        t0 = time.perf_counter_ns()
        await client.ping()
        out.append(time.perf_counter_ns() - t0)


async def turns(client: AsyncClient, sid: str, count: int, out: list[int]) -> None:
    for _ in range(count):
        t0 = time.perf_counter_ns()
        reply = await client.send_text(sid, TEXT)
        out.append(time.perf_counter_ns() - t0)
    if not reply.endswith(": " + TEXT):
        raise RuntimeError(f"unexpected echo reply {reply[:40]!r}")


def fdatasync_times(directory: Path, count: int) -> list[int]:
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    out = []
    try:
        for _ in range(count):
            t0 = time.perf_counter_ns()
            os.write(fd, b"x" * 108)
            os.fdatasync(fd)
            out.append(time.perf_counter_ns() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return out


def split(total: int, rounds: int) -> list[int]:
    return [total // rounds + (1 if r < total % rounds else 0) for r in range(rounds)]


# ---------------------------------------------------------------- stock run


ROLES = {
    "session_ping": ("client", "daemon", "worker"),
    "turn": ("client", "daemon", "worker"),
    "daemon_ping": ("client", "daemon"),
    "raw": ("client", "echo"),
    "framed": ("client", "echo"),
    "fdatasync": ("client",),
}


def stock(args: Any) -> tuple[dict[str, list[int]], c.CpuMeter]:
    raw_pid, raw_sock = fork_echo(_raw_echo)
    fr_pid, fr_sock = fork_echo(_framed_echo, "asyncio")
    daemon = c.BenchDaemon(CONFIG, tag="sdb-ipc").start()
    res: dict[str, list[int]] = {k: [] for k in ("session_ping", "turn", "raw", "framed", "daemon_ping")}
    meters: dict[str, c.CpuMeter] = {}

    async def run() -> None:
        client = await AsyncClient.connect(daemon.socket, client_name="bench-ipc")
        peer = await FramedPeer.connect(fr_sock)
        try:
            info = await client.create(handler="echo")
            sid = info.id
            assert info.pid is not None
            daemon.remember()
            # One meter per pair of processes, so an echo child is "echo".
            meters["session"] = c.CpuMeter({"client": os.getpid(), "daemon": daemon.pid, "worker": info.pid})
            meters["raw"] = c.CpuMeter({"client": os.getpid(), "echo": raw_pid})
            meters["framed"] = c.CpuMeter({"client": os.getpid(), "echo": fr_pid})
            junk: list[int] = []
            await session_pings(client, sid, 500, junk)
            await daemon_pings(client, 500, junk)
            await turns(client, sid, 50, junk)
            raw_pingpong(raw_sock, 500, junk)
            await peer.run(500, junk)
            c.quiet_gc()
            ms, mr, mf = meters["session"], meters["raw"], meters["framed"]
            for n_ping, n_turn in zip(split(args.n, ROUNDS), split(args.turns, ROUNDS)):
                b = ms.snap()
                await session_pings(client, sid, n_ping, res["session_ping"])
                ms.add("session_ping", b, n_ping)
                b = ms.snap()
                await turns(client, sid, n_turn, res["turn"])
                ms.add("turn", b, n_turn)
                b = mr.snap()
                raw_pingpong(raw_sock, n_ping, res["raw"])
                mr.add("raw", b, n_ping)
                b = mf.snap()
                await peer.run(n_ping, res["framed"])
                mf.add("framed", b, n_ping)
                b = ms.snap()
                await daemon_pings(client, n_ping, res["daemon_ping"])
                ms.add("daemon_ping", b, n_ping, ("client", "daemon"))
            await client.remove(sid)
        finally:
            peer.close()
            await client.close()

    try:
        asyncio.run(run())
        mfs = meters["fsync"] = c.CpuMeter({"client": os.getpid()})
        b = mfs.snap()
        res["fdatasync"] = fdatasync_times(daemon.dir, 200)
        mfs.add("fdatasync", b, 200)
    finally:
        daemon.cleanup()
    merged = c.CpuMeter({})
    for meter in meters.values():
        merged.run.update(meter.run)
        merged.wait.update(meter.wait)
        merged.ops.update(meter.ops)
    return res, merged


def cpu_cells(meter: c.CpuMeter, kind: str) -> list[str]:
    per = meter.per_op_us(kind)
    roles = ROLES.get(kind, ())
    cpu = per["cpu_us"]
    wait = per["runq_wait_us"]
    if not cpu:
        return ["", ""]
    return ["/".join(f"{cpu.get(r, 0):.0f}" for r in roles), "/".join(f"{wait.get(r, 0):.0f}" for r in roles)]


# ---------------------------------------------------------------- uvloop experiment


def _experiment_client(spec: dict[str, Any]) -> None:
    """Runs in a `python -O` subprocess; prints {loop: {what: [ns...]}} as JSON."""
    import uvloop

    factories = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    echo = {kind: fork_echo(_framed_echo, kind)[1] for kind in factories}
    res: dict[str, dict[str, list[int]]] = {
        k: {w: [] for w in ("session_ping", "turn", "framed", "daemon_ping")} for k in factories
    }
    meters = {
        k: c.CpuMeter({"client": os.getpid(), "daemon": spec["daemons"][k]["pid"],
                       "worker": spec["daemons"][k]["worker"]})
        for k in factories
    }

    async def chunk(kind: str, n_ping: int, n_turn: int, warm: bool) -> str:
        d = spec["daemons"][kind]
        out = res[kind] if not warm else {w: [] for w in res[kind]}
        client = await AsyncClient.connect(d["socket"], client_name=f"bench-ipc-{kind}")
        peer = await FramedPeer.connect(echo[kind])
        meter = meters[kind] if not warm else c.CpuMeter(meters[kind].pids)
        try:
            b = meter.snap()
            await session_pings(client, d["session"], n_ping, out["session_ping"])
            meter.add("session_ping", b, n_ping)
            b = meter.snap()
            await turns(client, d["session"], n_turn, out["turn"])
            meter.add("turn", b, n_turn)
            await peer.run(n_ping, out["framed"])
            b = meter.snap()
            await daemon_pings(client, n_ping, out["daemon_ping"])
            meter.add("daemon_ping", b, n_ping, ("client", "daemon"))
        finally:
            peer.close()
            await client.close()
        return type(asyncio.get_running_loop()).__module__

    loops_seen = {}
    for kind, factory in factories.items():
        with asyncio.Runner(loop_factory=factory) as runner:
            loops_seen[kind] = runner.run(chunk(kind, 500, 50, True))
    c.quiet_gc()
    for r, (n_ping, n_turn) in enumerate(zip(split(spec["n"], ROUNDS), split(spec["turns"], ROUNDS))):
        order = list(factories) if r % 2 == 0 else list(reversed(factories))
        for kind in order:
            with asyncio.Runner(loop_factory=factories[kind]) as runner:
                runner.run(chunk(kind, n_ping, n_turn, False))
    cpu = {k: {w: meters[k].per_op_us(w) for w in ("session_ping", "turn", "daemon_ping")} for k in factories}
    print(json.dumps({"results": res, "client_loops": loops_seen, "cpu": cpu}))


def experiment(args: Any, rep: c.Report) -> dict[str, Any] | None:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        rep.say("uvloop is not importable: experiment skipped")
        return None
    daemons = {
        kind: c.BenchDaemon(CONFIG, launcher=LAUNCHER, launcher_args=["--loop", kind],
                            python_flags=["-O"], tag=f"sdb-{kind[:2]}")
        for kind in ("asyncio", "uvloop")
    }
    try:
        spec: dict[str, Any] = {"n": args.n, "turns": args.turns, "daemons": {}}
        checks: dict[str, dict[str, str]] = {}

        async def setup(kind: str, d: c.BenchDaemon) -> None:
            client = await AsyncClient.connect(d.socket)
            try:
                probe = (await client.create(handler="bench._loop_launcher:LoopProbe")).id
                worker_says = await client.send_text(probe, "which loop?")
                await client.remove(probe)
                info = await client.create(handler="echo")
                spec["daemons"][kind] = {"socket": str(d.socket), "session": info.id,
                                         "pid": d.pid, "worker": info.pid}
                checks[kind] = {"worker (handler)": worker_says.split(" pid=")[0]}
            finally:
                await client.close()

        for kind, d in daemons.items():
            d.start()
            asyncio.run(setup(kind, d))
            d.remember()
            lines = re.findall(r"bench-loop pid=(\d+) loop=(\S+)", d.log())
            by_pid = {int(pid): loop for pid, loop in lines}
            checks[kind]["daemon (log)"] = by_pid.get(d.pid, "?")
            workers = {loop for pid, loop in by_pid.items() if pid != d.pid}
            checks[kind]["workers (log)"] = ",".join(sorted(workers)) or "?"
        proc = subprocess.run(
            [sys.executable, "-O", str(Path(__file__).resolve()), "--_experiment-client", json.dumps(spec)],
            capture_output=True, text=True, env=c.child_env(), timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"experiment client failed:\n{proc.stderr}")
        data = json.loads(proc.stdout)
        for kind in daemons:
            checks[kind]["client"] = data["client_loops"][kind]
        return {"results": data["results"], "checks": checks, "cpu": data["cpu"]}
    finally:
        for d in daemons.values():
            d.cleanup()


# ---------------------------------------------------------------- main


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--_experiment-client":
        _experiment_client(json.loads(sys.argv[2]))
        return 0
    p = c.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20000, help="pings of each kind (default 20000)")
    p.add_argument("--turns", type=int, default=2000, help="echo turns (default 2000)")
    p.add_argument("--no-uvloop", action="store_true", help="skip the uvloop experiment")
    args = p.parse_args()
    rep = c.Report("ipc", args.json)

    res, meter = stock(args)
    s = {k: c.summarize(v) for k, v in res.items()}
    raw = s["raw"]["median_us"]
    rep.figures["stock"] = s
    rep.figures["stock_cpu_per_op"] = {k: meter.per_op_us(k) for k in ROLES}

    def row(name: str, key: str, hops: str) -> list[str]:
        f = s[key]
        return [name, hops, str(int(f["n"])), c.fmt_us(f["median_us"]), c.fmt_us(f["p99_us"]),
                f"{f['median_us'] / raw:.1f}x", *cpu_cells(meter, key)]

    rep.say("ipc: stock daemon (asyncio), Python AsyncClient; ratio = median / raw baseline median")
    rep.table(
        ["what", "hops", "n", "median", "p99", "vs raw", "CPU µs/op", "runq µs/op"],
        [
            row("(a) session ping", "session_ping", "2"),
            row("(b) echo turn, 100 B, durable", "turn", "2+disk"),
            row("(c) raw socket ping-pong (baseline)", "raw", "1"),
            row("    FramedProtocol echo on asyncio", "framed", "1"),
            row("(d) daemon ping", "daemon_ping", "1"),
            row("    fdatasync, 100 B append", "fdatasync", "disk"),
        ],
    )
    rep.say("(CPU µs/op and runq µs/op (time runnable but waiting for a CPU): client/daemon/worker,\n"
            " or client/echo child; from /proc/PID/schedstat.  A turn does two fdatasyncs: the input\n"
            " before Accepted, the commit before TurnDone.)")

    exp = None if args.no_uvloop else experiment(args, rep)
    if exp is not None:
        r = exp["results"]
        e = {kind: {w: c.summarize(v) for w, v in r[kind].items()} for kind in r}
        rep.figures["uvloop_experiment"] = {"asyncio": e["asyncio"], "uvloop": e["uvloop"],
                                            "checks": exp["checks"]}
        rep.say()
        rep.say("uvloop experiment: daemon, workers and client all on one loop kind (python -O for both)")
        rep.figures["uvloop_experiment"]["cpu_per_op"] = exp["cpu"]
        rows = []
        for w, name in (("session_ping", "(a) session ping"), ("turn", "(b) echo turn"),
                        ("daemon_ping", "(d) daemon ping"), ("framed", "    FramedProtocol echo")):
            a, u = e["asyncio"][w], e["uvloop"][w]
            cpu_cols = []
            for kind in ("asyncio", "uvloop"):
                per = exp["cpu"].get(kind, {}).get(w)
                roles = ROLES[w]
                cpu_cols.append("/".join(f"{per['cpu_us'].get(r, 0):.0f}" for r in roles) if per else "")
            rows.append([name, c.fmt_us(a["median_us"]), c.fmt_us(a["p99_us"]),
                         c.fmt_us(u["median_us"]), c.fmt_us(u["p99_us"]),
                         f"{a['median_us'] / u['median_us']:.2f}x", *cpu_cols])
        rep.table(["what", "asyncio med", "p99", "uvloop med", "p99", "speedup",
                   "CPU/op asyncio", "CPU/op uvloop"], rows)
        for kind, ch in exp["checks"].items():
            rep.say(f"  {kind} run, loops seen: " + "; ".join(f"{k}: {v}" for k, v in ch.items()))

    rep.say()
    a, b, d = s["session_ping"]["median_us"], s["turn"]["median_us"], s["daemon_ping"]["median_us"]
    rep.goal("session ping median <= 100 us", a, 100, f"{a:.1f} us ({a / raw:.1f}x raw)")
    rep.goal("echo turn median <= 400 us", b, 400, f"{b:.0f} us ({b / raw:.1f}x raw)")
    rep.say(f"(daemon ping, no goal: {d:.1f} us, {d / raw:.1f}x raw)")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
