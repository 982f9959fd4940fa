"""The tool host: the one process a session's tools are started from.

Started by the worker at a session's first tool call, with the system's
Python in isolated mode and no site (`python -I -S -c BOOT FD`, BOOT a line
that reads this source and its config from the socket FD, as its first two
messages, and runs it with `argv = [name, CONFIG, FD]`: session_worker.worker.sandbox): it
imports nothing but the standard library, so it needs nothing but the
interpreter, and under bubblewrap nothing of the venv or the checkout has to
be visible.  Before it reads its first order it confines itself, and every
tool it starts inherits all of it:

- without bubblewrap and where the worker made none, an IPC namespace of
  its own (in a user namespace mapping only its uid: SysV IPC goes with
  the session);
- `no_new_privs`, then the seccomp filter the worker built
  (`session_worker.worker._seccomp`), unless bubblewrap already loaded it;
- a Landlock domain: read-only system paths, the workspace and the session's
  temporary directory read-write, nothing else; TCP refused when the network
  policy is `none`; signals and abstract Unix sockets scoped to the domain
  (the daemon, the worker and other sessions cannot be signalled or reached);
- non-dumpable, so its descriptors and memory are out of a tool's reach
  through /proc;
- no descriptor but 0, 1, 2 and its socket (close-on-exec): whatever
  else the worker or bubblewrap let through is closed first, so a command
  starts with its /dev/null stdin and its output pipe as 1 and 2, nothing
  else (not the daemon's log, not a file the daemon inherited);
- RLIMIT_NPROC (counted per user namespace under bubblewrap, so per
  session), umask 077, and it is the child subreaper, so a tool that
  daemonizes stays in the session's tree, where the memory sweep sees it and
  stop kills it.

Conversation with the worker, JSON over a SEQPACKET socket (fd FD):

    host  -> {"ready": true, "applied": [...], "skipped": {...}}
    worker-> {"op": "run", "id": N, "argv": [...], "cwd": ..., "env": {...}}
             + the write end of the output pipe (SCM_RIGHTS)
             (with "stdin": true, a second descriptor: the command's stdin,
             which holds the bash tool's command: never in an argv)
             (with "stdio": true, three descriptors instead: the command's
             stdin, stdout and stderr: a server the worker talks to, MCP's)
    host  -> {"id": N, "pid": P} | {"id": N, "error": "..."}
    worker-> {"op": "kill", "id": N}        (the command's process group)
    host  -> {"id": N, "exit": CODE}        (negative: killed by that signal)

EOF from the worker ends the host; PDEATHSIG ends it if the worker dies.
This module must stay importable and runnable with the standard library
alone: it is read as source text and run by a bare interpreter.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from typing import Any

Config = dict[str, Any]

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_SECCOMP = 22
_CLONE_NEWUSER, _CLONE_NEWIPC = 0x10000000, 0x08000000
_SECCOMP_MODE_FILTER = 2

# Landlock (linux/landlock.h); syscall numbers are the same on every arch.
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446
_LL_CREATE_RULESET_VERSION = 1
_LL_RULE_PATH_BENEATH, _LL_RULE_NET_PORT = 1, 2
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_ALL_V1 = (1 << 13) - 1
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2
_READ = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
_GRACE_SECS = 1.0
_FD_CEILING = 1 << 30  # above any RLIMIT_NOFILE (the kernel's nr_open is at most 2^30)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _prctl(option: int, arg: int = 0) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _fs_rights(abi: int) -> int:
    rights = _FS_ALL_V1
    if abi >= 2:
        rights |= _FS_REFER
    if abi >= 3:
        rights |= _FS_TRUNCATE
    if abi >= 5:
        rights |= _FS_IOCTL_DEV
    return rights


def _landlock(cfg: Config, applied: list[str], skipped: dict[str, str]) -> None:
    abi = _libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_LL_CREATE_RULESET_VERSION))
    if abi < 0:
        why = "not available in this kernel (%s)" % os.strerror(ctypes.get_errno())
        if cfg.get("require_landlock"):
            raise OSError(0, why, "landlock")  # fail closed: no tool runs without it
        skipped["landlock"] = why
        return
    handled = _fs_rights(abi)
    net = 0
    if abi >= 4 and cfg["network"] == "none":
        net = _NET_BIND_TCP | _NET_CONNECT_TCP  # handled, no rule: all TCP refused
    scoped = _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL if abi >= 6 else 0
    if abi >= 6:
        attr = struct.pack("=QQQ", handled, net, scoped)
    elif abi >= 4:
        attr = struct.pack("=QQ", handled, net)
    else:
        attr = struct.pack("=Q", handled)
    buf = ctypes.create_string_buffer(attr, len(attr))
    fd = _libc.syscall(_LL_CREATE, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for path, access in cfg["paths"]:
            mask = handled if access == "rw" else _READ
            if access == "dev":
                mask = _FS_READ_FILE | _FS_WRITE_FILE | (_FS_IOCTL_DEV if abi >= 5 else 0)
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a path this system does not have
            try:
                if not os.path.isdir(path):
                    # Directory-only rights on a file are refused (EINVAL).
                    mask &= _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
                rule = ctypes.create_string_buffer(struct.pack("=Qi", mask & handled, pfd), 12)
                if _libc.syscall(_LL_ADD_RULE, fd, _LL_RULE_PATH_BENEATH, rule, 0) != 0:
                    raise OSError(ctypes.get_errno(), "landlock_add_rule %s" % path)
            finally:
                os.close(pfd)
        if _libc.syscall(_LL_RESTRICT, fd, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(fd)
    applied.append("landlock-abi%d" % abi)
    if net:
        applied.append("landlock-net")
    if scoped:
        applied.append("landlock-scope")
    else:
        skipped["landlock-scope"] = "kernel Landlock ABI %d < 6: signals are limited by uid only" % abi


def _seccomp(program: bytes) -> None:
    prog = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program) // 8, ctypes.cast(prog, ctypes.c_void_p))
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp")


def _own_ipc() -> str:
    """An IPC namespace for the host and its tools (its SysV objects go with
    the last of them): as the unprivileged user we run as, inside a user
    namespace of our own that maps only our uid and gid, whose capabilities
    are dropped at once.  '' when made, else why not.  First of all: the
    new credentials clear the parent-death signal and the dumpable flag,
    which `confine` then sets."""
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWIPC) != 0:
        return "no user namespace: %s" % os.strerror(ctypes.get_errno())
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)),
                       ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
    # struct __user_cap_header_struct {version 3, pid 0}; two empty data sets.
    header, data = struct.pack("=Ii", 0x20080522, 0), bytes(24)
    if _libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    return ""


def confine(cfg: Config) -> tuple[list[str], dict[str, str]]:
    """Everything the host and its tools run under; returns what was applied."""
    applied: list[str] = []
    skipped: dict[str, str] = {}
    if cfg.get("ipc"):
        why = _own_ipc()
        if why:
            skipped["ipc-namespace"] = why
        else:
            applied.append("ipc-namespace")
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if cfg.get("parent") is not None and os.getppid() != cfg["parent"]:
        os._exit(1)  # the worker died before we armed PDEATHSIG
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    # Non-dumpable: its /proc/PID/fd, mem and environ need CAP_SYS_PTRACE.
    # A tool opened /proc/$PPID/fd/2 (Landlock does not stop opening a
    # pipe through its magic link) and wrote into the worker's log pipe.
    # Commands are dumpable again: execve resets the flag.
    _prctl(_PR_SET_DUMPABLE, 0)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    applied.append("no_new_privs")
    os.umask(0o077)
    nproc = cfg.get("nproc")
    if nproc:
        import resource

        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        applied.append("rlimit-nproc")
    if cfg.get("landlock", True):
        _landlock(cfg, applied, skipped)
    program = bytes.fromhex(cfg.get("seccomp", ""))
    if program:
        _seccomp(program)
        applied.append("seccomp")
    return applied, skipped


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(obj).encode())
    except OSError:
        pass


def _start(order: Config, fds: list[int]) -> int:
    """posix_spawn (vfork and exec): no Python runs in the child.  Every
    command starts in the workspace, the host's own working directory."""
    if order.get("cwd") and os.path.realpath(order["cwd"]) != os.getcwd():
        raise OSError("commands run in the workspace only")
    actions: list[tuple[Any, ...]]
    if order.get("stdio"):
        if len(fds) != 3:
            raise OSError("a stdio command needs its stdin, stdout and stderr")
        actions = [(os.POSIX_SPAWN_DUP2, fd, n) for n, fd in enumerate(fds)]
    else:
        stdin: tuple[Any, ...] = (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0)
        if order.get("stdin"):
            if len(fds) != 2:
                raise OSError("a command with a stdin needs its output and its stdin")
            stdin = (os.POSIX_SPAWN_DUP2, fds[1], 0)
        actions = [stdin, (os.POSIX_SPAWN_DUP2, fds[0], 1), (os.POSIX_SPAWN_DUP2, fds[0], 2)]
    # A stdio server's argv[0] is looked up on the host's PATH (posix_spawnp):
    # an operator names an MCP server as a shell would.
    spawn = os.posix_spawnp if order.get("stdio") else os.posix_spawn
    return spawn(
        order["argv"][0], order["argv"], order["env"],
        file_actions=actions,
        setpgroup=0,
        setsigdef=(signal.SIGPIPE, signal.SIGCHLD),
    )


