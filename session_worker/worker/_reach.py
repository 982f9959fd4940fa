"""The daemon's Python, within the sessions' reach: run in the zygote.

A root daemon runs each session as a uid of its own (or as `worker_user`).
The zygote imports the worker's modules before it forks, as root; whatever
a worker imports later (a module the zygote did not preload: `fractions`,
the MCP SDK, a handler's own imports) it reads as the session's uid.  When
the interpreter or its packages live below a directory that uid may not
search (pyenv under a 0700 /root, a venv in a private home), every such
import fails with `No module named ...`.

So the zygote, before anything else, finds each directory on the way to
its import path (`sys.path`) that a stranger cannot search (`closed_dirs`),
checks once in a throw-away child that it can cover them (`check`), and
leaves the list to its workers (`hold`): each worker, at its boot and
before it drops to its session's uid (`cover_held`), in a mount namespace
of its own (which the daemon and the rest of the machine do not see)
covers each with a small tmpfs, mode 0755, holding bind mounts of just the
entries needed on the way: `/root` shows
the sessions `.pyenv` and nothing else.  Nothing is opened that was not
already readable by everyone below the cover (`/root/.pyenv` itself is
0755); what else the closed directory holds stays out of sight.  Mounts
made later on the host still reach the worker (slave propagation); none of
ours reach the host.  Not the zygote's own namespace: its workers would
inherit the copy made when it started, without the mounts the daemon made
since in its own (a workspace's disk image, mounted before its worker
boots: the host's `/` need not propagate them), so each worker makes its
namespace at boot, after its workspace is mounted.

It needs CAP_SYS_ADMIN (a daemon run as plain root has it; the shipped
unit does not, and install.sh refuses such a Python there): without it the
start-up fails naming the directory and the fix (`ClosedPython`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat
from pathlib import Path

from session_worker.errors import ClosedPython

__all__ = ["check", "closed_dirs", "cover_held", "hold", "open_to_sessions"]

# What the zygote found closed (`hold`), covered by each worker at its boot.
_held: dict[str, set[str]] = {}

_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_SLAVE = 0x2, 0x4, 0x1000, 0x4000, 0x80000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def closed_dirs(paths: list[str], cwd: str = "") -> dict[str, set[str]]:
    """Each directory on the way to `paths` that others may not search,
    with the one entry below it on the way.  Only the way: a path that is
    itself closed stays closed (opening it would show everything in it),
    and `cwd` is left out (`python -m` puts the daemon's working directory
    on its path; no code is imported from there, and it may hold anything)."""
    needs: dict[str, set[str]] = {}
    for raw in paths:
        try:
            target = Path(raw).resolve(strict=True)
        except OSError:
            continue
        if not raw or str(target) == cwd or not target.is_dir():
            continue
        for here, below in zip(reversed(target.parents), [*reversed(target.parents)][1:] + [target]):
            if not os.stat(here).st_mode & stat.S_IXOTH:
                needs.setdefault(str(here), set()).add(below.name)
    return needs


def closed_itself(path: str) -> bool:
    """Whether others may not search `path` or a directory on the way to it."""
    target = Path(path).resolve()
    return any(not os.stat(here).st_mode & stat.S_IXOTH for here in [*target.parents, target])


def hold(needs: dict[str, set[str]]) -> None:
    """In the zygote: what each worker covers at its boot (`cover_held`)."""
    _held.clear()
    _held.update(needs)


def cover_held() -> None:
    """In a worker at its boot, still root: cover what the zygote held."""
    open_to_sessions(_held)


def check(needs: dict[str, set[str]]) -> None:
    """In the zygote at start: `ClosedPython` if `needs` cannot be covered
    here (no CAP_SYS_ADMIN), found in a child forked for the trial (the
    zygote has no thread), whose namespace goes with it."""
    if not needs:
        return
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            open_to_sessions(needs)
        except BaseException as exc:
            os.write(w, str(exc).encode()[:4000])
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        why = f.read().decode("utf-8", "replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise ClosedPython(why or "the trial of covering the daemon's Python failed")


def open_to_sessions(needs: dict[str, set[str]]) -> None:
    """Cover each closed directory, deepest first (a cover made below is
    carried along by its parent's bind), in a new mount namespace."""
    if not needs:
        return
    _call(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)", next(iter(needs)))
    _call(_libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /", "/")
    for closed in sorted(needs, key=lambda p: len(Path(p).parts), reverse=True):
        held = {name: os.open(os.path.join(closed, name), os.O_PATH | os.O_CLOEXEC) for name in sorted(needs[closed])}
        try:
            _call(_libc.mount(b"tmpfs", os.fsencode(closed), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                              b"mode=0755,size=1m"), "mount a tmpfs over", closed)
            for name, fd in held.items():
                point = os.path.join(closed, name)
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.mkdir(point, 0o755)
                else:
                    os.close(os.open(point, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
                _call(_libc.mount(os.fsencode(f"/proc/self/fd/{fd}"), os.fsencode(point), None,
                                  _MS_BIND | _MS_REC, None), "bind-mount", point)
        finally:
            for fd in held.values():
                os.close(fd)


def _call(result: int, what: str, path: str) -> None:
    if result == 0:
        return
    err = ctypes.get_errno()
    mode = stat.S_IMODE(os.stat(path).st_mode)
    raise ClosedPython(
        f"the sessions' uids cannot read the daemon's Python: {path} is mode {mode:04o}, which they may not "
        f"search, and the zygote cannot open it to them ({what}: {os.strerror(err)}; it needs CAP_SYS_ADMIN). "
        f"Fix: let others search it (chmod o+x {path}), or run the daemon on a Python installed where "
        "every user can read it (/usr, /opt)")
