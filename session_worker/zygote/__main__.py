"""`python -P -m session_worker.zygote --fd N --daemon-pid P [--preload
MODULES] [--expose]`: a zygote started by exec (the daemon's
`ZygoteSpawner` when one must be replaced; a Ray node host, which never
forks).  Runs in the zygote process, before `zygote_main`."""

from __future__ import annotations

import argparse
import socket
import sys

from session_worker.zygote.server import zygote_main


def _exec_main() -> int:
    parser = argparse.ArgumentParser(prog="python -m session_worker.zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--daemon-pid", type=int, required=True)
    parser.add_argument("--preload", default="")
    parser.add_argument("--expose", action="store_true")
    args = parser.parse_args()
    return zygote_main(socket.socket(fileno=args.fd), args.daemon_pid, [m for m in args.preload.split(",") if m],
                       args.expose)


if __name__ == "__main__":
    sys.exit(_exec_main())
