"""What the sweep's /proc reads cost when a session's files are opened per
measure instead of kept open (issue 32), and what the daemon holds between
sweeps either way.

N idle "workers" (`sleep` processes: an idle session's worker, the common
case: nothing but its own statm/stat and children to read), and N / 4 with
three children each.  Each pass is what the sweep does for every live
session: `SessionMemory.measure`, then `sample_cpu`.  "old" is
supervisor/host/proctable.py and supervisor/core/limits.py of `--old`
(default: the commit this branch forked from main), read with `git show`
and loaded beside this checkout's ("new"); the passes alternate, old then
new, so both see the same machine.  Printed: the median pass over all
sessions, per session, the ratio, and the fds the table holds between
passes.  In one process, no daemon: the loop's own cost, nothing else.

    .venv/bin/python bench/proctable.py [--sessions 200] [--rounds 40] [--old REF] [--json]
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

from supervisor.core import limits as new_limits
from supervisor.host import proctable as new_proctable

REPO = Path(__file__).resolve().parent.parent


def _old_modules(ref: str) -> tuple[Any, Any]:
    """The old ProcTable and SessionMemory, loaded under names of their own."""
    def load(name: str, path: str, replace: tuple[str, str] = ("", "")) -> types.ModuleType:
        src = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout
        if replace[0]:
            src = src.replace(*replace)
        mod = types.ModuleType(name)
        sys.modules[name] = mod
        exec(compile(src, f"{ref}:{path}", "exec"), mod.__dict__)  # noqa: S102  (our own code at REF)
        return mod

    table = load("_old_proctable", "supervisor/host/proctable.py")
    mem = load("_old_limits", "supervisor/core/limits.py",
               ("from supervisor.host.proctable import", "from _old_proctable import"))
    return table, mem


def _workers(n: int, children: int) -> list[subprocess.Popen[bytes]]:
    script = "".join("sleep 600 & " for _ in range(children)) + "wait" if children else ""
    argv = ["bash", "-c", script] if children else ["sleep", "600"]
    return [subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]


def _wait_children(procs: list[subprocess.Popen[bytes]], children: int) -> None:
    deadline = time.monotonic() + 30
    for p in procs:
        path = f"/proc/{p.pid}/task/{p.pid}/children"
        while len(Path(path).read_text().split()) < children:
            if time.monotonic() > deadline:
                raise SystemExit("the workers' children did not start")
            time.sleep(0.01)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _scenario(label: str, n: int, children: int, rounds: int, mods: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    procs = _workers(n, children)
    try:
        if children:
            _wait_children(procs, children)
        state = {}
        for name, (ptab, lim) in mods.items():
            before = _fds()
            table = ptab.ProcTable()
            mems = [lim.SessionMemory() for _ in procs]
            state[name] = (table, mems, before)
        measures: dict[str, list[float]] = {name: [] for name in mods}
        samples: dict[str, list[float]] = {name: [] for name in mods}
        for _ in range(rounds):
            for name, (table, mems, _before) in state.items():
                t0 = time.perf_counter()
                for mem, p in zip(mems, procs):
                    mem.measure(table, p.pid)
                t1 = time.perf_counter()
                now = time.monotonic()
                for mem in mems:
                    mem.sample_cpu(table, now)
                measures[name].append(t1 - t0)
                samples[name].append(time.perf_counter() - t1)
        out: dict[str, Any] = {"scenario": label, "sessions": n, "processes": n * (1 + children)}
        for name, (table, mems, before) in state.items():
            measure, sample = statistics.median(measures[name]), statistics.median(samples[name])
            out[name] = {"measure_ms": measure * 1e3, "cpu_sample_ms": sample * 1e3,
                         "measure_per_session_us": measure / n * 1e6,
                         "cpu_sample_per_session_us": sample / n * 1e6,
                         "fds_held": _fds() - before}
            for mem in mems:
                mem.close()
            table.close()
        return out
    finally:
        for p in procs:  # their children first, by the pids read from the parent still alive
            with contextlib.suppress(OSError):
                for kid in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(kid), 9)
            p.kill()
        for p in procs:
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--old", default="")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ref = args.old or subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=REPO, check=True,
                                     capture_output=True, text=True).stdout.strip()
    old_table, old_limits = _old_modules(ref)
    mods = {"old": (old_table, old_limits), "new": (new_proctable, new_limits)}
    results = [
        _scenario("idle workers", args.sessions, 0, args.rounds, mods),
        _scenario("workers with 3 children", max(1, args.sessions // 4), 3, args.rounds, mods),
    ]
    if args.json:
        print(json.dumps({"old_ref": ref, "results": results}, indent=2))
        return
    print(f"old: {ref[:12]}  new: this checkout  (median of {args.rounds} passes; load {os.getloadavg()[0]:.2f})")
    print(f"{'scenario':24} {'sessions':>8} {'procs':>6}  {'what':12} {'old pass':>10} {'new pass':>10} "
          f"{'old/sess':>9} {'new/sess':>9} {'new/old':>8}")
    for r in results:
        o, n = r["old"], r["new"]
        for what, key in (("measure", "measure"), ("cpu sample", "cpu_sample")):
            print(f"{r['scenario']:24} {r['sessions']:>8} {r['processes']:>6}  {what:12} "
                  f"{o[key + '_ms']:>8.2f}ms {n[key + '_ms']:>8.2f}ms "
                  f"{o[key + '_per_session_us']:>7.1f}us {n[key + '_per_session_us']:>7.1f}us "
                  f"{n[key + '_ms'] / o[key + '_ms']:>7.2f}x")
        print(f"{r['scenario']:24} fds held between passes: old {o['fds_held']}, new {n['fds_held']}"
              f"{' (the children' + chr(39) + 's pidfds)' if r['processes'] > r['sessions'] else ''}")


if __name__ == "__main__":
    main()
