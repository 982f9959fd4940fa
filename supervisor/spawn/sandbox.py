"""What this host offers for confining tools, found once at start.

The worker does the confining (`session_worker.worker.sandbox`); the daemon finds
out, before any session exists, whether bubblewrap can make namespaces for
the uid tools will run as (a root daemon's session uids, or its own), and
which daemon paths must stay out of every sandbox.  Said in the start-up
log (which mechanisms are active, which socket families tools get, and,
where the configured isolation cannot be built, that tools will not run and
why), refused at start under `sandbox.mode = "required"` when a mechanism
is missing, and sent to every worker in its Boot.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

from ipc import messages as m
from ipc.contract import SECCOMP_MACHINES
from ipc.linux import set_dumpable
from ipc.settings import SandboxSettings
# Re-exported: daemon.py catches sandbox.SandboxUnavailable.
from supervisor.errors import SandboxUnavailable

__all__ = ["SandboxUnavailable", "landlock_abi", "probe"]

log = logging.getLogger("sessiond")

_PROBE_TIMEOUT_SECS = 10.0


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when it has none."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(0, int(abi))


# What the probe's /bin/true needs, bound as a tool's sandbox binds the
# system's directories (session_worker.worker.sandbox): not the whole root,
# whose every mount bubblewrap remounts read-only one by one, so that a mount
# of the host's going away meanwhile (another daemon's workspace image, a
# container's) failed the probe and left this daemon's tools off for its life.
_PROBE_ROOTS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")


def probe_roots() -> list[str]:
    """bwrap arguments binding the probe's system directories, read-only."""
    argv: list[str] = []
    for root in _PROBE_ROOTS:
        if os.path.islink(root):
            argv += ["--symlink", os.readlink(root), root]
        elif os.path.isdir(root):
            argv += ["--ro-bind", root, root]
    return argv


def _try_bwrap(bwrap: str, uid: int | None, gid: int | None) -> str:
    """'' when bubblewrap makes every namespace we use for `uid`, else why not."""
    argv = [bwrap, *probe_roots(), "--proc", "/proc", "--dev", "/dev", "--unshare-pid",
            "--unshare-ipc", "--unshare-net", "--unshare-uts", "--die-with-parent"]
    if (uid if uid is not None else os.geteuid()) != 0:
        argv.append("--unshare-user")
    argv += ["--", "/bin/true"]
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=_PROBE_TIMEOUT_SECS, text=True, check=False,
            user=uid, group=gid, extra_groups=[] if uid is not None else None, cwd="/",
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{bwrap} did not run: {exc}"
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return f"{bwrap} cannot make namespaces here: {why[0]}"
    return ""


