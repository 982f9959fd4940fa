"""A session's sandbox, seen from its worker: the tool host and what confines it.

Every process a session's tools start descends from one tool host
(`session_worker/toolhost/host.py`), started at the session's first tool call and
kept until the worker exits.  Isolation is per session, not per command:
commands share the session's /tmp and can see each other, never anything
else.  What confines the host, and so every tool:

- with namespaces (bubblewrap works for this uid; probed by the daemon at
  start): its own mount namespace holding a read-only system, the workspace
  and a private /tmp (tmpfs) and nothing of the daemon; its own PID, IPC and,
  unless `network = "full"`, network namespaces; when the worker dies the
  namespace's init dies and the kernel kills every process in it;
- an IPC namespace of the session's own in every mode where one can be
  made: a root worker makes it before it drops to its uid, else (without
  bubblewrap) the tool host in a user namespace of its own; SysV shared
  memory, semaphores and message queues go with the session;
- always (where the kernel has it): `no_new_privs`, a Landlock domain (the
  same paths, read-only or read-write; TCP refused under `none`; signals and
  abstract sockets scoped), the seccomp filter of `session_worker.worker._seccomp`,
  RLIMIT_NPROC, umask 077.  Without namespaces, tools still see only these
  paths (Landlock), /tmp is `<workspace>/.tmp`, /proc shows only system-wide
  files, no Unix socket can be made (seccomp: Landlock does not cover
  connect() to a socket's path), and a tool that daemonizes stays below the
  host (the subreaper) or, once the host is gone, is killed by the zygote.

Fail closed: where the settings ask for a mechanism this host cannot give
(namespaces unless `namespaces = "off"`, Landlock, seccomp), no tool host
starts and every tool call fails saying what is missing and what to set.
A tool starts with descriptors 0, 1 and 2 only, on every path (`_spawn`).

The worker itself stays outside the sandbox: it holds the provider's key and
makes the provider's requests; tools never see its environment, its memory
(non-dumpable, and another domain) or its /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ipc import messages as m
from ipc.logfields import escape
from ipc.settings import SessionSettings
from session_worker.worker import _seccomp, _spawn
from session_worker.errors import CommandError, OrderNotSent, SandboxError

__all__ = ["HostCommand", "Plan", "ToolHost", "configure", "current"]

log = logging.getLogger("sessiond.sandbox")

# The tool host's source (session_worker/toolhost/: the standard library only).
_HOST_SOURCE = (Path(__file__).parent.parent / "toolhost" / "host.py").read_text()
# What the tool host is started with (`python -I -S -c _HOST_BOOT FD`): it
# reads its source and its config as the first two messages on its socket
# and runs them.  Not the source itself on the command line: ~19 KB of
# argv, shown by `ps` for the host and for bubblewrap above it.
_HOST_BOOT = ("import socket,sys;s=socket.socket(fileno=int(sys.argv[1]));src=s.recv(1<<20);"
              "cfg=s.recv(1<<20);sys.argv=['sessiond-toolhost',cfg.decode(),str(s.detach())];"
              "exec(compile(src,'sessiond-toolhost','exec'),{'__name__':'__main__'})")
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Never visible, whatever tree holds them.
_SECRETS = (
    "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers",
    "/etc/sudoers.d", "/etc/ssl/private", "/etc/credstore", "/etc/credstore.encrypted",
    "/etc/sessiond", "/etc/ssh/ssh_host_rsa_key", "/etc/ssh/ssh_host_ecdsa_key",
    "/etc/ssh/ssh_host_ed25519_key",
)
# Where the host keeps its Unix sockets (PostgreSQL's, Ray's, D-Bus's, the
# daemon's own, anyone's in /tmp): masked inside any tree a sandbox is
# given (a read path of "/var", say), since a read-only bind still lets a
# tool connect() to a socket in it.  The sandbox's own /tmp is its tmpfs.
_SOCKET_DIRS = ("/run", "/var/run", "/var/lock", "/tmp", "/var/tmp", "/var/lib", "/dev/shm")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# Without a PID namespace, /proc/<pid> of the daemon and of other sessions
# would be in view: tools get only these system-wide files.
_PROC_INFO = (
    "/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/loadavg", "/proc/uptime",
    "/proc/version", "/proc/filesystems", "/proc/sys",
)
_START_TIMEOUT_SECS = 10.0
# A fork refused for want of tasks or memory is tried again after these.
_FORK_RETRY_SECS = (0.05, 0.1, 0.2, 0.4)
# What of a tool host's stderr reaches the log, per session.  Tools cannot
# open it (the host is non-dumpable, bubblewrap's init too), but the host's
# own failures land there and bubblewrap's init holds the pipe: lines are
# escaped and their number capped; the rest are only counted.
_LOG_LINES = 64
_LOG_LINE_CHARS = 400
_EARLY_BYTES = 8192  # before the host is ready: the reason it did not start


@dataclass(frozen=True, slots=True)
class Plan:
    """How this session's tools are confined; built once at boot."""

    workspace: Path
    network: str
    namespaces: bool
    bwrap: str = ""
    why_no_namespaces: str = ""
    hide: tuple[str, ...] = ()
    read_paths: tuple[str, ...] = ()
    nproc: int | None = None
    tmp_size_mb: int = 256
    why_no_seccomp: str = ""  # empty: this machine has a syscall table
    landlock_abi: int = 0  # the kernel's, as the daemon found it (0: none)
    # Non-empty: the configured isolation cannot be built here, and tools
    # do not run (fail closed); says what is missing and what to set.
    why_refused: str = ""
    # Why the worker has no IPC namespace of its own ('' when it has one: a
    # root worker makes it before dropping to its uid, main._confine).
    why_no_ipc: str = "not asked"
    python: str = field(default_factory=lambda: host_python())

    @property
    def tmp(self) -> str:
        return "/tmp" if self.namespaces else str(self.workspace / ".tmp")

    @property
    def effective_network(self) -> str:
        # A loopback of the session's own needs a network namespace.
        return "none" if self.network == "loopback" and not self.namespaces else self.network

    @property
    def socket_families(self) -> list[str]:
        """What socket(2) may create, an allow-list (`_seccomp`).  Without a
        mount namespace no Unix socket: Landlock (ABI 7 and before) does not
        cover connect() to a socket's path, so the store's, the control
        socket's or any other on the host would be in reach."""
        unix = ["unix"] if self.namespaces else []
        return unix + ([] if self.effective_network == "none" else ["inet", "inet6"])

    def roots(self) -> list[str]:
        """Read-only trees: the system, the interpreter, the operator's extras."""
        roots = list(_SYSTEM)
        prefix = sys.base_prefix if self.python == _own_python() else os.path.dirname(self.python)
        for extra in (prefix, os.path.dirname(self.python), *self.read_paths):
            if not any(_within(extra, r) for r in roots):
                roots.append(extra)
        return roots

    def hidden(self) -> list[str]:
        return [*_SECRETS, *_SOCKET_DIRS, *self.hide]

    def landlock_paths(self) -> list[tuple[str, str]]:
        hidden = self.hidden()
        paths: list[tuple[str, str]] = []
        for root in self.roots():
            paths += [(p, "ro") for p in _allow_except(root, hidden)]
        paths += [(d, "dev") for d in _DEVICES]
        if self.namespaces:
            paths += [("/proc", "ro"), ("/tmp", "rw")]
        else:
            paths += [(p, "ro") for p in _PROC_INFO]
        paths.append((str(self.workspace), "rw"))
        return paths

    def bwrap_argv(self) -> list[str]:
        argv = [self.bwrap, "--die-with-parent", "--new-session",
                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if self.effective_network != "full":
            argv.append("--unshare-net")
        if os.geteuid() != 0:
            argv.append("--unshare-user")
        else:
            argv += ["--cap-drop", "ALL"]
        for root in self.roots():
            if os.path.islink(root):
                argv += ["--symlink", os.readlink(root), root]
            elif os.path.isdir(root) or os.path.isfile(root):
                # (a read path may be one file: bound alone, its directories made for it)
                argv += ["--ro-bind", root, root]
        for path in self.hidden():
            if os.path.lexists(path) and any(_within(path, r) for r in self.roots()):
                if path in _SOCKET_DIRS and os.path.islink(path):
                    continue  # /var/run -> /run: its target is masked (or absent) itself
                if os.path.isdir(path) and not os.path.islink(path):
                    argv += ["--tmpfs", path]
                else:
                    argv += ["--ro-bind", "/dev/null", path]
        argv += ["--proc", "/proc", "--dev", "/dev",
                 "--size", str(self.tmp_size_mb << 20), "--tmpfs", "/tmp"]
        # A read path the operator listed under a directory masked for its
        # sockets (/run, /var/lib...) or under /tmp is bound again on top:
        # listed, it is meant.  Never one that holds or lies in a secret or
        # the daemon's own paths (`hide`): those stay masked whatever is listed.
        guarded = (*_SECRETS, *self.hide)
        for path in self.read_paths:
            under = any(_within(path, d) for d in (*_SOCKET_DIRS, "/tmp"))
            touches = any(_within(path, g) or _within(g, path) for g in guarded)
            if under and not touches and os.path.exists(path):
                argv += ["--ro-bind", path, path]
        argv += ["--bind", str(self.workspace), str(self.workspace),
                 "--chdir", str(self.workspace)]
        return argv

    def describe(self) -> dict[str, Any]:
        """For the log and the worker's Ready: what is on and what is not."""
        active = ["tool-host", "no_new_privs", "rlimit-nproc" if self.nproc else ""]
        inactive: dict[str, str] = {}
        if self.landlock_abi:
            active.append("landlock")
            # What the host's ruleset adds with the kernel's ABI (session_worker/toolhost/host.py).
            if self.landlock_abi >= 6:
                active.append("landlock-scope")
            else:
                inactive["landlock-scope"] = (f"Landlock ABI {self.landlock_abi} < 6: signals are limited by uid "
                                              "only, abstract Unix sockets by the network namespace only")
            if self.effective_network == "none":
                if self.landlock_abi >= 4:
                    active.append("landlock-net")
                else:
                    inactive["landlock-net"] = f"Landlock ABI {self.landlock_abi} < 4: TCP refused by seccomp only"
        else:
            inactive["landlock"] = "not in this kernel (or not enabled: lsm=landlock)"
        if self.namespaces:
            active.append("namespaces")
        else:
            inactive["namespaces"] = self.why_no_namespaces or "unavailable"
        if self.namespaces or not self.why_no_ipc:
            active.append("ipc-namespace")  # bubblewrap's, or the worker's own
        else:
            inactive["ipc-namespace"] = (f"the worker could not make one ({self.why_no_ipc}); the tool "
                                         "host makes one in a user namespace of its own where the kernel allows")
        if not self.why_no_seccomp:
            active.append("seccomp")
        else:
            inactive["seccomp"] = self.why_no_seccomp
        if self.network != self.effective_network:
            inactive["network-loopback"] = "needs namespaces; tools get network none"
        report: dict[str, Any] = {"active": [a for a in active if a], "inactive": inactive,
                                  "network": self.effective_network, "socket_families": self.socket_families}
        if not self.namespaces:
            report["unix_sockets"] = ("socketpair only: without a mount namespace Landlock does not "
                                      "cover connect() to a Unix socket's path, so seccomp refuses socket(AF_UNIX)")
        report["tools"] = "refused" if self.why_refused else "run"
        if self.why_refused:
            report["refused"] = self.why_refused
        return report

    def host_config(self) -> dict[str, Any]:
        return {
            "network": self.effective_network,
            "paths": self.landlock_paths(),
            "nproc": self.nproc,
            # Built when the host starts, not at boot: most sessions never run a tool.
            "seccomp": "" if self.why_no_seccomp else _seccomp.build(
                self.effective_network, unix=self.namespaces).hex(),
            # The plan was made for a kernel with Landlock: without it, no tool.
            "require_landlock": True,
            "parent": None if self.namespaces else os.getpid(),
            "outer": ["namespaces"] if self.namespaces else [],
            # SysV IPC of its own where neither bubblewrap nor the worker made it one.
            "ipc": bool(self.why_no_ipc) and not self.namespaces,
        }


def _own_python() -> str:
    return os.path.realpath(sys.executable)


def host_python() -> str:
    """The interpreter for the tool host: ours, when this uid may run it
    (a per-session uid may not reach a Python installed under /root, say),
    else the system's; the host needs only the standard library."""
    own = _own_python()
    if os.access(own, os.X_OK):
        return own
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return own


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _allow_except(root: str, hidden: list[str]) -> list[str]:
    """`root`, or when something hidden is inside it, every entry of it
    but the hidden ones, recursively (Landlock can only add, not subtract)."""
    inside = [h for h in hidden if _within(h, root)]
    if not inside:
        return [root]
    if root in inside or not os.path.isdir(root) or os.path.islink(root):
        return []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    out: list[str] = []
    for name in names:
        out += _allow_except(os.path.join(root, name), inside)
    return out


def plan_for(boot: m.SandboxBoot | None, settings: SessionSettings, workspace: Path,
             per_session_uid: bool, own_ipc: str = "not asked") -> Plan | None:
    """The plan for this worker, or None when sandbox.mode is off."""
    if boot is None or settings.sandbox.mode == "off":
        return None
    namespaces = boot.namespaces and settings.sandbox.namespaces != "off"
    why_no_namespaces = "sandbox.namespaces = off" if settings.sandbox.namespaces == "off" else boot.why_not
    network = settings.sandbox.network
    why_no_seccomp = _seccomp.unsupported()
    limit = settings.agent.limits.max_processes
    # RLIMIT_NPROC counts per user and user namespace: per session with a
    # uid of its own or a user namespace of its own, else it would count
    # every session's processes (then the memory sweep's count enforces it).
    # Root's processes are never held by RLIMIT_NPROC (allow_root_tools).
    own_count = (per_session_uid or namespaces) and os.geteuid() != 0
    nproc = limit if own_count else None
    return Plan(
        workspace=workspace, network=network, namespaces=namespaces,
        bwrap=boot.bwrap, why_no_namespaces=why_no_namespaces, hide=tuple(boot.hide),
        read_paths=tuple(settings.sandbox.read_paths), nproc=nproc,
        tmp_size_mb=settings.sandbox.tmp_size_mb, why_no_seccomp=why_no_seccomp,
        landlock_abi=boot.landlock_abi, why_no_ipc=own_ipc,
        why_refused=settings.sandbox.refusal(boot.namespaces, boot.why_not, boot.landlock_abi,
                                             why_no_seccomp, boot.unmeasured),
    )


@dataclass(slots=True)
class HostCommand:
    """One command started by the tool host."""

    id: int
    pid: int
    exited: asyncio.Future[int]

    @property
    def returncode(self) -> int | None:
        done = self.exited.done() and not self.exited.cancelled() and self.exited.exception() is None
        return self.exited.result() if done else None


def _fork_error(exc: OSError) -> str:
    """A refused fork, said as the ceiling it is."""
    if exc.errno == errno.EAGAIN:
        return ("no room for another process (EAGAIN): the session's max_processes, its owner's share "
                "([daemon] max_processes_per_uid) or the daemon's task ceiling (TasksMax) is reached; "
                "try again when some of its processes have ended")
    if exc.errno == errno.ENOMEM:
        return "out of memory (ENOMEM) at a memory ceiling; try again when some memory is free"
    return str(exc)


class ToolHost:
    """The worker's end of its tool host: start on first use, then run orders."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.report: dict[str, Any] = {}
        self._sock: socket.socket | None = None
        self._proc: _spawn.Child | None = None
        self._starting: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._errors = _HostErrors()  # one budget for the session, however many hosts

    async def _ensure(self) -> socket.socket:
        if self._sock is not None and (self._reader is None or not self._reader.done()):
            return self._sock
        if self._starting is None or self._starting.done():
            self._close_transport()
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)
        assert self._sock is not None
        return self._sock

    async def _start(self) -> None:
        plan = self.plan
        if plan.why_refused:
            raise SandboxError(plan.why_refused)
        if not plan.namespaces:
            os.makedirs(plan.tmp, mode=0o700, exist_ok=True)
        self._errors.ready = False
        self._errors.early.clear()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [plan.python, "-I", "-S", "-c", _HOST_BOOT, str(theirs.fileno())]
        # Queued before it starts (a datagram each; it reads them first thing).
        ours.sendall(_HOST_SOURCE.encode())
        ours.sendall(json.dumps(plan.host_config()).encode())
        passed = [theirs.fileno()]
        if plan.namespaces:
            # bubblewrap's own arguments name the workspace (ID@TOKEN):
            # read from a pipe (`--args`), not shown by `ps` to every user.
            args = _args_pipe(plan.bwrap_argv()[1:])
            passed.append(args)
            argv = [plan.bwrap, "--args", str(args), "--", *argv]
        try:
            # Only 0, 1, 2 and its socket: not what the worker inherited.
            for delay in (*_FORK_RETRY_SECS, None):
                try:
                    proc = _spawn.spawn(argv, cwd=plan.workspace, env=host_environment(plan),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        pass_fds=passed)
                    break
                except OSError as exc:
                    # At a task or memory ceiling: the room may come back as
                    # the session's (or others') processes end; tried again, briefly.
                    if exc.errno not in (errno.EAGAIN, errno.ENOMEM) or delay is None:
                        raise
                    await asyncio.sleep(delay)
        except OSError as exc:
            ours.close()
            raise SandboxError(f"cannot start the tool host: {_fork_error(exc)}") from None
        finally:
            theirs.close()
            if len(passed) > 1:
                os.close(passed[1])
        ours.setblocking(False)
        self._proc = proc
        errors = self._errors.follow(proc)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(_START_TIMEOUT_SECS):
                first = await loop.sock_recv(ours, 65536)
        except (TimeoutError, OSError) as exc:
            first = b""
            self._errors.early += f"({type(exc).__name__} waiting for the tool host)".encode()
        hello = json.loads(first) if first else {}
        if not hello.get("ready"):
            ours.close()
            proc.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(errors), 1.0)
            detail = hello.get("error") or self._errors.early.decode("utf-8", "replace").strip() or "it exited"
            self._errors.early.clear()
            raise SandboxError(f"the session's sandbox did not start: {detail}")
        self._errors.ready = True
        self.report = {"active": hello.get("applied", []), "inactive": hello.get("skipped", {})}
        log.info("tool host started (pid %s): %s", proc.pid, ", ".join(self.report["active"]))
        self._sock = ours
        self._reader = asyncio.ensure_future(self._read(ours))

    async def _read(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await loop.sock_recv(sock, 65536):
                msg = json.loads(data)
                oid = msg.get("id")
                if "pid" in msg or "error" in msg:
                    fut = self._pending.pop(oid, None)
                    if fut is not None and not fut.done():
                        if "error" in msg:
                            fut.set_exception(CommandError(f"cannot start the command: {msg['error']}"))
                        else:
                            fut.set_result(msg["pid"])
                elif "exit" in msg:
                    self._errors.note_dropped()  # what a command's flood cost, once it is over
                    done = self._exits.pop(oid, None)
                    if done is not None and not done.done():
                        done.set_result(int(msg["exit"]))
        except (OSError, ValueError):
            pass
        finally:
            lost = SandboxError("the tool host exited")
            for fut in [*self._pending.values(), *self._exits.values()]:
                if not fut.done():
                    fut.set_exception(lost)
                    fut.exception()  # whoever waits sees it; nobody need
            self._pending.clear()
            self._exits.clear()

    async def spawn(self, argv: list[str], env: dict[str, str], outfd: int | tuple[int, int, int],
                    stdin: int | None = None) -> HostCommand:
        """Start `argv` in the workspace with stdout and stderr on `outfd`
        (stdin /dev/null, or `stdin`: the bash tool's command), or with
        `outfd` = (stdin, stdout, stderr): a server the worker speaks to
        over its stdio (an MCP server).

        A host found dead before it took the order (a tool may kill its
        parent) is started again, once.  Once the order is out, never: the
        command may have run, so a host lost then is the command's result
        (its `exited` fails), not a reason to run it twice."""
        try:
            return await self._spawn(argv, env, outfd, stdin)
        except OrderNotSent:
            self.close()
            try:
                return await self._spawn(argv, env, outfd, stdin)
            except OrderNotSent as exc:
                raise SandboxError(str(exc)) from None

    async def _spawn(self, argv: list[str], env: dict[str, str],
                     outfd: int | tuple[int, int, int], stdin: int | None) -> HostCommand:
        sock = await self._ensure()
        loop = asyncio.get_running_loop()
        oid = next(self._ids)
        started: asyncio.Future[int] = loop.create_future()
        exited: asyncio.Future[int] = loop.create_future()
        order: dict[str, Any] = {"op": "run", "id": oid, "argv": argv, "cwd": str(self.plan.workspace), "env": env}
        fds = [outfd] if isinstance(outfd, int) else list(outfd)
        if not isinstance(outfd, int):
            order["stdio"] = True
        elif stdin is not None:
            order["stdin"] = True
            fds.append(stdin)
        try:
            socket.send_fds(sock, [json.dumps(order).encode()], fds)
        except OSError as exc:
            raise OrderNotSent(f"the tool host is gone: {exc}") from None
        if self._reader is None or self._reader.done():
            # It died after taking the order, and the reader has already
            # failed everything it knew of: this command too.
            exited.set_exception(SandboxError("the tool host exited"))
            exited.exception()
            return HostCommand(oid, 0, exited)
        self._pending[oid] = started
        self._exits[oid] = exited
        try:
            pid = await asyncio.shield(started)
        except CommandError:
            self._exits.pop(oid, None)
            raise
        except SandboxError:
            return HostCommand(oid, 0, exited)  # lost with the host; exited says so
        return HostCommand(oid, pid, exited)

    def kill(self, command: HostCommand) -> None:
        """SIGKILL the command's process group."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.send(json.dumps({"op": "kill", "id": command.id}).encode())

    def _close_transport(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._reader = None

    def close(self) -> None:
        self._close_transport()
        if self._proc is not None:
            self._proc.kill()
        self._errors.note_dropped()


class _HostErrors:
    """A tool host's stderr, read on the worker's loop.  Before the host is
    ready its first bytes are the reason it did not start (for the tool
    call's error); after, each line goes to the log escaped (no control
    character or newline of a tool's making; the worker's filter puts
    `session=ID` in front), `_LOG_LINES` per session, the rest counted."""

    def __init__(self) -> None:
        self.ready = False
        self.early = bytearray()
        self._line = bytearray()
        self._logged = 0
        self._dropped = 0
        self._noted = 0

    def follow(self, proc: _spawn.Child) -> asyncio.Future[None]:
        """Read `proc`'s stderr until its end; the future is done then."""
        assert proc.stderr is not None
        fd = proc.stderr.fileno()
        os.set_blocking(fd, False)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if data:
                self._feed(data)
                return
            loop.remove_reader(fd)
            assert proc.stderr is not None
            proc.stderr.close()
            self._flush()
            if not done.done():
                done.set_result(None)

        loop.add_reader(fd, readable)
        return done

    def _feed(self, data: bytes) -> None:
        if not self.ready:
            self.early += data[: max(0, _EARLY_BYTES - len(self.early))]
            return
        if self._logged >= _LOG_LINES:
            self._dropped += data.count(b"\n")
            return
        self._line += data
        while self._logged < _LOG_LINES and (end := self._line.find(b"\n")) >= 0:
            self._emit(bytes(self._line[:end]))
            del self._line[: end + 1]
        if self._logged >= _LOG_LINES:
            self._dropped += self._line.count(b"\n")
            self._line.clear()
            log.warning("tool host: more than %d lines; the rest are dropped and counted", _LOG_LINES)
        elif len(self._line) > _LOG_LINE_CHARS:
            self._emit(bytes(self._line))
            self._line.clear()

    def _emit(self, line: bytes) -> None:
        self._logged += 1
        log.warning("tool host: %s", escape(line.decode("utf-8", "replace"))[:_LOG_LINE_CHARS])

    def _flush(self) -> None:
        if self._line and self._logged < _LOG_LINES:
            self._emit(bytes(self._line))
        self._line.clear()
        self.note_dropped()

    def note_dropped(self) -> None:
        if self._dropped > self._noted:
            log.warning("tool host: %d lines dropped (at most %d per session reach the log)",
                        self._dropped - self._noted, _LOG_LINES)
            self._noted = self._dropped


def _args_pipe(args: list[str]) -> int:
    """The read end of a pipe holding `args` NUL-separated, whole (for
    `bwrap --args FD`; far below a pipe's 64 KiB)."""
    data = b"".join(arg.encode() + b"\0" for arg in args)
    rfd, wfd = os.pipe()
    try:
        if len(data) > 65536:
            raise SandboxError(f"bubblewrap's arguments are {len(data)} bytes (a pipe holds 65536)")
        os.write(wfd, data)
    except BaseException:
        os.close(rfd)
        raise
    finally:
        os.close(wfd)
    return rfd


def host_environment(plan: Plan) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": plan.tmp}


_current: ToolHost | None = None


def configure(plan: Plan | None) -> None:
    """Set this worker's sandbox (one session per worker process).  Also
    marks what the worker inherited close-on-exec, for the processes that
    are not started through `_spawn` (a handler's, a custom tool's)."""
    global _current
    _spawn.seal_inherited()
    if _current is not None:
        _current.close()
    _current = ToolHost(plan) if plan is not None else None


def current() -> ToolHost | None:
    """The session's tool host, or None when tools run unconfined."""
    return _current
