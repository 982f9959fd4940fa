"""Handlers whose own code takes what a user's share bounds
(`share_handlers:NAME`), for the tests of the shipped unit under many users
(tests/test_unit_users.py).  Their processes run the system's Python (a
session's uid cannot reach the test's interpreter under /root) and stay
in the session's cgroup until its kill.

    fork N     up to N processes that wait: replies "forked K" at the first
               refused fork, and goes on trying (every 5 ms) while it has
               fewer, keeping the table as full as it can
    hog MIB    a process that fills MIB MiB and holds it: replies "hog PID held"
    buffers MIB  a process that fills the buffers of pipes and socketpairs
               (kernel memory, in no RSS) until it holds MIB MiB or a write
               fails: replies "buffers HELD_MIB ERRNO_NAME|-"
"""

from __future__ import annotations

import asyncio

from session_worker.echo import EchoHandler
from session_worker.handler import HandlerInit, TurnContext, TurnResult

PYTHON = "/usr/bin/python3"
_FORK = ("import os, signal, sys, time\n"
         "want, n, told = int(sys.argv[1]), 0, False\n"
         "while n < want:\n"
         "    try:\n"
         "        pid = os.fork()\n"
         "    except OSError:\n"
         "        if not told:\n"
         "            print(n, flush=True)\n"
         "            told = True\n"
         "        time.sleep(0.005)\n"
         "        continue\n"
         "    if pid == 0:\n"
         "        signal.pause()\n"
         "        os._exit(0)\n"
         "    n += 1\n"
         "if not told:\n"
         "    print(n, flush=True)\n"
         "signal.pause()\n")
_BUFFERS = ("import errno, fcntl, os, resource, signal, socket, sys\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)\n"
            "held, total, why = [], 0, '-'\n"
            "try:\n"
            "    while total < int(sys.argv[1]) << 20:\n"
            "        r, w = os.pipe()\n"
            "        held += [r, w]\n"
            "        try:\n"
            "            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ\n"
            "        except OSError:\n"
            "            pass\n"
            "        a, b = socket.socketpair()\n"
            "        held += [a, b]\n"
            "        for end, put in ((w, lambda d, w=w: os.write(w, d)), (a.fileno(), a.send)):\n"
            "            os.set_blocking(end, False)\n"
            "            try:\n"
            "                while True:\n"
            "                    total += put(bytes(65536))\n"
            "            except BlockingIOError:\n"
            "                pass\n"
            "except OSError as exc:\n"
            "    why = errno.errorcode.get(exc.errno, str(exc.errno))\n"
            "except MemoryError:\n"
            "    why = 'MemoryError'\n"
            "for end in held[-8:] if why != '-' else []:  # room to say so (a write may need memory too)\n"
            "    os.close(end) if isinstance(end, int) else end.close()\n"
            "print(total >> 20, why, flush=True)\n"
            "signal.pause()\n")
_HOG = ("import signal, sys\n"
        "x = bytearray(int(sys.argv[1]) << 20)\n"
        "for i in range(0, len(x), 4096): x[i] = 1\n"
        "print('held', flush=True)\n"
        "signal.pause()\n")


class Taker(EchoHandler):
    """Echo's turn count, state and close; turns of its own."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        kind, amount = text.split()
        code = {"fork": _FORK, "hog": _HOG, "buffers": _BUFFERS}[kind]
        proc = await asyncio.create_subprocess_exec(PYTHON, "-c", code, amount, stdout=asyncio.subprocess.PIPE,
                                                    stdin=asyncio.subprocess.DEVNULL)
        assert proc.stdout is not None
        line = (await proc.stdout.readline()).decode().strip()
        if not line:  # it died before it could say: how
            line = f"0 exit{await proc.wait()}"
        self.turns += 1
        if kind == "fork":
            return TurnResult(f"forked {line or 0}", record=1)
        return TurnResult(f"{kind} {proc.pid if kind == 'hog' else ''} {line}".replace("  ", " "), record=1)


def taker(init: HandlerInit) -> Taker:
    return Taker(init)