def _start_retrying(order: Config, fds: list[int]) -> int:
    """`_start`, tried again briefly (0.35 s at most) when the fork is
    refused for want of tasks or memory: the room may come back as the
    session's processes end (we reap them in this loop, after)."""
    for delay in (0.05, 0.1, 0.2, None):
        try:
            return _start(order, fds)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.ENOMEM) or delay is None:
                raise
            time.sleep(delay)
    raise AssertionError("unreachable")


def _why(exc: OSError) -> str:
    if exc.errno == errno.EAGAIN:
        return ("no room for another process (EAGAIN): the session's max_processes, its owner's "
                "share or the daemon's task ceiling is reached; try again when some have ended")
    return str(exc)


def serve(sock: socket.socket, applied: list[str], skipped: dict[str, str]) -> None:
    _send(sock, {"ready": True, "applied": applied, "skipped": skipped, "pid": os.getpid()})
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "sock")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    commands: dict[int, int | None] = {}  # pid -> order id
    while True:
        for key, _ in sel.select():
            if key.data == "wake":
                try:
                    os.read(wake_r, 512)
                except OSError:
                    pass
            else:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 4)
                except OSError:
                    data, fds = b"", []
                for fd in fds:
                    # Close-on-exec (recv_fds drops its flags argument before
                    # Python 3.12): a command gets the pipe as 1 and 2, not a third copy.
                    os.set_inheritable(fd, False)
                if not data:
                    _wind_down(commands, "landlock-scope" in applied or "namespaces" in applied)
                    return
                order = json.loads(data)
                if order.get("op") == "run":
                    if not fds:
                        _send(sock, {"id": order["id"], "error": "no output pipe"})
                        continue
                    try:
                        pid = _start_retrying(order, fds)
                    except OSError as exc:
                        _send(sock, {"id": order["id"], "error": _why(exc)})
                    else:
                        commands[pid] = order["id"]
                        _send(sock, {"id": order["id"], "pid": pid})
                    finally:
                        for fd in fds:
                            os.close(fd)
                elif order.get("op") == "kill":
                    for pid, oid in commands.items():
                        if oid == order["id"]:
                            try:
                                os.killpg(pid, signal.SIGKILL)
                            except OSError:
                                pass
                else:
                    for fd in fds:
                        os.close(fd)
        # Reap: our commands (reported) and orphans adopted as subreaper.
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            oid = commands.pop(pid, None)
            if oid is not None:
                _send(sock, {"id": oid, "exit": os.waitstatus_to_exitcode(status)})


