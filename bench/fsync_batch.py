"""What one group commit costs: K sessions each append one ~250-byte record,
then everything is made durable, in four ways (interleaved rounds, same
filesystem as the daemon's state dir, /tmp):

    .venv/bin/python bench/fsync_batch.py [--rounds 200] [--ks 1,8,50,200]

- per-session logs, fdatasync each in turn from one thread;
- per-session logs, fdatasync from a pool of 8 threads at once (ext4's
  journal folds concurrent flushes into one commit);
- per-session logs, one syncfs(2) of the filesystem;
- one shared journal: the K records appended to one file, one fdatasync
  (the design PostgreSQL's and SQLite's WALs use).

This is the measurement behind the choice in supervisor/group_commit.py;
bench/README.md has the figures.
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import ctypes
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from bench import _common as c

REC = b"r" * 250
_libc = ctypes.CDLL(None, use_errno=True)


def main() -> int:
    p = c.arg_parser(__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--ks", default="1,8,50,200")
    args = p.parse_args()
    rep = c.Report("fsync_batch", args.json)
    root = Path(tempfile.mkdtemp(prefix="fsb-", dir="/tmp"))
    c.on_exit(lambda: shutil.rmtree(root, ignore_errors=True))
    pool = ThreadPoolExecutor(8)
    rows = []
    for k in [int(x) for x in args.ks.split(",")]:
        fds = [os.open(root / f"s{k}-{i}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) for i in range(k)]
        jfd = os.open(root / f"journal{k}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        times: dict[str, list[int]] = {"serial": [], "pool8": [], "syncfs": [], "journal": []}

        def serial() -> None:
            for fd in fds:
                os.write(fd, REC)
            for fd in fds:
                os.fdatasync(fd)

        def pooled() -> None:
            for fd in fds:
                os.write(fd, REC)
            list(pool.map(os.fdatasync, fds))

        def syncfs() -> None:
            for fd in fds:
                os.write(fd, REC)
            if _libc.syncfs(fds[0]) != 0:
                raise OSError(ctypes.get_errno(), "syncfs")

        def journal() -> None:
            os.write(jfd, REC * k)
            os.fdatasync(jfd)

        fns = {"serial": serial, "pool8": pooled, "syncfs": syncfs, "journal": journal}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter_ns()
                fn()
                times[name].append(time.perf_counter_ns() - t0)
        for fd in [*fds, jfd]:
            os.close(fd)
        stats = {n: c.summarize(v) for n, v in times.items()}
        rep.figures[f"k{k}"] = stats
        rows.append([str(k)] + [f"{c.fmt_us(stats[n]['median_us'])} / {c.fmt_us(stats[n]['p99_us'])}"
                                for n in fns])
    rep.table(["sessions in batch", "serial fdatasync", "8 threads", "syncfs", "one journal"], rows)
    rep.say("(median / p99 per batch)")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
