"""What surrounds the shipped unit on a host, for the tests that run the
daemon as systemd would (tests/harness.py `Daemon.run_as_unit` emulates
the service's own settings; this module, what systemd and the operator
give it besides):

- its socket, made as sessiond.socket says (`SocketUser=`, `SocketGroup=`,
  `SocketMode=`) and handed over in LISTEN_FDS/LISTEN_PID, the same
  listening socket across every restart of the daemon (`ActivatedSocket`);
- its `TasksMax=` and `MemoryMax=` as cgroup v1 `pids` and `memory` cgroups
  around the daemon, scaled down (`UnitCgroups`);
- install.sh's default config (`sessiond config default`);
- users in the socket's group, as `usermod -aG sessiond NAME` makes them:
  real passwd and group entries, since the daemon checks a stored owner by
  its passwd entry's groups (`SocketUsers`).

Every one of them is undone at the end.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from harness import REPO, Daemon, env_for_children, wait_for

SOCKET_UNIT = REPO / "systemd" / "sessiond.socket"


def unit_socket_settings(path: Path = SOCKET_UNIT) -> dict[str, str]:
    """The [Socket] section's settings (last value of each)."""
    out: dict[str, str] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if section == "Socket":
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


class ActivatedSocket:
    """The listening socket systemd keeps for the unit: bound at `path` with
    sessiond.socket's owner and mode (its `SocketGroup=` standing for
    `gid`: the group need not exist here by that name), and handed to each
    daemon started with `hand_to` as systemd hands it: fd 3, LISTEN_FDS=1,
    LISTEN_PID = the daemon's pid (which the harness's exec chain keeps)."""

    def __init__(self, path: Path, gid: int) -> None:
        unit = unit_socket_settings()
        self.path = path
        self.mode = int(unit.get("SocketMode", "0666"), 8)
        owner = unit.get("SocketUser", "root")
        uid = pwd.getpwnam(owner).pw_uid if not owner.isdigit() else int(owner)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chown(path, uid, gid)
        os.chmod(path, self.mode)
        self.sock.listen(128)
        self.gid = gid

    def hand_to(self, d: Daemon) -> None:
        """Start `d` (each time) with this socket as its fd 3."""
        fd = self.sock.fileno()
        move = "" if fd == 3 else f"exec 3<&{fd} {fd}<&-; "
        shim = ["bash", "-c", f'{move}export LISTEN_FDS=1 LISTEN_PID=$$; exec "$@"', "bash"]
        if d.cmd_prefix[:2] != ["bash", "-c"]:
            d.cmd_prefix = [*shim, *d.cmd_prefix]
        d.pass_fds = (fd,)
        d.held.append(self)  # open for as long as the daemon may start again

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def default_config() -> str:
    """What install.sh writes when there is no config: `sessiond config default`."""
    done = subprocess.run([sys.executable, "-m", "supervisor.cli", "config", "default"], capture_output=True,
                          text=True, env=env_for_children(), timeout=60, check=True)
    return done.stdout


class UnitCgroups:
    """The unit's `TasksMax=` and `MemoryMax=` (scaled to `tasks` and
    `memory_mb`) as cgroup v1 pids and memory cgroups of their own, below
    this process's cgroup in each hierarchy; the daemon joins both before
    it execs (`enter`, a preexec_fn)."""

    def __init__(self, tasks: int | None = None, memory_mb: int | None = None) -> None:
        name = f"sd-unit-{os.getpid()}-{time.monotonic_ns()}"
        self.dirs: dict[str, Path] = {}
        for ctrl, limits in (("pids", {"pids.max": tasks}), ("memory", {"memory.limit_in_bytes": memory_mb})):
            value = next(iter(limits.values()))
            if value is None:
                continue
            here = _own_v1(ctrl) / name
            here.mkdir()
            self.dirs[ctrl] = here
            key = next(iter(limits))
            (here / key).write_text(str(value << 20 if ctrl == "memory" else value))
        self.tasks, self.memory_mb = tasks, memory_mb

    def enter(self) -> None:
        """In the daemon's process, before its exec."""
        for d in self.dirs.values():
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        d = self.dirs.get("pids") or self.dirs.get("memory")
        if d is None:
            return []
        out: list[int] = []
        for procs in d.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                out += [int(p) for p in procs.read_text().split()]
        return out

    def full(self) -> bool:
        """The task table at TasksMax with nothing on its way out (an exited
        task is counted until it is reaped)."""
        d = self.dirs["pids"]
        current = int((d / "pids.current").read_text())
        listed = sum(len((t / "tasks").read_text().split()) for t in [d, *(p for p in d.rglob("*") if p.is_dir())])
        return current == listed == self.tasks

    def close(self) -> None:
        """Kill what is left in them, then remove them bottom up."""
        def empty() -> bool:
            left = self.pids()
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return not left

        for d in self.dirs.values():
            with contextlib.suppress(OSError):
                (d / "memory.oom_control").write_text("0")  # a held process must be free to die
            for sub in d.rglob("memory.oom_control"):
                with contextlib.suppress(OSError):
                    sub.write_text("0")
        wait_for(empty, 10, "the unit's cgroups to empty")
        for d in self.dirs.values():
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                d.rmdir()


def _own_v1(ctrl: str) -> Path:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if ctrl in ctrls.split(","):
                return Path("/sys/fs/cgroup", ctrl) / path.lstrip("/")
    raise AssertionError(f"no cgroup v1 {ctrl} hierarchy here")


class SocketUsers:
    """A group standing for `sessiond` and users in it, as an operator
    makes them (`usermod -aG sessiond NAME`; one has it as its primary
    group instead): real entries in /etc/group and /etc/passwd."""

    def __init__(self, count: int = 2) -> None:
        missing = [t for t in ("groupadd", "useradd", "userdel", "groupdel") if shutil.which(t) is None]
        assert not missing, f"{', '.join(missing)} missing: install passwd (make system-deps)"
        tag = f"{os.getpid() % 100000}"
        self.group = f"sdt{tag}g"
        self.names: list[str] = []
        _run("groupadd", "--system", self.group)
        try:
            import grp

            self.gid = grp.getgrnam(self.group).gr_gid
            for i in range(count):
                name = f"sdt{tag}u{i}"
                # The first has the group as a supplementary group, the next as its primary one.
                how = ["-G", self.group] if i % 2 == 0 else ["-g", self.group]
                _run("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                     *(["--no-user-group"] if i % 2 == 0 else []), *how, name)
                self.names.append(name)
        except BaseException:
            self.close()
            raise
        self.uids = [pwd.getpwnam(n).pw_uid for n in self.names]

    def close(self) -> None:
        for name in self.names:
            _run("userdel", name, check=False)
        _run("groupdel", self.group, check=False)


def _run(*argv: str, check: bool = True) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: {done.stderr.strip()}")


@contextlib.contextmanager
def socket_users(count: int = 2) -> Iterator[SocketUsers]:
    users = SocketUsers(count)
    try:
        yield users
    finally:
        users.close()
