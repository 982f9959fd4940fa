"""What a workspace image costs beside a plain directory (issue 29).

    sudo .venv/bin/python bench/disk_images.py [--n 40] [--rounds 3] [--json]

What is measured, in interleaved rounds (images, plain, images, plain...):
* prepare: `Workspaces.prepare` of a new session's workspace, the daemon's
  own code, `[tools] disk_quota = "auto"` (root: an ext4 image, mkfs and a
  loop mount, max_disk_mb 2048 and max_disk_inodes 262,144, the defaults)
  against `"measured"` (a plain directory);
* remove: `Workspaces.remove` of it (unmount, the image deleted; rmtree);
* memory: with `--n` images mounted, the host's used memory (MemTotal -
  MemAvailable) and its kernel part (Slab + KernelStack + PageTables +
  Percpu) against the same with `--n` plain directories, per workspace;
* disk: what a fresh image takes on the host (allocated blocks).
* create: `sessionctl create` -> ready through a real daemon, each way
  (the worker's fork and boot included), to show the image in the figure a
  user sees.

Root only (a loop device and a mount need CAP_SYS_ADMIN).  The memory
figures are host-wide and the machine is shared: read them as an order of
magnitude (the table says how loaded it was).
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import os
import secrets
import shutil
import tempfile
import time
import types
from typing import Any

from bench import _common as c

from supervisor.config import parse_config
from supervisor.core.workspaces import Workspaces


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def _used() -> tuple[int, int]:
    info = _meminfo()
    kernel = sum(info.get(k, 0) for k in ("Slab", "KernelStack", "PageTables", "Percpu"))
    return info["MemTotal"] - info["MemAvailable"], kernel


def _spaces(root: Path, mode: str) -> Workspaces:
    cfg = parse_config({"tools": {"disk_quota": mode, "workspace_dir": str(root / mode)}}, "bench")
    return Workspaces(lambda: cfg, root, None, None)


def _session(spaces: Workspaces) -> Any:
    sid = secrets.token_hex(6)
    settings = spaces._config().session_settings()
    return types.SimpleNamespace(id=sid, settings=settings,
                                 meta=types.SimpleNamespace(workspace=f"{sid}@{secrets.token_hex(8)}", run_uid=None))


def _round(spaces: Workspaces, n: int) -> dict[str, Any]:
    sessions = [_session(spaces) for _ in range(n)]
    os.sync()
    before = _used()
    made = []
    for s in sessions:
        t = time.perf_counter_ns()
        spaces.prepare(s)
        made.append(time.perf_counter_ns() - t)
    os.sync()
    time.sleep(0.2)
    after = _used()
    disk = sum(os.stat(p).st_blocks * 512 for p in (spaces.root() / ".images").glob("*.img")) \
        if spaces.quota.images else 0
    gone = []
    for s in sessions:
        t = time.perf_counter_ns()
        spaces.remove(s)
        gone.append(time.perf_counter_ns() - t)
    return {"prepare": made, "remove": gone, "used": (after[0] - before[0]) / n,
            "kernel": (after[1] - before[1]) / n, "disk": disk / n}


def _create_latency(mode: str, n: int) -> list[int]:
    config = f'[tools]\ndisk_quota = "{mode}"\n'
    times: list[int] = []
    with c.BenchDaemon(config) as d:
        from supervisor.ctl.client import Client

        with Client(d.socket) as client:
            for _ in range(n):
                t = time.perf_counter_ns()
                sid = client.create(handler="echo").id
                times.append(time.perf_counter_ns() - t)
                client.remove(sid)
    return times


def main() -> int:
    p = c.arg_parser(__doc__ or "")
    p.add_argument("--n", type=int, default=40, help="workspaces per round (default 40)")
    p.add_argument("--rounds", type=int, default=3, help="rounds each way (default 3)")
    p.add_argument("--creates", type=int, default=20, help="daemon creates each way (default 20)")
    args = p.parse_args()
    report = c.Report("disk_images", args.json)
    if os.geteuid() != 0:
        report.say("root only: a loop device and a mount need CAP_SYS_ADMIN")
        return 1
    root = Path(tempfile.mkdtemp(prefix="sd-bench-img-"))
    c.on_exit(lambda: shutil.rmtree(root, ignore_errors=True))
    ways = {"image": _spaces(root, "auto"), "plain": _spaces(root, "measured")}
    assert ways["image"].quota.images, ways["image"].quota.describe()
    results: dict[str, list[dict[str, Any]]] = {"image": [], "plain": []}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for way, spaces in ways.items():
            results[way].append(_round(spaces, args.n))
    creates = {"image": [], "plain": []}  # type: dict[str, list[int]]
    for _ in range(2):
        for way, mode in (("image", "auto"), ("plain", "measured")):
            creates[way] += _create_latency(mode, args.creates // 2)
    rows = []
    figures: dict[str, dict[str, float]] = {}
    for way in ("image", "plain"):
        made = c.summarize([x for r in results[way] for x in r["prepare"]])
        gone = c.summarize([x for r in results[way] for x in r["remove"]])
        create = c.summarize(creates[way])
        used = sorted(r["used"] for r in results[way])[len(results[way]) // 2]
        kernel = sorted(r["kernel"] for r in results[way])[len(results[way]) // 2]
        disk = sorted(r["disk"] for r in results[way])[len(results[way]) // 2]
        figures[way] = {"prepare_median_us": made["median_us"], "prepare_p99_us": made["p99_us"],
                        "remove_median_us": gone["median_us"], "create_median_us": create["median_us"],
                        "used_bytes_per_workspace": used, "kernel_bytes_per_workspace": kernel,
                        "disk_bytes_per_workspace": disk}
        rows.append([way, c.fmt_us(made["median_us"]), c.fmt_us(made["p99_us"]), c.fmt_us(gone["median_us"]),
                     c.fmt_us(create["median_us"]), f"{used / 1024:.0f} KiB", f"{kernel / 1024:.0f} KiB",
                     f"{disk / 1024:.0f} KiB"])
    report.say(f"{args.rounds} rounds of {args.n} workspaces each way, {args.creates} daemon creates each way; "
               f"load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at the end")
    report.table(["workspace", "prepare p50", "prepare p99", "remove p50", "create p50", "memory each",
                  "kernel mem each", "host disk each"], rows)
    report.figures = figures
    extra = figures["image"]["create_median_us"] - figures["plain"]["create_median_us"]
    report.goal("an image adds under 50 ms to a create (median)", extra / 1000, 50.0,
                f"{extra / 1000:+.1f} ms")
    report.goal("an image costs the host under 2 MiB of memory", figures["image"]["used_bytes_per_workspace"]
                / 1048576, 2.0, f"{figures['image']['used_bytes_per_workspace'] / 1048576:.2f} MiB")
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
