"""The handler bench/sweep.py runs in its sessions (`bench._sweep_handler:forker`).

Runs in a session's worker.  Each input is a number N: the handler starts
one Python process that fills 20 MiB and forks N - 1 children sharing it,
copy-on-write, all sleeping until killed: the RSS summed is N x ~28 MiB,
the PSS summed ~28 MiB plus a little per child.  Over a 1 GiB cap by RSS
(N = 511: ~14 GiB), far under it by PSS: the case where the sweep reads
every process's smaps_rollup.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from session_worker.handler import HandlerInit, TurnContext, TurnResult

_FORKER = """
import os, signal, sys
b = b'y' * (20 << 20)
for _ in range(int(sys.argv[1]) - 1):
    if os.fork() == 0:
        break
else:
    print('forked', flush=True)
signal.pause()
"""


class Forker:
    def __init__(self, init: HandlerInit) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def restore(self, state: Any, records: list[Any]) -> None:
        return None

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        n = int(text)
        proc = subprocess.Popen([sys.executable, "-c", _FORKER, str(n)], stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        assert proc.stdout is not None
        proc.stdout.readline()  # blocks the worker's loop for the forks' time: fine here
        return TurnResult(f"{n} processes", record=None)

    def snapshot(self) -> Any:
        return None

    async def aclose(self) -> None:
        for proc in self.procs:
            proc.kill()


def forker(init: HandlerInit) -> Forker:
    return Forker(init)