def _wind_down(commands: dict[int, int | None], contained: bool) -> None:
    """The worker is done with us: SIGTERM each command's group, give them a
    moment, then SIGKILL what is left.  When the host's signals reach only
    its own session (a Landlock scope or a PID namespace), kill(-1) also
    finds what left its group; never otherwise, where -1 is every process
    of this uid."""
    for pid in commands:
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + _GRACE_SECS
    while commands and time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            commands.pop(pid, None)
        else:
            time.sleep(0.01)
    for pid in commands:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    if contained:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass


def _keep_only(fd: int) -> None:
    """Close every descriptor but 0, 1, 2 and `fd`, whatever the worker or
    bubblewrap let through: the commands inherit what is left open."""
    if fd > 3:
        os.closerange(3, fd)
    os.closerange(max(3, fd + 1), _FD_CEILING)
    os.set_inheritable(fd, False)  # the worker's line is not for the tools


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[1])
    fd = int(argv[2])
    _keep_only(fd)
    sock = socket.socket(fileno=fd)
    try:
        applied, skipped = confine(cfg)
    except OSError as exc:
        _send(sock, {"ready": False, "error": "%s: %s" % (exc.filename or "confine", exc.strerror or exc)})
        return 1
    applied = list(cfg.get("outer", [])) + applied
    serve(sock, applied, skipped)
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv)
    except KeyboardInterrupt:
        code = 1
    sys.exit(code)
