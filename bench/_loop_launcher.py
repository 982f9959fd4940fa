"""Run sessiond on a chosen event loop, for bench/ipc.py's uvloop experiment.

    python -O bench/_loop_launcher.py --loop uvloop run --config C --socket S --state-dir D

Installs the loop policy, then calls `supervisor.cli.main(["run", ...])`; no
project file changes.  The daemon forks the zygote before it starts its loop,
and every worker calls `asyncio.run` after its fork, so the policy set here is
the one the daemon, the zygote and every worker use.  Each process that makes
a loop says so on stderr (the daemon's log), and `LoopProbe` (a handler:
`bench._loop_launcher:LoopProbe`) replies with the class of its worker's
running loop, so the bench can check instead of assuming.

The daemon runs on uvloop by default (ipc/loop.py); the launcher sets
SESSIOND_EVENT_LOOP to the loop it was asked for, which ipc/loop.py honours,
so the asyncio side really runs the stdlib loop.  Both sides run under -O.

Run with no arguments (as `make bench` does with every bench/*.py) it only
prints this usage.
"""

from __future__ import annotations

import os
import sys
from typing import Any

if __name__ == "__main__":
    import _path  # noqa: F401  (the checkout on sys.path, not bench/)


def _install(kind: str) -> None:
    import asyncio

    base: Any
    # ipc/loop.py picks uvloop itself unless told otherwise.
    os.environ["SESSIOND_EVENT_LOOP"] = kind
    if kind == "uvloop":
        import uvloop

        base = uvloop.EventLoopPolicy
    else:
        base = asyncio.DefaultEventLoopPolicy

    class SayingPolicy(base):  # type: ignore[misc, valid-type]
        def new_event_loop(self) -> asyncio.AbstractEventLoop:
            loop = super().new_event_loop()
            cls = type(loop)
            os.write(2, f"bench-loop pid={os.getpid()} loop={cls.__module__}.{cls.__qualname__}\n".encode())
            return loop

    asyncio.set_event_loop_policy(SayingPolicy())


class LoopProbe:
    """A handler whose reply names its worker's running loop class and pid."""

    def __init__(self, init: Any) -> None:
        self.turns = 0

    def restore(self, state: Any, records: list[Any]) -> None:
        self.turns = int(state or 0) + len(records)

    async def handle(self, text: str, ctx: Any) -> Any:
        import asyncio

        from session_worker.handler import TurnResult

        cls = type(asyncio.get_running_loop())
        self.turns += 1
        return TurnResult(reply=f"{cls.__module__}.{cls.__qualname__} pid={os.getpid()}", record=1)

    def snapshot(self) -> Any:
        return self.turns

    async def aclose(self) -> None:
        return None


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--loop" or argv[1] not in ("asyncio", "uvloop"):
        print(__doc__.strip().split("\n\n")[1])
        return 0
    _install(argv[1])
    from supervisor.cli import main as cli_main

    return cli_main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
