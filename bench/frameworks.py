"""What a session of an agent framework costs: create -> ready and an idle
worker's USS/PSS for a handler that imports `openai-agents`, preloaded by
the zygote vs imported by each worker, beside echo in the same daemon.

    .venv/bin/python bench/frameworks.py [--n 10] [--json]

Two daemons, one after the other: "preloaded" allows bench._agents_handler
(its module, and so the SDK, imported once in the zygote), "per worker"
allows bench._agents_lazy (the zygote preloads that small module; each
worker imports the SDK in its factory, as every worker did before issue
30).  In each, --n creates of echo and of the framework's handler,
interleaved, one at a time (`AsyncClient.create`: request to Ready), then
each idle session's worker measured (psutil `memory_full_info`).

Goals (issue 30), preloaded: create <= 3x echo's median, USS <= echo's + 3 MiB.
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import asyncio
import json
import os
import statistics
import time
from typing import Any

from bench import _common as c

import psutil

from ipc.loop import run as loop_run
from supervisor.ctl.client import AsyncClient

MiB = 1024 * 1024


async def _measure(d: c.BenchDaemon, handlers: dict[str, str], n: int) -> dict[str, dict[str, float]]:
    client = await AsyncClient.connect(str(d.socket), client_name="bench-frameworks")
    times: dict[str, list[float]] = {k: [] for k in handlers}
    sids: dict[str, list[str]] = {k: [] for k in handlers}
    for _ in range(n):
        for label, handler in handlers.items():
            t0 = time.perf_counter()
            sids[label].append((await client.create(handler=handler)).id)
            times[label].append((time.perf_counter() - t0) * 1000)
    await asyncio.sleep(0.5)  # idle: every worker back in its blocking wait
    out: dict[str, dict[str, float]] = {}
    for label in handlers:
        uss, pss = [], []
        for sid in sids[label]:
            pid = (await client.status(sid)).pid
            assert pid is not None
            info = psutil.Process(pid).memory_full_info()
            uss.append(info.uss / MiB)
            pss.append(info.pss / MiB)
        out[label] = {"create_ms": statistics.median(times[label]), "uss_mib": statistics.median(uss),
                      "pss_mib": statistics.median(pss)}
    await client.close()
    return out


def _run(allowed: str, handler: str, n: int) -> dict[str, dict[str, float]]:
    config = f"""
[agent]
handler = "echo"
allowed_handlers = ["echo", "{allowed}"]
[agent.limits]
max_concurrent_sessions = 1000
"""
    with c.BenchDaemon(config, tag="sd-fw") as d:
        return loop_run(_measure(d, {"echo": "echo", "framework": handler}, n))


def main() -> None:
    p = c.arg_parser(__doc__ or "")
    p.add_argument("--n", type=int, default=10)
    args = p.parse_args()
    results = {
        "preloaded": _run("bench._agents_handler:*", "bench._agents_handler:make", args.n),
        "per worker": _run("bench._agents_lazy:*", "bench._agents_lazy:make", args.n),
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; n={args.n} of each\n")
    print(f"{'daemon':<12}{'handler':<12}{'create ms':>11}{'x echo':>8}{'USS MiB':>10}{'+ echo':>8}{'PSS MiB':>10}")
    for name, figures in results.items():
        echo = figures["echo"]
        for label, f in figures.items():
            print(f"{name:<12}{label:<12}{f['create_ms']:>11.1f}{f['create_ms'] / echo['create_ms']:>8.2f}"
                  f"{f['uss_mib']:>10.2f}{f['uss_mib'] - echo['uss_mib']:>+8.2f}{f['pss_mib']:>10.2f}")
    pre = results["preloaded"]
    ratio = pre["framework"]["create_ms"] / pre["echo"]["create_ms"]
    extra = pre["framework"]["uss_mib"] - pre["echo"]["uss_mib"]
    print(f"\ngoal (preloaded): create <= 3x echo: {ratio:.2f}x {'ok' if ratio <= 3 else 'MISSED'}; "
          f"USS <= echo + 3 MiB: {extra:+.2f} MiB {'ok' if extra <= 3 else 'MISSED'}")


if __name__ == "__main__":
    main()
