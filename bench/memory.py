"""Memory of an idle worker (USS, PSS), against a worker-equivalent started by
Popen.

    .venv/bin/python bench/memory.py [--n 50] [--popen-n 5] [--json]

What is measured (psutil `memory_full_info()`, median over the processes):
* worker: --n live echo sessions, each forked from the zygote, booted and
  idle; measured once after boot and again after one echo turn each.
  USS = pages only this worker has (what killing it frees), PSS = its RSS
  with every shared page divided among the processes sharing it.
* popen: `python -c 'import session_worker.worker.main, session_worker.echo,
  session_worker.agent; <block on a pipe>'`, --popen-n of them alive at
  once, measured the same way: what a worker would cost without the zygote.
* for context: the zygote's and the daemon's RSS and USS.
* floors: children of a zygote-like helper, idle right after fork, or
  idle inside asyncio.run with one connection; and children forked with
  fork(2) through ctypes, skipping CPython's after-fork work (the stdlib's
  at-fork hooks): by difference, what os.fork itself costs every worker.

`--loop uvloop` runs the daemon (hence its workers) on uvloop through
bench/_loop_launcher.py, to see what the loop choice does to a worker.
"""

from __future__ import annotations

import _path  # (first: the checkout on sys.path, not bench/)

import sys

import asyncio
import statistics
import subprocess
import time
from typing import Any

from bench import _common as c

import psutil

from supervisor.ctl.client import AsyncClient

CONFIG = """
[agent.limits]
max_concurrent_sessions = 1000
"""

_POPEN_CHILD = (
    "import sys, session_worker.worker.main, session_worker.echo, session_worker.agent\n"
    "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
    "sys.stdin.read()\n"
)

MIB = 1024 * 1024

# A zygote-like helper (the daemon's and the zygote's imports, gc.freeze())
# that forks children which stay idle in one of two ways: blocked in a read
# right after fork (the floor: what fork alone costs), or blocked inside
# asyncio.run on a socket (what an event loop adds).  Prints their pids,
# then waits for stdin to close.
_FORK_HELPER = r"""
import asyncio, gc, os, socket, sys
import supervisor.cli, supervisor.daemon, session_worker.zygote.server
session_worker.zygote.server._preload()
n = int(sys.argv[1])
gc.collect(); gc.freeze()
pids = {"bare": [], "raw": [], "loop": []}
import ctypes
libc = ctypes.PyDLL(None)  # PyDLL: fork(2) with the GIL held, as os.fork does
keep = []
for kind in pids:
    for _ in range(n):
        r, w = os.pipe()
        a, b = socket.socketpair()
        # raw: fork(2) without CPython's after-fork work (PyOS_AfterFork_Child
        # and the at-fork hooks of threading, logging, random...): what that
        # work copies, by difference with bare.  The child runs nothing else.
        pid = libc.fork() if kind == "raw" else os.fork()
        if pid == 0:
            os.close(w)
            if kind in ("bare", "raw"):
                os.read(r, 1)
            else:
                async def idle():
                    loop = asyncio.get_running_loop()
                    b.setblocking(False)
                    _, proto = await loop.create_unix_connection(asyncio.Protocol, sock=b)
                    await loop.connect_read_pipe(asyncio.Protocol, os.fdopen(r, "rb"))
                    await asyncio.sleep(3600)
                asyncio.run(idle())
            os._exit(0)
        os.close(r)
        keep.append((w, a))
        pids[kind].append(pid)
print(" ".join(f"{k}:{','.join(map(str, v))}" for k, v in pids.items()), flush=True)
sys.stdin.read()
for w, a in keep:
    os.close(w)
for v in pids.values():
    for pid in v:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
"""


def full_info(pids: list[int]) -> list[Any]:
    return [psutil.Process(pid).memory_full_info() for pid in pids]


def med(infos: list[Any], field: str) -> float:
    return float(statistics.median(getattr(i, field) for i in infos))


