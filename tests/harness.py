"""Run a real sessiond as a child process for tests.

The daemon runs in its own session (process group); teardown kills that
group and then checks that every process the daemon had made (zygote,
workers, tools) is gone, so a test that leaks processes fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import tomli_w

from supervisor.ctl.client import Client

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
SERVICE = REPO / "systemd" / "sessiond.service"


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy, or fail."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def env_for_children() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("NOTIFY_SOCKET", None)
    env.pop("LISTEN_FDS", None)
    env.pop("LISTEN_PID", None)
    return env


TEST_HANDLERS = ["agent", "echo", "fixture_handlers:*"]


def trusting(config: str) -> str:
    """`config` as the tests' operator would write it: the fixture handlers
    allowed, and as root (unless the test says who workers run as) tools
    run as root, since they import fixture code from a checkout that the
    per-session uids cannot read.  Tests of those defaults pass trust=False."""
    data = tomllib.loads(config)
    data.setdefault("agent", {}).setdefault("allowed_handlers", TEST_HANDLERS)
    daemon = data.setdefault("daemon", {})
    if os.geteuid() == 0 and not {"worker_user", "session_uid_range"} & set(daemon):
        daemon.setdefault("allow_root_tools", True)
    return tomli_w.dumps(data)


# A daemon that notices quickly: heartbeats, restarts, the memory sweep, stops.
FAST_SWEEP = """
[agent.worker]
heartbeat_interval_secs = 0.2
restart_backoff_initial_ms = 20
[agent.limits]
memory_poll_interval_ms = 50
[daemon]
stop_grace_secs = 1.0
"""


# Every Daemon made in this process, in order: tests/conftest.py puts the
# log of each one a failed test made into its report.
MADE: list[Daemon] = []


class Daemon:
    def __init__(
        self, root: Path, config: str = "", extra_args: list[str] | None = None, trust: bool = True
    ) -> None:
        MADE.append(self)
        self.root = root
        # Unix socket paths are short (108 bytes): keep it out of pytest's long tmp path.
        self.sockdir = Path(tempfile.mkdtemp(prefix="sd-"))
        self.socket = self.sockdir / "sessiond.sock"
        self.state_dir = root / "state"
        self.config_path = root / "config.toml"
        root.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(trusting(config) if trust else config)
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = root / "sessiond.log"
        self.known_pids: set[int] = set()
        self.preexec: Callable[[], None] | None = None
        # Put before `cmd` when starting (e.g. `run_as_user`'s wrapper).
        self.cmd_prefix: list[str] = []
        # Descriptors the daemon inherits (as from a careless parent, or
        # systemd's listening socket: tests/unit_host.py, kept open here).
        self.pass_fds: tuple[int, ...] = ()
        self.held: list[Any] = []
        self._exposed: list[Path] = []

    @property
    def cmd(self) -> list[str]:
        return [
            sys.executable, "-m", "supervisor.cli", "run", "--config", str(self.config_path),
            "--socket", str(self.socket), "--state-dir", str(self.state_dir), *self.extra_args,
        ]

    def start(self, timeout: float = 15.0) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*self.cmd_prefix, *self.cmd], stdout=log, stderr=subprocess.STDOUT, env=env_for_children(),
            start_new_session=True, cwd=str(self.root), preexec_fn=self.preexec, pass_fds=self.pass_fds,
        )
        log.close()
        wait_for(self._answers, timeout, f"sessiond to listen (log: {self.log})")
        self.known_pids.add(self.proc.pid)

    def run_as_user(self, uid: int, gid: int) -> None:
        """Start the daemon as `uid`:`gid` (from root) instead of as root.

        The daemon's directories are handed to that user.  The interpreter,
        the venv and this checkout may live where the user cannot reach them
        (pyenv under a 0700 /root, a clone in a 0700 mktemp dir): the daemon
        then runs in its own mount namespace where each closed directory on
        those paths is covered by a 0755 directory holding bind mounts of
        just the children it needs; nothing changes for the rest of the
        machine.  (Listable, not just 0711: the checkout itself is on
        sys.path, through the install's .pth line, and Python's path finder
        lists a directory on sys.path to find a module in it.)"""
        for path in (self.root, self.sockdir):
            os.chown(path, uid, gid)
        mounts = ""
        for closed, cover, children in self._covers():
            for child in children:
                mounts += f"mount --rbind {closed / child} {cover / child} && "
            mounts += f"mount --rbind {cover} {closed} && "
        self.cmd_prefix = [
            "unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'{mounts}exec setpriv --reuid={uid} --regid={gid} --clear-groups -- "$@"', "sh",
        ]

    def _covers(self) -> list[tuple[Path, Path, list[str]]]:
        """(closed directory, its 0755 cover, the children to bind into it)
        for each directory on the way to the interpreter, the venv and the
        checkout that others cannot search; deepest first, so that a cover
        made below is carried along when its parent is covered in turn."""
        needs: dict[Path, set[str]] = {}
        code = {"supervisor", "session_worker", "ipc", "tests"}
        for target, children in ((Path(sys.base_prefix).resolve(), set()),
                                 (Path(sys.prefix).resolve(), set()), (REPO, code)):
            chain = [*reversed(target.parents), target]
            for here, below in zip(chain, [*chain[1:], None]):
                if os.stat(here).st_mode & 0o001:
                    continue
                needs.setdefault(here, set()).update({below.name} if below is not None else children)
        out = []
        for closed in sorted(needs, key=lambda p: len(p.parts), reverse=True):
            cover = Path(tempfile.mkdtemp(prefix="sd-expose-"))
            os.chmod(cover, 0o755)
            self._exposed.append(cover)
            for child in sorted(needs[closed]):
                (cover / child).mkdir()
            out.append((closed, cover, sorted(needs[closed])))
        return out

    def run_as_unit(self, service: Path = SERVICE, visible: tuple[Path, ...] = (),
                    drop: tuple[str, ...] = (), user: str | None = None) -> UnitEmulation:
        """Start the daemon as systemd would start it from `service` (the
        shipped unit by default), as closely as this machine allows without
        systemd as PID 1: as the unit's user (root when it names none),
        under `setpriv` with the unit's capability bounding set, inheritable
        and ambient sets cleared and no_new_privs, with its umask, in a mount
        namespace of its own where /proc is a new instance mounted with
        ProtectProc='s hidepid=, the system is read-only except the daemon's
        root and socket directory and /sys/fs/cgroup (ProtectSystem=strict,
        ProtectKernelTunables=, ProtectControlGroups=no), /tmp and /var/tmp
        are private tmpfs (PrivateTmp=), and its SystemCallFilter=,
        SystemCallErrorNumber=, RestrictNamespaces= and
        RestrictAddressFamilies= are one seccomp filter loaded with
        libseccomp right before the daemon's exec, as systemd loads them (so
        bubblewrap in the sessions runs under them).  `visible` are paths from
        the real /tmp that must stay in view (read-only), such as a
        PostgreSQL server's socket directory, which would live in /run.
        What could not be emulated is in the returned `not_emulated`.
        `drop`: capabilities to take out of the unit's set (to show each
        one it keeps is needed); `user`: who stands in for the unit's
        User= (a unit's system user need not exist here).  A unit that is
        not root gets the daemon's directories; every unit, as `run_as_user`
        does, covers for the closed directories on the way to its code."""
        unit = UnitEmulation.from_file(service)
        unit.capabilities = [c for c in unit.capabilities if c not in drop]
        if user is not None:
            unit.user = user
        keep_rw = [self.root, self.sockdir]
        # The code the daemon runs stays in view when it lives in a private
        # /tmp (a clean clone in a mktemp directory, as CI makes).
        code = [REPO, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
                *(Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.isdir(p))]
        seen: list[Path] = []
        for path in [*code, *visible]:
            if not any(path == s or s in path.parents for s in seen):
                seen.append(path)
        spec = unit.launch_spec([str(p) for p in keep_rw], [str(p) for p in seen])
        # The unit's user and its sessions' uids read the code, as they read
        # install.sh's /opt/sessiond (which refuses a Python under /root):
        # the closed directories on the way to it are covered.  (Without
        # CAP_SYS_ADMIN the daemon could not open them itself, and refuses.)
        spec["covers"] = [[str(closed), str(cover), children] for closed, cover, children in self._covers()]
        if unit.user not in ("root", "0"):
            import pwd

            pw = pwd.getpwnam(unit.user)
            spec["ids"] = [pw.pw_uid, pw.pw_gid]
            for path in keep_rw:
                os.chown(path, pw.pw_uid, pw.pw_gid)
        self.cmd_prefix = [sys.executable, "-c", "import harness, sys; harness.enter_unit(sys.argv[1:])",
                           json.dumps(spec), "--"]
        return unit

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"sessiond exited with {self.proc.returncode}:\n{self.log}")
        try:
            with Client(self.socket) as c:
                c.ping()
            return True
        except OSError:
            return False

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def workspace(self, session_id: str) -> Path:
        """The session's workspace: workspaces/ID@TOKEN (a new TOKEN for
        every session that reuses an id).  Seen as the daemon sees it: a
        daemon in a mount namespace of its own (the unit's emulation) has
        its workspace images mounted there only, so the path goes through
        its /proc/PID/root while it runs."""
        found = list((self.state_dir / "workspaces").glob(f"{session_id}@*"))
        assert len(found) == 1, f"workspaces of {session_id}: {found}"
        if self.proc is not None and self.proc.poll() is None:
            theirs = Path(f"/proc/{self.pid}/root{found[0]}")
            with contextlib.suppress(OSError):
                if os.path.ismount(theirs) and not os.path.ismount(found[0]):
                    return theirs
        return found[0]

    def client(self) -> Client:
        return Client(self.socket)

    def ctl(self, *args: str, input: str | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "supervisor.ctl", "--socket", str(self.socket), *args],
            capture_output=True, text=True, env=env_for_children(), timeout=timeout, input=input,
        )

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.pid).children(recursive=True)
        return []

    def remember_processes(self) -> None:
        self.known_pids.update(p.pid for p in self.descendants())

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait: the graceful path."""
        assert self.proc is not None
        self.remember_processes()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the daemon alone (not its group): its children must die by themselves."""
        assert self.proc is not None
        self.remember_processes()
        self.proc.kill()
        self.proc.wait(10)

    def assert_no_leftovers(self, timeout: float = 5.0) -> None:
        def gone() -> bool:
            return not [p for p in self.known_pids if _alive(p)]
        wait_for(gone, timeout, f"processes {sorted(p for p in self.known_pids if _alive(p))} to exit")

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.remember_processes()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in self.known_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        self.remove_temp_dirs()
        self.unmount_workspaces()

    def remove_temp_dirs(self) -> None:
        """The socket's directory and the covers `run_as_user` made, in the
        temp dir (the rest is under the test's own root); also for a Daemon
        a test never started or cleaned up (tests/conftest.py, at the end
        of the run).  The covers' bind mounts were made in the daemon's
        mount namespace: here they are plain directories."""
        for path in (self.sockdir, *self._exposed):
            shutil.rmtree(path, ignore_errors=True)

    def unmount_workspaces(self) -> None:
        """The workspace images a SIGKILLed daemon left mounted (one outside
        a mount namespace of its own: not the unit's emulation), unmounted
        lazily: their loop devices detach themselves (autoclear)."""
        roots = [str(self.root), str(self.state_dir)]
        with contextlib.suppress(OSError, tomllib.TOMLDecodeError):
            base = tomllib.loads(self.config_path.read_text()).get("tools", {}).get("workspace_dir")
            if base:
                roots.append(str(base))
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f if " - ext4 /dev/loop" in line]
        for point in reversed(points):
            if any(point.startswith(r.rstrip("/") + "/") for r in roots):
                subprocess.run(["umount", "--lazy", point], check=False, capture_output=True)


def _alive(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_as(uid: int, fn: Callable[[], Any], groups: tuple[int, ...] = ()) -> Any:
    """Fork, become `uid` (primary gid = uid, plus `groups`), run `fn`,
    return what it returned (msgpack-able)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user
        code = 1
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, msgspec.msgpack.encode(fn()))
            code = 0
        except BaseException as exc:
            os.write(2, f"run_as({uid}) failed: {exc!r}\n".encode())
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the other user's client failed (see stderr)"
    return msgspec.msgpack.decode(data)


def raw_connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


@contextlib.contextmanager
def running_daemon(root: Path, config: str = "") -> Iterator[Daemon]:
    d = Daemon(root, config)
    try:
        d.start()
        yield d
    finally:
        d.cleanup()


# ---------------------------------------------------------------- the unit, emulated

def unit_service_settings(path: Path = SERVICE) -> dict[str, list[str]]:
    """[Service] of a unit file: key -> its values in order (keys repeat;
    an empty assignment resets the list, as systemd reads it)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        if section != "Service":
            continue
        key, _, value = line.partition("=")
        values = out.setdefault(key.strip(), [])
        if value.strip():
            values.append(value.strip())
        else:
            values.clear()
    return out


_YES = ("yes", "true", "on", "1")


class UnitEmulation:
    """What of a unit file the harness reproduces, read from the file so the
    tests follow it."""

    def __init__(self, settings: dict[str, list[str]]) -> None:
        self.settings = settings

        def last(key: str, default: str = "") -> str:
            return settings.get(key, [default])[-1] if settings.get(key) else default

        self.user = last("User", "root")
        caps: list[str] = []
        for value in settings.get("CapabilityBoundingSet", []):
            assert not value.startswith("~"), "a deny-list bounding set is not emulated"
            caps += value.split()
        self.capabilities = caps
        self.no_new_privs = last("NoNewPrivileges").lower() in _YES
        self.protect_proc = last("ProtectProc", "default")
        self.protect_system = last("ProtectSystem", "no")
        self.private_tmp = last("PrivateTmp").lower() in _YES
        self.umask = int(last("UMask", "0022"), 8)
        self.ambient = " ".join(settings.get("AmbientCapabilities", []))
        self.seccomp = _seccomp_spec(settings)
        self.not_emulated = {
            key: "needs systemd as PID 1 (device cgroup, namespaces and mounts of its own, limits)"
            for key in ("PrivateDevices", "DevicePolicy", "ProtectClock", "ProtectHostname",
                        "ProtectKernelModules", "ProtectKernelLogs", "RestrictRealtime",
                        "RestrictSUIDSGID", "LockPersonality", "SystemCallArchitectures",
                        "MemoryMax", "TasksMax", "Delegate")
            if key in settings
        }
        for key in ("MemoryMax", "TasksMax"):
            if key in self.not_emulated:
                self.not_emulated[key] = "scaled down as cgroups around the daemon where a test asks (tests/unit_host.py)"
        if last("ProtectHome").lower() in _YES + ("read-only", "tmpfs"):
            self.not_emulated["ProtectHome"] = (
                "the test interpreter may live under /root (pyenv); install.sh refuses one there")

    @classmethod
    def from_file(cls, path: Path = SERVICE) -> UnitEmulation:
        return cls(unit_service_settings(path))

    def launch_spec(self, keep_rw: list[str], visible: list[str]) -> dict[str, Any]:
        assert not self.ambient, "AmbientCapabilities= is not emulated"
        return {
            "user": self.user, "caps": self.capabilities, "nnp": self.no_new_privs,
            "hidepid": {"invisible": "invisible", "noaccess": "noaccess", "ptraceable": "ptraceable"}.get(
                self.protect_proc, ""),
            "strict": self.protect_system == "strict", "private_tmp": self.private_tmp,
            "umask": self.umask, "rw": keep_rw, "visible": visible, "seccomp": self.seccomp,
        }

    def describe(self) -> str:
        caps = " ".join(c.lower().removeprefix("cap_") for c in self.capabilities) or "none"
        return (f"user={self.user} caps=[{caps}] nnp={self.no_new_privs} ProtectProc={self.protect_proc} "
                f"ProtectSystem={self.protect_system} PrivateTmp={self.private_tmp} "
                f"seccomp={'SystemCallFilter+RestrictNamespaces+RestrictAddressFamilies' if self.seccomp else 'none'}"
                "; not emulated: "
                + ", ".join(sorted(self.not_emulated)))


def _syscall_groups() -> dict[str, list[str]]:
    """systemd's @groups and their members, as `systemd-analyze syscall-filter` lists them."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif not line.startswith(" "):
            current = None
        elif current is not None and line.strip() and not line.strip().startswith("#"):
            current.append(line.strip())
    return groups


def _expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for name in names:
        out |= _expand(groups[name], groups) if name.startswith("@") else {name}
    return out


_NAMESPACE_FLAGS = {"cgroup": 0x02000000, "ipc": 0x08000000, "net": 0x40000000, "mnt": 0x00020000,
                    "pid": 0x20000000, "user": 0x10000000, "uts": 0x04000000, "time": 0x00000080}
_ERRNO_NAMES = {"EPERM": 1, "EACCES": 13, "ENOSYS": 38}


def _seccomp_spec(settings: dict[str, list[str]]) -> dict[str, Any]:
    """The unit's SystemCallFilter=, SystemCallErrorNumber=,
    RestrictNamespaces= and RestrictAddressFamilies= as one seccomp filter
    for the launcher (systemd's own semantics: the first list decides allow
    or deny, later `~` lists take away, later plain lists add)."""
    spec: dict[str, Any] = {}
    lines = settings.get("SystemCallFilter", [])
    if lines:
        groups = _syscall_groups()
        allow: set[str] | None = None
        deny: set[str] = set()
        for line in lines:
            negate = line.startswith("~")
            names = _expand(line.lstrip("~").split(), groups)
            if allow is None and not negate:
                allow = names | _expand(["@default"], groups)
            elif allow is None:
                deny |= names
            elif negate:
                allow -= names
            else:
                allow |= names
        spec["allow"] = sorted(allow) if allow is not None else None
        spec["deny"] = sorted(deny)
        errno_name = (settings.get("SystemCallErrorNumber") or ["EPERM"])[-1]
        spec["errno"] = _ERRNO_NAMES.get(errno_name, 1)
    restrict = (settings.get("RestrictNamespaces") or [""])[-1]
    if restrict:
        allowed = {"yes": set(), "true": set(), "no": set(_NAMESPACE_FLAGS), "false": set(_NAMESPACE_FLAGS)}.get(
            restrict, set(restrict.lstrip("~").split()))
        if restrict.startswith("~"):
            allowed = set(_NAMESPACE_FLAGS) - allowed
        spec["forbidden_ns"] = sum(f for n, f in _NAMESPACE_FLAGS.items() if n not in allowed)
    families = settings.get("RestrictAddressFamilies", [])
    if families:
        assert not families[0].startswith("~"), "a deny-list of families is not emulated"
        spec["families"] = sorted({getattr(socket, f) for line in families for f in line.split()})
    return spec


def _load_seccomp(spec: dict[str, Any]) -> None:
    """Build and load the filter with libseccomp (what systemd does)."""
    if not spec:
        return
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]

    class Cmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]

    allow_act, masked_eq, eq = 0x7FFF0000, 7, 4

    def errno_act(n: int) -> int:
        return 0x00050000 | (n & 0xFFFF)

    errno = spec.get("errno", 1)
    default = errno_act(errno) if spec.get("allow") is not None else allow_act
    ctx = ctypes.c_void_p(lib.seccomp_init(default))
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(Cmp)]

    def rule(action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return  # not a syscall of this architecture
        arr = (Cmp * max(1, len(cmps)))(*[Cmp(*c) for c in cmps])
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
        if rc != 0:
            raise OSError(-rc, f"seccomp rule for {name}")

    special = {"socket", "unshare", "clone", "clone3", "setns"}
    allow = spec.get("allow")
    if allow is not None:
        for name in allow:
            if name not in special:
                rule(allow_act, name)
    for name in spec.get("deny", []):
        rule(errno_act(errno), name)

    def allowed(name: str) -> bool:
        return allow is None or name in allow

    forbidden = spec.get("forbidden_ns")
    for name, arg in (("unshare", 0), ("clone", 0), ("setns", 1)):
        if not allowed(name):
            continue
        if forbidden is None:
            if allow is not None:
                rule(allow_act, name)
            continue
        if allow is not None:  # allowed only without a forbidden namespace flag
            rule(allow_act, name, (arg, masked_eq, forbidden, 0))
        else:  # refused with any of them
            for flag in [1 << i for i in range(32) if forbidden & (1 << i)]:
                rule(errno_act(1), name, (arg, masked_eq, flag, flag))
    if allowed("clone3"):
        # As systemd: clone3's flags are out of a filter's reach; glibc falls back to clone.
        rule(errno_act(38) if forbidden is not None else allow_act, "clone3")
    if allowed("socket"):
        families = spec.get("families")
        if families is None:
            if allow is not None:
                rule(allow_act, "socket")
        elif allow is not None:
            for family in families:
                rule(allow_act, "socket", (0, eq, family, 0))
    if lib.seccomp_load(ctx) != 0:
        raise OSError(ctypes.get_errno(), "seccomp_load")
    lib.seccomp_release(ctx)


_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MOUNT_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "noatime": _MS_NOATIME,
                "nodiratime": _MS_NODIRATIME, "relatime": _MS_RELATIME}


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    enc = lambda v: v.encode() if v is not None else None  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} {target} ({fstype}, {flags:#x}): {os.strerror(err)}")


def _mountpoints() -> list[tuple[str, int]]:
    """(mount point, its per-mount flags) from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            flags = 0
            for opt in fields[5].split(","):
                flags |= _MOUNT_FLAGS.get(opt, 0)
            out.append((point, flags))
    return out


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def enter_unit(argv: list[str]) -> None:
    """The launcher `Daemon.run_as_unit` puts before the daemon's command:
    `python -c ... SPEC -- CMD...`.  Builds the unit's mount namespace, then
    execs setpriv with its credentials and capabilities."""
    spec = json.loads(argv[0])
    assert argv[1] == "--"
    cmd = argv[2:]
    os.umask(spec["umask"])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS (os.unshare is 3.12+)
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    keep = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in [*spec["rw"], *spec["visible"]]}
    for closed, cover, children in spec.get("covers", []):
        for child in children:
            _mount(f"{closed}/{child}", f"{cover}/{child}", None, _MS_BIND | _MS_REC)
        _mount(cover, closed, None, _MS_BIND | _MS_REC)
    # Their ancestors' owners and modes, to rebuild them in a private /tmp.
    ancestors = {str(a): os.stat(a) for p in keep for a in Path(p).parents}
    if spec["strict"]:
        # ProtectSystem=strict: every mount read-only but the API file
        # systems; ProtectKernelTunables=: /sys too, but not the cgroup
        # hierarchies under it (ProtectControlGroups=no).
        for point, flags in _mountpoints():
            if _under(point, "/proc") or _under(point, "/dev"):
                continue
            if _under(point, "/sys/fs/cgroup") and point != "/sys/fs/cgroup":
                continue
            with contextlib.suppress(OSError):  # a mount hidden under another one
                _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
    tmps = ("/tmp", "/var/tmp") if spec["private_tmp"] else ()
    for tmp in tmps:
        _mount("tmpfs", tmp, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777")
    for path, fd in keep.items():
        rw = path in spec["rw"]
        if any(_under(path, t) for t in tmps):
            for a in [*reversed(Path(path).parents), Path(path)]:
                if not a.exists():
                    st = ancestors.get(str(a)) or os.stat(f"/proc/self/fd/{fd}")
                    os.mkdir(a)
                    os.chown(a, st.st_uid, st.st_gid)
                    os.chmod(a, st.st_mode & 0o7777)
        elif not rw:
            continue  # still in view where it was
        _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        _mount(None, path, None, _MS_REMOUNT | _MS_BIND | (0 if rw else _MS_RDONLY))
        os.close(fd)
    if spec["hidepid"]:
        # ProtectProc=: a new instance of procfs, as systemd mounts it.
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, f"hidepid={spec['hidepid']}")
    caps = ",".join(["-all", *(f"+{c.lower().removeprefix('cap_')}" for c in spec["caps"])])
    setpriv = ["setpriv", f"--bounding-set={caps}", "--inh-caps=-all", "--ambient-caps=-all"]
    if spec["nnp"]:
        setpriv.append("--no-new-privs")
    if spec.get("ids"):
        setpriv += [f"--reuid={spec['ids'][0]}", f"--regid={spec['ids'][1]}", "--clear-groups"]
    if spec["seccomp"]:
        # Last, as systemd does: after the change of user and capabilities,
        # right before the daemon's exec (one more stage: setpriv cannot).
        cmd = [sys.executable, "-c", "import harness, sys; harness.enter_filter(sys.argv[1:])",
               json.dumps(spec["seccomp"]), "--", *cmd]
    os.execvp("setpriv", [*setpriv, "--", *cmd])


def enter_filter(argv: list[str]) -> None:
    """`python -c ... FILTER -- CMD...`: load the unit's seccomp filter, exec CMD."""
    assert argv[1] == "--"
    _load_seccomp(json.loads(argv[0]))
    os.execvp(argv[2], argv[2:])
