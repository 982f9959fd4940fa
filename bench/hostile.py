"""How much hostile clients cost a normal one: the latency of a ping and of
an echo turn from a well-behaved client (and of a fresh connection) while

  (a) nothing else happens (the baseline),
  (b) 200 slowloris clients dribble a never-finished handshake, a byte each
      every 0.2 s (reconnecting when the 10 s handshake timeout drops them),
  (c) 1,000 connections are opened (half say Hello) and abandoned, in a loop,
  (d) one client floods malformed frames (reading the errors, so it is not
      cut off as a lagging reader).

Each load runs in its own process (so it does not share our GIL), the
daemon in its own process group; everything is killed at exit.

    .venv/bin/python bench/hostile.py [--n 2000] [--json]
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import argparse
import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil

from bench import _common as c
from ipc import messages as m
from ipc.framing import encode_frame

_reply = msgspec.msgpack.Decoder(m.Reply)
HELLO = encode_frame(m.Hello(protocol=m.PROTOCOL_VERSION, client="bench-hostile"))


# ---------------------------------------------------------------- a raw client


def read_frame(s: socket.socket) -> Any:
    return _reply.decode(c.recv_frame(s))


_refused = {"count": 0}


def connect(path: Path, hello: bool = True, patience: float = 10.0) -> socket.socket:
    """Connect (and say Hello).  A Unix socket whose listen backlog is full
    refuses a non-blocking connect with EAGAIN at once (asyncio clients such
    as sessionctl then report the daemon unreachable): retry, and count."""
    deadline = time.monotonic() + patience
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        try:
            s.connect(str(path))
            break
        except BlockingIOError:
            s.close()
            _refused["count"] += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)
    if hello:
        s.sendall(HELLO)
        if not isinstance(read_frame(s), m.Welcome):
            raise RuntimeError("no welcome")
    return s


def until_id(s: socket.socket, rid: int) -> Any:
    while True:
        msg = read_frame(s)
        if getattr(msg, "id", None) == rid and not isinstance(msg, m.EVENT_TYPES):
            if isinstance(msg, m.Error):
                raise RuntimeError(f"{msg.code}: {msg.message}")
            return msg


# ---------------------------------------------------------------- loads (each in its own process)


def load_slowloris(path: Path, count: int) -> None:
    endless = struct.pack(">I", 4096) + b"\x00" * 4096
    socks: list[tuple[socket.socket, int]] = []
    while True:
        while len(socks) < count:
            with contextlib.suppress(OSError):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                s.connect(str(path))
                socks.append((s, 0))
        t0 = time.monotonic()
        alive = []
        for s, pos in socks:
            try:
                s.send(endless[pos : pos + 1])
                alive.append((s, (pos + 1) % len(endless)))
            except OSError:  # dropped by the handshake timeout: come back
                s.close()
        socks = alive
        time.sleep(max(0.0, 0.2 - (time.monotonic() - t0)))


def load_abandon(path: Path, count: int) -> None:
    while True:
        socks = []
        for i in range(count):
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(path))
                if i % 2:
                    s.send(HELLO)
                socks.append(s)
            except OSError:
                break
        for s in socks:
            s.close()


def load_flood(path: Path, batch: int) -> None:
    junk = [b"\xc1", b"\x93\x01\x02\x03", msgspec.msgpack.encode({"type": "send", "id": "x"}),
            msgspec.msgpack.encode({"type": "nope", "id": 1}), b"\x81\xa4type\xc0"]
    frames = b"".join(struct.pack(">I", len(j)) + j for j in junk) * (batch // len(junk))
    n = batch // len(junk) * len(junk)
    while True:
        try:
            s = connect(path)
            while True:
                s.sendall(frames)
                for _ in range(n):
                    read_frame(s)
        except OSError:
            time.sleep(0.01)


LOADS = {"slowloris": load_slowloris, "abandon": load_abandon, "flood": load_flood}


def start_load(kind: str, path: Path, arg: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--load", kind, "--socket", str(path),
         "--arg", str(arg)],
        stdin=subprocess.DEVNULL, start_new_session=True, env=c.child_env(),
    )

    def stop() -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    c.on_exit(stop)
    return proc


# ---------------------------------------------------------------- measurement


def measure(path: Path, session: str, n: int, budget_secs: float) -> dict[str, Any]:
    """n pings and n echo turns, interleaved, on one well-behaved connection;
    then n/10 fresh connections (connect + Hello + ping)."""
    pings: list[float] = []
    turns: list[float] = []
    fresh: list[float] = []
    rid = 0
    deadline = time.monotonic() + budget_secs
    refused_before = _refused["count"]
    with connect(path) as s:
        for i in range(n):
            rid += 1
            t0 = time.perf_counter_ns()
            s.sendall(encode_frame(m.Ping(id=rid)))
            until_id(s, rid)
            pings.append(time.perf_counter_ns() - t0)
            rid += 1
            t0 = time.perf_counter_ns()
            s.sendall(encode_frame(m.Send(id=rid, session=session, text=f"t{i}")))
            accepted = until_id(s, rid)
            while True:
                ev = read_frame(s)
                if isinstance(ev, m.TurnDone) and ev.turn == accepted.turn:
                    break
                if isinstance(ev, (m.TurnFailed, m.Lagged)):
                    raise RuntimeError(f"turn failed under load: {ev}")
            turns.append(time.perf_counter_ns() - t0)
            if time.monotonic() > deadline:
                break
        rid += 1
        s.sendall(encode_frame(m.Stats(id=rid)))
        stats = until_id(s, rid)
    for _ in range(max(1, n // 10)):
        t0 = time.perf_counter_ns()
        with connect(path) as s:
            s.sendall(encode_frame(m.Ping(id=1)))
            until_id(s, 1)
        fresh.append(time.perf_counter_ns() - t0)

    def summary(ns: list[float]) -> dict[str, float]:
        us = sorted(x / 1000 for x in ns)
        return {"n": len(us), "median_us": c.percentile(us, 50), "p99_us": c.percentile(us, 99)}

    return {"ping": summary(pings), "turn": summary(turns), "fresh": summary(fresh),
            "eagain": _refused["count"] - refused_before, "clients": stats.clients,
            "rss_mib": stats.rss_bytes / 1048576}


def wait_clients(path: Path, at_least: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    with connect(path) as s:
        rid = 0
        while True:
            rid += 1
            s.sendall(encode_frame(m.Stats(id=rid)))
            clients = int(until_id(s, rid).clients)
            if clients >= at_least or time.monotonic() > deadline:
                return clients
            time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="pings and turns per scenario")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    p.add_argument("--load", choices=sorted(LOADS), help=argparse.SUPPRESS)
    p.add_argument("--socket", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--arg", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.load:
        with contextlib.suppress(KeyboardInterrupt):
            LOADS[args.load](args.socket, args.arg)
        return 0

    # bench._common stops the daemon on any exit (atexit, SIGTERM, SIGHUP).
    started = time.monotonic()
    d = c.BenchDaemon("[agent]\nstream_buffer_size = 1024\n", tag="sdh").start()
    with connect(d.socket) as s:
        s.sendall(encode_frame(m.Create(id=1, session="bench", handler="echo")))
        until_id(s, 1)
    assert d.proc is not None
    daemon = psutil.Process(d.proc.pid)

    scenarios = [
        ("(a) quiet", None, 0, 0),
        ("(b) 200 slowloris", "slowloris", 200, 150),
        ("(c) 1,000 opened+abandoned, looping", "abandon", 1000, 0),
        ("(d) bad-frame flood", "flood", 500, 1),
    ]
    results: dict[str, Any] = {}
    for name, kind, arg, wait_for_clients in scenarios:
        load = start_load(kind, d.socket, arg) if kind else None
        if wait_for_clients:
            wait_clients(d.socket, wait_for_clients + 1, 10)
        else:
            time.sleep(0.3 if kind else 0)  # let the load get going
        # Warm-up, then the measured run.
        measure(d.socket, "bench", 50, 5)
        fig = measure(d.socket, "bench", args.n, 22)
        fig["daemon_cpu_pct"] = daemon.cpu_percent(None)
        fig["num_fds"] = daemon.num_fds()
        if load is not None:
            os.killpg(load.pid, signal.SIGKILL)
            load.wait(5)
        if d.proc.poll() is not None:
            raise RuntimeError(f"the daemon died under {name}:\n{d.log()}")
        results[name] = fig
        print(f"  {name}: {fig['ping']['n']} pings, {fig['turn']['n']} turns, "
              f"{fig['clients']} clients, RSS {fig['rss_mib']:.1f} MiB, {fig['num_fds']} fds",
              file=sys.stderr, flush=True)

    base = results["(a) quiet"]
    headers = ["scenario", "ping median", "ping p99", "turn median", "turn p99", "fresh median",
               "fresh p99", "EAGAIN", "ping med ×", "ping p99 ×", "turn med ×", "turn p99 ×",
               "fresh p99 ×"]
    rows = []
    for name, fig in results.items():
        rows.append([
            name,
            c.fmt_us(fig["ping"]["median_us"]), c.fmt_us(fig["ping"]["p99_us"]),
            c.fmt_us(fig["turn"]["median_us"]), c.fmt_us(fig["turn"]["p99_us"]),
            c.fmt_us(fig["fresh"]["median_us"]), c.fmt_us(fig["fresh"]["p99_us"]), str(fig["eagain"]),
            *(f"{fig[k][q] / base[k][q]:.2f}" for k in ("ping", "turn") for q in ("median_us", "p99_us")),
            f"{fig['fresh']['p99_us'] / base['fresh']['p99_us']:.2f}",
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print(f"(python {sys.version.split()[0]}, {os.cpu_count()} cpus, {time.monotonic() - started:.0f} s; "
          "× = ratio to (a); fresh = connect + Hello + ping on a new connection, "
          "EAGAIN = connects refused because the listen backlog was full, retried after 1 ms)")
    if args.json:
        print(json.dumps({"bench": "hostile", "cpus": os.cpu_count(), "figures": results}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