def main() -> int:
    p = c.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=50, help="live sessions (default 50)")
    p.add_argument("--popen-n", type=int, default=5, help="Popen workers (default 5)")
    p.add_argument("--settle", type=float, default=0.5, help="seconds idle before measuring")
    p.add_argument("--loop", choices=("stock", "asyncio", "uvloop"), default="stock",
                   help="stock: `python -m supervisor.cli`; asyncio/uvloop: through "
                        "bench/_loop_launcher.py under python -O (an experiment)")
    args = p.parse_args()
    rep = c.Report("memory", args.json)

    if args.loop == "stock":
        daemon = c.BenchDaemon(CONFIG, tag="sdb-mem").start()
    else:
        daemon = c.BenchDaemon(CONFIG, launcher=_path.BENCH / "_loop_launcher.py", launcher_args=["--loop", args.loop],
                               python_flags=["-O"], tag="sdb-mem").start()
    popen: list[subprocess.Popen[str]] = []
    results: dict[str, Any] = {}
    try:
        # The baseline first, so its processes are measured while the
        # sessions are not yet there (they share nothing with them anyway).
        for _ in range(args.popen_n):
            proc = subprocess.Popen(
                [sys.executable, "-c", _POPEN_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, env=c.child_env(),
            )
            c.on_exit(proc.kill)
            popen.append(proc)
        for proc in popen:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a Popen worker did not start")

        helper = subprocess.Popen(
            [sys.executable, "-c", _FORK_HELPER, str(args.popen_n)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=c.child_env(), start_new_session=True,
        )
        c.on_exit(lambda: c.kill_process_tree([helper.pid]))
        assert helper.stdout is not None
        line = helper.stdout.readline().split()
        fork_pids = {k: [int(x) for x in v.split(",")] for k, v in (part.split(":") for part in line)}
        c.on_exit(lambda: c.kill_process_tree([p for v in fork_pids.values() for p in v]))

        async def run() -> None:
            client = await AsyncClient.connect(daemon.socket, client_name="bench-memory")
            try:
                infos = [await client.create(handler="echo") for _ in range(args.n)]
                pids = [i.pid for i in infos if i.pid is not None]
                daemon.remember()
                await asyncio.sleep(args.settle)
                results["booted"] = full_info(pids)
                results["popen"] = full_info([pr.pid for pr in popen])
                results["fork_bare"] = full_info(fork_pids["bare"])
                results["fork_raw"] = full_info(fork_pids["raw"])
                results["fork_loop"] = full_info(fork_pids["loop"])
                results["zygote"] = full_info([daemon.zygote_pid()])[0]
                results["daemon"] = full_info([daemon.pid])[0]
                for i in infos:
                    await client.send_text(i.id, "hello")
                await asyncio.sleep(args.settle)
                results["after_turn"] = full_info(pids)
                await asyncio.gather(*(client.remove(i.id) for i in infos))
            finally:
                await client.close()

        asyncio.run(run())
        assert helper.stdin is not None
        helper.stdin.close()
        helper.wait(10)
    finally:
        for proc in popen:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        daemon.cleanup()

    rows = []
    fig: dict[str, Any] = {}
    for key, name in (("booted", f"worker, idle after boot (n={args.n})"),
                      ("after_turn", "worker, idle after one turn"),
                      ("popen", f"Popen worker-equivalent (n={args.popen_n})"),
                      ("fork_bare", "  floor: fork child, idle at once"),
                      ("fork_raw", "  (same, fork(2) without CPython's after-fork)"),
                      ("fork_loop", "  floor: fork child + asyncio loop")):
        infos = results[key]
        fig[key] = {f: med(infos, f) for f in ("uss", "pss", "rss")}
        fig[key]["n"] = len(infos)
        rows.append([name, c.fmt_bytes(fig[key]["uss"]), c.fmt_bytes(fig[key]["pss"]),
                     c.fmt_bytes(fig[key]["rss"])])
    for key, name in (("zygote", "zygote (context)"), ("daemon", "daemon (context)")):
        i = results[key]
        fig[key] = {"uss": i.uss, "pss": i.pss, "rss": i.rss}
        rows.append([name, c.fmt_bytes(i.uss), c.fmt_bytes(i.pss), c.fmt_bytes(i.rss)])
    rep.figures = fig
    rep.say(f"memory: median over the processes; psutil memory_full_info(); daemon: {args.loop}")
    rep.table(["what", "USS", "PSS", "RSS"], rows)
    rep.say("(floors: children of a zygote-like helper (same imports, gc.freeze()), idle right after\n"
            " fork, or after starting an asyncio loop with one connection; PSS of these is shared\n"
            " with their own helper, not with the daemon's zygote)")
    w, b = fig["booted"], fig["popen"]
    rep.say(f"(worker vs Popen: USS {b['uss'] / w['uss']:.1f}x smaller, PSS {b['pss'] / w['pss']:.1f}x smaller)")
    rep.goal("idle worker USS <= 1 MiB", w["uss"] / MIB, 1.0, f"{w['uss'] / MIB:.2f} MiB")
    rep.goal("idle worker PSS <= 3 MiB", w["pss"] / MIB, 3.0, f"{w['pss'] / MIB:.2f} MiB")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
