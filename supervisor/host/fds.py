"""The daemon's file descriptors as the kernel has them: its RLIMIT_NOFILE
raised and read, and how many it holds open now (for
supervisor.core.fdbudget, which decides what they hold).  Runs in the
daemon, and in `sessiond config check` (the hard limit of its shell)."""

from __future__ import annotations

import errno
import logging
import os
import resource

__all__ = ["nofile_limit", "open_count", "raise_nofile_limit"]

log = logging.getLogger("sessiond")


def raise_nofile_limit() -> None:
    """Soft to hard, first thing at start (systemd's default soft limit of
    1024 is far below its hard one), and say what it got."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise RLIMIT_NOFILE from %d to its hard limit %d: %s", soft, hard, exc)
        return
    log.info("RLIMIT_NOFILE raised from %d to its hard limit %d", soft, hard)


def nofile_limit(hard: bool = False) -> int:
    soft_limit, hard_limit = resource.getrlimit(resource.RLIMIT_NOFILE)
    return hard_limit if hard else soft_limit


def open_count(limit: int) -> int | None:
    """The fds open in this process now (its own listing's included: the
    count errs high); `limit` when none is left to list them; None without
    /proc."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return limit
        return None
