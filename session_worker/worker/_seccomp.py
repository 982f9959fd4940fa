"""The seccomp filter a session's tools run under, as a classic BPF program.

bubblewrap loads it (`--seccomp FD`) into the sandboxed process after the
namespaces are set up and `no_new_privs` is on; every tool process inherits
it.  It refuses what an agent's tools never need and what widens the
kernel's attack surface from inside a sandbox: mounting and the new mount
API, new namespaces (`unshare`, `setns`, `clone` with a CLONE_NEW* flag;
`clone3` answers ENOSYS so that libc falls back to `clone`, whose flags a
filter can read), ptrace and cross-process memory access, kernel modules,
kexec, keyrings, bpf, perf, userfaultfd, io_uring (its requests bypass
seccomp), file handles (`open_by_handle_at`, the classic container
escape), swap, reboot, clocks, accounting, quotas, and the ioctls that
make a btrfs subvolume or snapshot (one made in a workspace would be
outside its qgroup limit: supervisor.host.btrfs).  socket(2) is an
allow-list of families: AF_UNIX, plus AF_INET and AF_INET6 unless
`network = "none"`; everything else (AF_NETLINK, AF_PACKET, AF_VSOCK,
AF_ALG, ...) is refused.  AF_NETLINK is left out on purpose: glibc's
getaddrinfo asks it only for AI_ADDRCONFIG and carries on without it, and
without a network namespace it would show the host's interfaces, routes and
(sock_diag) every socket on the host.  Without a mount namespace (`unix`
false) AF_UNIX is refused too: Landlock does not cover connect() to a
socket's path, so every Unix socket on the host would be in reach;
socketpair() is not socket() and stays.

The program is built here rather than with libseccomp: a deny list and two
argument checks are a few dozen instructions, and the syscall numbers are
the kernel's stable ABI.  Only x86-64 has a table; elsewhere `build` says
so and the sandbox runs without seccomp (reported, not hidden).  A syscall
from another ABI (i386 via int 0x80, x32) kills the process: its numbers
would mean other calls.
"""

from __future__ import annotations

import errno
import os
import struct

from ipc.contract import BTRFS_SUBVOLUME_IOCTLS, SECCOMP_MACHINES
from session_worker.errors import UnsupportedArch

__all__ = ["build", "denied_syscalls", "socket_families", "unsupported"]

# linux/audit.h
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000

# The x86-64 syscall table (arch/x86/entry/syscalls/syscall_64.tbl).
_X86_64 = {
    "ptrace": 101, "syslog": 103, "uselib": 134, "personality": 135, "vhangup": 153,
    "pivot_root": 155, "adjtimex": 159, "acct": 163, "settimeofday": 164, "mount": 165,
    "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170,
    "setdomainname": 171, "iopl": 172, "ioperm": 173, "create_module": 174,
    "init_module": 175, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212,
    "clock_settime": 227, "kexec_load": 246, "add_key": 248, "request_key": 249,
    "keyctl": 250, "unshare": 272, "perf_event_open": 298, "name_to_handle_at": 303,
    "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313,
    "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "quotactl_fd": 443,
}
_CLONE, _CLONE3, _SOCKET, _IOCTL = 56, 435, 41, 16

# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10

# linux/filter.h, linux/seccomp.h
_LD_W_ABS = 0x20
_JEQ = 0x15
_JGE = 0x35
_JSET = 0x45
_RET = 0x06
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000
# struct seccomp_data: nr (u32), arch (u32), instruction_pointer (u64), args[6] (u64)
_NR, _ARCH, _ARG0_LOW, _ARG1_LOW = 0, 4, 16, 24


def unsupported(machine: str | None = None) -> str:
    """Why there is no filter for this machine, or '' when there is one."""
    machine = machine or _MACHINE
    return "" if machine in SECCOMP_MACHINES else f"no seccomp syscall table for {machine}"


# Asked once, at import (in the zygote): `platform.machine()` (the same
# answer) is enough Python that each worker asking at boot copied pages.
_MACHINE = os.uname().machine


def denied_syscalls() -> list[str]:
    """The names refused outright (besides the clone and socket checks)."""
    return sorted(_X86_64)


def socket_families(network: str, unix: bool = True) -> tuple[int, ...]:
    """The address families socket(2) may create under `network`."""
    return ((AF_UNIX,) if unix else ()) + (() if network == "none" else (AF_INET, AF_INET6))


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build(network: str, machine: str | None = None, unix: bool = True) -> bytes:
    """The filter for one sandbox, ready for bubblewrap's `--seccomp FD`;
    `unix` false refuses socket(AF_UNIX) (no mount namespace)."""
    why = unsupported(machine)
    if why:
        raise UnsupportedArch(why)
    eperm = _ERRNO | errno.EPERM
    prog = [
        _ins(_LD_W_ABS, _ARCH),
        _ins(_JEQ, _AUDIT_ARCH_X86_64, jt=1),
        _ins(_RET, _KILL_PROCESS),
        _ins(_LD_W_ABS, _NR),
        _ins(_JGE, _X32_SYSCALL_BIT, jf=1),
        _ins(_RET, _KILL_PROCESS),
    ]
    for nr in sorted(_X86_64.values()):
        prog += [_ins(_JEQ, nr, jf=1), _ins(_RET, eperm)]
    prog += [_ins(_JEQ, _CLONE3, jf=1), _ins(_RET, _ERRNO | errno.ENOSYS)]
    # clone: refused only with a CLONE_NEW* flag (threads and forks go on).
    prog += [
        _ins(_JEQ, _CLONE, jf=4),
        _ins(_LD_W_ABS, _ARG0_LOW),
        _ins(_JSET, _CLONE_NEW_ANY, jf=1),
        _ins(_RET, eperm),
        _ins(_RET, _ALLOW),
    ]
    # ioctl: refused for btrfs's subvolume and snapshot requests (the low 32
    # bits of arg 1: the kernel reads an unsigned int), allowed otherwise.
    requests = BTRFS_SUBVOLUME_IOCTLS
    k = len(requests)
    prog += [_ins(_JEQ, _IOCTL, jf=k + 3), _ins(_LD_W_ABS, _ARG1_LOW)]
    for i, request in enumerate(requests):
        prog.append(_ins(_JEQ, request, jt=k - i))  # to the refusal, past the allow
    prog += [_ins(_RET, _ALLOW), _ins(_RET, eperm)]
    # socket: the family (the low 32 bits of arg 0: the kernel reads an int)
    # must be on the list; no match falls through to the refusal.
    allowed = socket_families(network, unix)
    n = len(allowed)
    prog += [_ins(_JEQ, _SOCKET, jf=n + 3), _ins(_LD_W_ABS, _ARG0_LOW)]
    for i, family in enumerate(allowed):
        # Match: jump over the remaining checks and the refusal, to the allow.
        prog.append(_ins(_JEQ, family, jt=n - i))
    prog += [_ins(_RET, _ERRNO | errno.EACCES), _ins(_RET, _ALLOW)]
    prog.append(_ins(_RET, _ALLOW))
    return b"".join(prog)
