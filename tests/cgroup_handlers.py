"""Handlers whose own code starts processes that leave the worker's tree
(`cgroup_handlers:NAME`), for the cgroup tests: no tool host, no sandbox,
only the session's cgroup (or the zygote) between them and the machine.

A turn's text names what to start, each tagged `sessiond-esc-<tag>-<kind>`
(in its command line) so the tests find them:

    setsid TAG     a sleep in a session of its own, its parent gone (setsid)
    daemon TAG     a sleep double-forked as daemon(3) does
    userns TAG     a sleep in a user and PID namespace of its own (unshare)
    hog TAG MIB    a setsid'd process that fills MIB MiB and holds it
    memfd TAG MIB  a setsid'd process that write()s MIB MiB into a memfd
                   (never mapped: no RSS) and holds it; a write refused
                   is named as its process name (/proc/PID/comm),
                   "ENOMEM HELD_MIB", its memfd let go of
    children N     N sleeps that stay the worker's children (not detached)
"""

from __future__ import annotations

import subprocess
import sys

from session_worker.echo import EchoHandler
from session_worker.handler import HandlerInit, TurnContext, TurnResult

_SLEEP = "exec -a sessiond-esc-{tag}-{kind} sleep infinity"  # held until the session's kill
# A write(2) past the cap may fail (ENOMEM): the memfd is let go of (what
# comes next needs no memory then) and the refusal named as the process's
# name ("ENOMEM 63": the error, the MiB it held), read in /proc/PID/comm.
_MEMFD = ("import errno, os, signal\n"
          "fd = os.memfd_create(\"hold\")\n"
          "try:\n"
          "    for _ in range({mib}): os.write(fd, bytes(1 << 20))\n"
          "except OSError as exc:\n"
          "    held = os.fstat(fd).st_size >> 20\n"
          "    os.close(fd)\n"
          "    with open(\"/proc/self/comm\", \"w\") as f: f.write(f\"{{errno.errorcode[exc.errno]}} {{held}}\")\n"
          "signal.pause()\n")  # held until the session's kill
_HOG = ("import signal\n"
        "x = bytearray({mib} << 20)\n"
        "for i in range(0, len(x), 4096): x[i] = 1\n"
        "signal.pause()\n")  # held until the session's kill


def _detached(cmd: list[str]) -> None:
    """Start `cmd` so that its parent exits at once: it re-parents to the
    zygote (the subreaper), out of the worker's tree."""
    subprocess.run(["bash", "-c", '("$@" &) ; exit 0', "bash", *cmd], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Escaper(EchoHandler):
    """Echo's turn count, state and close; turns of its own."""

    async def handle(self, text: str, ctx: TurnContext) -> TurnResult:
        words = text.split()
        kind, tag = words[0], words[1]
        if kind == "children":
            # Held by the handler, so they stay in the worker's tree until its kill.
            self.kids = [subprocess.Popen(["sleep", "infinity"], stdin=subprocess.DEVNULL)
                         for _ in range(int(tag))]
            return TurnResult(f"started {tag}", record=1)
        sleep = _SLEEP.format(tag=tag, kind=kind)
        if kind == "setsid":
            _detached(["setsid", "bash", "-c", sleep])
        elif kind == "daemon":
            # daemon(3): fork, setsid, fork again; the middle one exits.
            _detached(["setsid", "bash", "-c", f"(bash -c '{sleep}' &) ; exit 0"])
        elif kind == "userns":
            _detached(["setsid", "unshare", "--user", "--map-root-user", "--pid", "--fork",
                       "bash", "-c", sleep])
        elif kind == "hog":
            code = _HOG.format(mib=int(words[2]))
            _detached(["setsid", "bash", "-c",
                       f"exec -a sessiond-esc-{tag}-hog {sys.executable} -c '{code}'"])
        elif kind == "memfd":
            code = _MEMFD.format(mib=int(words[2]))
            _detached(["setsid", "bash", "-c",
                       f"exec -a sessiond-esc-{tag}-memfd {sys.executable} -c '{code}'"])
        else:
            return TurnResult(f"unknown: {kind}", record=1)
        self.turns += 1
        return TurnResult(f"started {kind}", record=1)


def escaper(init: HandlerInit) -> Escaper:
    return Escaper(init)
