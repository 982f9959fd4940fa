"""What a session's uid leaves in the host's IPC namespace, removed when its
worker ends: systemd's RemoveIPC= for one session.  Runs in the daemon, on
its loop, at each worker's end (`supervisor.core.workspaces`): three small
reads of /proc/sysvipc and a listing of /dev/shm when nothing is left (the
usual case); a process only when something is.

Where a session's worker or its tools have an IPC namespace of their own
(session_worker.worker.main._confine, bubblewrap, the tool host's user namespace)
their SysV objects go with the namespace and nothing of them is here.
Where they have none (a root daemon without CAP_SYS_ADMIN, with
`namespaces = "off"`), what the session made in the host's namespace is
found by its owner or creator uid, which is the session's own (a root
daemon's `session_uid_range`): nothing else runs as it.  POSIX shared
memory (/dev/shm) and message queues (/dev/mqueue, where it is mounted)
are files of that uid, removed likewise.  A uid that sessions share
(`worker_user`, an unprivileged daemon's own) tells nothing about which
session made an object: never called for one.

The SysV objects are removed by `ipcrm` run as the session's uid (an
object's owner or creator may remove it; the daemon's root needs
CAP_SYS_ADMIN for others' objects, which is exactly what it lacks when this
is needed): the daemon keeps CAP_SETUID for its workers anyway.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess

__all__ = ["left_by", "remove", "userns_ipc"]

_KINDS = (("shm", "shmid", "-m"), ("sem", "semid", "-s"), ("msg", "msqid", "-q"))
_POSIX_DIRS = ("/dev/shm", "/dev/mqueue")
_IPCRM_TIMEOUT_SECS = 10.0


def left_by(uid: int) -> list[tuple[str, int]]:
    """The SysV objects of the host's namespace that `uid` owns or created:
    (ipcrm's flag, id)."""
    found = []
    for kind, id_column, flag in _KINDS:
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header = f.readline().split()
                at = {name: header.index(name) for name in (id_column, "uid", "cuid")}
                for line in f:
                    row = line.split()
                    with contextlib.suppress(ValueError, IndexError):
                        if uid in (int(row[at["uid"]]), int(row[at["cuid"]])):
                            found.append((flag, int(row[at[id_column]])))
        except (OSError, ValueError):
            continue
    return found


def _posix_files(uid: int) -> list[str]:
    found = []
    for directory in _POSIX_DIRS:
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_uid == uid and stat.S_ISREG(st.st_mode):
                        found.append(entry.path)
    return found


def remove(uid: int) -> str:
    """Remove what `uid` left (SysV objects, /dev/shm and /dev/mqueue
    files); '' when nothing was left or all of it went, else what stayed."""
    problems = []
    for path in _posix_files(uid):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror}")
    objects = left_by(uid)
    if not objects:
        return "; ".join(problems)
    ipcrm = shutil.which("ipcrm")
    if ipcrm is None:
        return "; ".join([*problems, f"{len(objects)} SysV IPC object(s): ipcrm is not installed (util-linux)"])
    argv = [ipcrm]
    for flag, ident in objects:
        argv += [flag, str(ident)]
    try:
        subprocess.run(argv, capture_output=True, timeout=_IPCRM_TIMEOUT_SECS, check=False, cwd="/",
                       user=uid, group=uid, extra_groups=[], env={"LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError) as exc:
        problems.append(f"ipcrm as uid {uid}: {exc}")
    left = left_by(uid)
    if left:
        problems.append(f"{len(left)} SysV IPC object(s) of uid {uid} remain")
    return "; ".join(problems)


def userns_ipc() -> str:
    """'' when an unprivileged process here may make a user namespace and
    an IPC namespace in it (what the tool host does without bubblewrap),
    else why not; found by trying, once at start."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "unshare(1) is not installed to check (util-linux)"
    try:
        done = subprocess.run([unshare, "--user", "--ipc", "true"], capture_output=True, text=True,
                              timeout=_IPCRM_TIMEOUT_SECS, check=False, cwd="/")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unshare did not run: {exc}"
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return ""