def workers_hidden() -> str:
    """'' when the daemon can read the /proc entries of a non-dumpable
    process (what every worker is, of the daemon's uid or a session's: the
    same right, CAP_SYS_PTRACE, or hidepid's gid= exemption, reads both);
    else why not.  Forks a child that only waits: call it before any
    thread exists."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(done_w)  # (the parent's closing it is the end of the wait)
            set_dumpable(False)
            os.write(ready_w, b"x")
            os.read(done_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(done_r)
    try:
        os.read(ready_r, 1)
        with open(f"/proc/{pid}/statm", "rb") as f:
            f.read()
        return ""
    except OSError as exc:
        return (f"its workers' /proc entries are hidden from it ({exc.strerror}: /proc is mounted "
                f"{_hidepid() or 'hidepid='} and the daemon lacks CAP_SYS_PTRACE and the mount's gid=)")
    finally:
        os.close(done_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


def _hidepid() -> str:
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4] == "/proc":
                return next((o for o in fields[-1].split(",") if o.startswith("hidepid=")), "")
    return ""


def unmeasured(hidden: str, counted: set[str]) -> str:
    """Why max_memory_mb and max_processes cannot be held ('' when they
    can): the workers' /proc entries are hidden and no cgroup counts their
    memory and processes instead (pure)."""
    if not hidden or {"memory", "pids"} <= counted:
        return ""
    return (f"{hidden}, and no cgroup with memory and pids controllers counts them instead: "
            "max_memory_mb and max_processes could not be enforced; delegate a cgroup v2 subtree to the "
            "daemon (Delegate=yes), give it CAP_SYS_PTRACE, or mount /proc with gid= of its group")


def probe(settings: SandboxSettings, uid: int | None, gid: int | None,
          hide: list[Path], counted: set[str] | None = None) -> m.SandboxBoot:
    """What this host can do, whatever the settings say now (a reload may
    turn the sandbox on: workers then use this); logged for the settings
    of the start, and refused when they say `required` and it is unmet.
    `counted`: the controllers of the sessions' cgroups (None: not asked,
    the daemon's view of its workers is not probed)."""
    bwrap = shutil.which("bwrap") or ""
    why_not = _try_bwrap(bwrap, uid, gid) if bwrap else "bubblewrap (bwrap) is not installed"
    blind = unmeasured(workers_hidden(), counted) if counted is not None else ""
    boot = m.SandboxBoot(namespaces=not why_not, bwrap=bwrap, why_not=why_not, landlock_abi=landlock_abi(),
                         hide=sorted({str(p) for p in hide}), unmeasured=blind)
    if settings.mode == "off":
        log.warning("sandbox.mode = off: tools run as the worker's user, unconfined")
        if blind:
            log.error("the daemon cannot measure its sessions: %s (tools run all the same: sandbox.mode = off)",
                      blind)
        return boot
    if settings.namespaces == "off":
        why_not = "sandbox.namespaces = off"
    abi = boot.landlock_abi
    seccomp_ok = platform.machine() in SECCOMP_MACHINES
    missing = []
    if why_not and settings.namespaces != "off":
        missing.append(f"namespaces ({why_not})")
    if not abi:
        missing.append("Landlock (the kernel has none, or it is not enabled: lsm=landlock)")
    if not seccomp_ok:
        missing.append(f"seccomp (no syscall table for {platform.machine()})")
    if missing and settings.mode == "required":
        raise SandboxUnavailable(
            "sandbox.mode = required, but this host lacks: " + "; ".join(missing)
        )
    seccomp_why = "" if seccomp_ok else f"no syscall table for {platform.machine()}"
    refused = settings.refusal(boot.namespaces, boot.why_not, abi, seccomp_why, blind)
    if refused:
        # Fail closed: every tool call says the same (the worker's error).
        log.error("sandbox: %s; see README, Security", refused)
        return boot
    have = ["namespaces (bubblewrap)"] if not why_not else []
    have += [f"Landlock ABI {abi}"] if abi else []
    have += ["seccomp"] if seccomp_ok else []
    log.info("sandbox: tools run confined by %s; network %s; sockets %s%s",
             ", ".join(have + ["no_new_privs"]), settings.network,
             ", ".join(_families(settings.network, not why_not)) or "none (socketpair only)",
             "" if why_not else "; Unix sockets only inside the session's mount namespace")
    if why_not:
        log.warning("sandbox: namespaces off (%s, the operator's choice): tools see the host's "
                    "paths through Landlock only, and may create no Unix socket (Landlock does not "
                    "cover connect() to a socket's path; socketpair() stays); see README, Security", why_not)
    return boot


def _families(network: str, namespaces: bool) -> list[str]:
    """What socket(2) may create (session_worker.worker._seccomp's allow-list); a
    loopback of the session's own needs namespaces, else it is `none`."""
    inet = network == "full" or (network == "loopback" and namespaces)
    return (["unix"] if namespaces else []) + (["inet", "inet6"] if inet else [])


def summary(settings: SandboxSettings, boot: m.SandboxBoot | None, cgroups: str,
            cgroups_why: str) -> dict[str, Any]:
    """The daemon-wide part of `stats`: what this host gives every session,
    and whether tools run at all (they do not where the configured
    isolation cannot be built: `refused` says why)."""
    if boot is None or settings.mode == "off":
        return {"mode": "off"}
    namespaces = boot.namespaces and settings.namespaces != "off"
    why: dict[str, str] = {}
    if not namespaces:
        why["namespaces"] = "sandbox.namespaces = off" if settings.namespaces == "off" else boot.why_not
        why["unix-sockets"] = ("refused by seccomp (socketpair only): without a mount namespace, "
                               "Landlock does not cover connect() to a Unix socket's path")
    if not boot.landlock_abi:
        why["landlock"] = "not in this kernel"
    seccomp_why = "" if platform.machine() in SECCOMP_MACHINES else f"no syscall table for {platform.machine()}"
    if seccomp_why:
        why["seccomp"] = seccomp_why
    if not cgroups:
        why["cgroups"] = cgroups_why
    out = {"mode": settings.mode, "namespaces": namespaces, "landlock_abi": boot.landlock_abi,
           "seccomp": "seccomp" not in why, "cgroups": cgroups, "why_not": why,
           "socket_families": _families(settings.network, namespaces), "tools": "run"}
    if boot.unmeasured:
        why["measure"] = boot.unmeasured
    refused = settings.refusal(boot.namespaces, boot.why_not, boot.landlock_abi, seccomp_why, boot.unmeasured)
    if refused:
        out["tools"] = "refused"
        out["refused"] = refused
    return out
