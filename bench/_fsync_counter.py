"""Run sessiond counting its fsyncs, for bench/steps.py.

    SESSIOND_BENCH_FSYNC_COUNT=FILE python bench/_fsync_counter.py run --config C ...

Wraps `os.fdatasync` and `os.fsync` in the daemon's process so that each
call first appends one byte to FILE (the count is its size), then calls
`supervisor.cli.main`; no project file changes.  Every flush of the journal,
of a log or of a snapshot is one of these calls.  The byte is written
before the flush, in the thread that flushes, so it costs that thread a
write(2), not the loop anything.

Run with no arguments (as `make bench` does with every bench/*.py) it only
prints this usage.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

if __name__ == "__main__":
    import _path  # noqa: F401  (the checkout on sys.path, not bench/)


def _counting(fd: int, real: Callable[[Any], None]) -> Callable[[Any], None]:
    def flush(target: Any) -> None:
        os.write(fd, b".")
        real(target)

    return flush


def main() -> int:
    path = os.environ.get("SESSIOND_BENCH_FSYNC_COUNT")
    if not path or len(sys.argv) < 2:
        print(__doc__)
        return 0
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.fdatasync = _counting(fd, os.fdatasync)  # type: ignore[assignment]
    os.fsync = _counting(fd, os.fsync)  # type: ignore[assignment]
    from supervisor.cli import main as sessiond

    result: int = sessiond(sys.argv[1:])
    return result


if __name__ == "__main__":
    sys.exit(main())
