"""The sandbox's plan, without starting anything: which paths, which filter,
which bubblewrap arguments, and what a session may override."""

from __future__ import annotations

import errno
import logging
import struct
from pathlib import Path

import pytest

from ipc import messages as m
from ipc.settings import SandboxSettings, SessionSettings
from ipc.contract import BTRFS_SUBVOLUME_IOCTLS
from session_worker.worker import _seccomp, sandbox
from session_worker.errors import UnsupportedArch
from supervisor.core.overrides import OverrideError, resolve_overrides

pytestmark = pytest.mark.pure


def _plan(tmp_path: Path, namespaces: bool, **sandbox_keys: object) -> sandbox.Plan:
    settings = SessionSettings(sandbox=SandboxSettings(**sandbox_keys))  # type: ignore[arg-type]
    boot = m.SandboxBoot(namespaces=namespaces, bwrap="/usr/bin/bwrap", hide=[str(tmp_path / "state")])
    plan = sandbox.plan_for(boot, settings, tmp_path / "ws", per_session_uid=False)
    assert plan is not None
    return plan


def _decode(program: bytes) -> list[tuple[int, int, int, int]]:
    return [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]


def test_the_filter_checks_the_arch_first_and_refuses_each_listed_call() -> None:
    ins = _decode(_seccomp.build("full", machine="x86_64"))
    assert ins[0] == (0x20, 0, 0, 4)  # load seccomp_data.arch
    assert ins[1][3] == 0xC000003E and ins[2] == (0x06, 0, 0, 0x80000000)  # else kill
    refused = {k for code, jt, jf, k in ins if code == 0x15}
    assert {165, 101, 250, 321, 272, 308, 304, 425} <= refused  # mount ptrace keyctl bpf unshare setns ...
    assert (0x06, 0, 0, 0x00050000 | errno.EPERM) in ins
    assert ins[-1] == (0x06, 0, 0, 0x7FFF0000)  # default: allow
    # clone is refused only with a namespace flag; clone3 gets ENOSYS.
    assert any(code == 0x45 and k & 0x10000000 for code, _, _, k in ins)
    assert (0x06, 0, 0, 0x00050000 | errno.ENOSYS) in ins


def _run(program: bytes, nr: int, arg0: int = 0, arch: int = 0xC000003E, arg1: int = 0) -> int:
    """What the kernel would answer: classic BPF over struct seccomp_data."""
    data = struct.pack("=IIQ", nr, arch, 0) + struct.pack("=QQ", arg0, arg1) + bytes(32)
    ins, pc, acc = _decode(program), 0, 0
    while True:
        code, jt, jf, k = ins[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x06:
            return k
        elif code in (0x15, 0x35, 0x45):
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if hit else jf
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")
        pc += 1


ALLOW, EACCES = 0x7FFF0000, 0x00050000 | errno.EACCES
SOCKET, SOCKETPAIR, IOCTL = 41, 53, 16
AF = {"unix": 1, "inet": 2, "inet6": 10, "netlink": 16, "packet": 17, "alg": 38, "vsock": 40}


@pytest.mark.parametrize("network", ["none", "loopback", "full"])
@pytest.mark.parametrize("unix", [True, False])
def test_socket_families_are_an_allow_list(network: str, unix: bool) -> None:
    """Issue 21: under `none`, AF_VSOCK sockets could be made (a deny list).
    Now: AF_UNIX (only with a mount namespace), and inet/inet6 unless
    `none`; netlink, packet, alg, vsock and any other never."""
    program = _seccomp.build(network, machine="x86_64", unix=unix)
    allowed = ({"unix"} if unix else set()) | (set() if network == "none" else {"inet", "inet6"})
    for name, family in AF.items():
        verdict = _run(program, SOCKET, family)
        assert verdict == (ALLOW if name in allowed else EACCES), (network, unix, name)
    assert _run(program, SOCKET, 999) == EACCES
    # The kernel reads an int: high bits do not smuggle a family past the list.
    assert _run(program, SOCKET, (1 << 32) | AF["vsock"]) == EACCES
    assert _run(program, SOCKETPAIR, AF["unix"]) == ALLOW  # socketpair is not socket
    assert _run(program, 0) == ALLOW  # read
    assert _run(program, 165) == 0x00050000 | errno.EPERM  # mount


def test_btrfs_subvolume_ioctls_are_refused_and_others_allowed() -> None:
    """A subvolume a tool made inside its workspace would be a qgroup of
    its own, outside the workspace's kernel cap (supervisor.host.btrfs)."""
    program = _seccomp.build("none", machine="x86_64")
    eperm = 0x00050000 | errno.EPERM
    for request in BTRFS_SUBVOLUME_IOCTLS:
        assert _run(program, IOCTL, 3, arg1=request) == eperm, hex(request)
        # The kernel reads an unsigned int: high bits smuggle nothing past.
        assert _run(program, IOCTL, 3, arg1=(1 << 32) | request) == eperm, hex(request)
    for request in (0x5401, 0x40049409, 0xC0109428, 0x8030942B):  # TCGETS, FICLONE, quota ctl, qgroup limit
        assert _run(program, IOCTL, 3, arg1=request) == ALLOW, hex(request)
    assert _run(program, SOCKET, AF["vsock"]) == EACCES  # the blocks after it still run
    assert _run(program, 0) == ALLOW


def test_jumps_stay_inside_the_program() -> None:
    for network, unix in (("none", True), ("full", True), ("none", False), ("full", False)):
        ins = _decode(_seccomp.build(network, machine="x86_64", unix=unix))
        for i, (code, jt, jf, _) in enumerate(ins):
            if code & 0x07 == 0x05:  # a jump
                assert i + 1 + max(jt, jf) < len(ins), (network, i)
        assert all(code == 0x06 for code, *_ in ins[-1:])


def test_other_machines_say_why_there_is_no_filter() -> None:
    assert "aarch64" in _seccomp.unsupported("aarch64")
    with pytest.raises(UnsupportedArch):
        _seccomp.build("none", machine="aarch64")


def test_landlock_paths_leave_out_secrets_and_daemon_paths(tmp_path: Path) -> None:
    plan = _plan(tmp_path, namespaces=False)
    paths = dict(plan.landlock_paths())
    assert paths[str(tmp_path / "ws")] == "rw"
    assert "/usr" in paths and "/etc" not in paths  # /etc is split around its secrets
    assert "/etc/passwd" in paths and "/etc/shadow" not in paths and "/etc/sessiond" not in paths
    assert not any(p.startswith(str(tmp_path / "state")) for p in paths)
    assert "/proc" not in paths and "/proc/cpuinfo" in paths  # no /proc/<pid> without a PID namespace
    assert plan.tmp == str(tmp_path / "ws" / ".tmp")


def test_with_namespaces_proc_and_tmp_are_the_sandboxes_own(tmp_path: Path) -> None:
    plan = _plan(tmp_path, namespaces=True, network="loopback")
    paths = dict(plan.landlock_paths())
    assert paths["/proc"] == "ro" and paths["/tmp"] == "rw" and plan.tmp == "/tmp"
    argv = plan.bwrap_argv()
    assert "--unshare-pid" in argv and "--unshare-net" in argv and "--die-with-parent" in argv
    assert argv[argv.index("--bind") + 1] == str(tmp_path / "ws")
    shadow = argv.index("/etc/shadow") if "/etc/shadow" in argv else None
    if shadow is not None:  # masked, not bound
        assert argv[shadow - 1] == "/dev/null"
    assert plan.effective_network == "loopback"


def test_loopback_without_namespaces_falls_back_to_none_and_says_so(tmp_path: Path) -> None:
    plan = _plan(tmp_path, namespaces=False, network="loopback")
    assert plan.effective_network == "none"
    assert "network-loopback" in plan.describe()["inactive"]
    assert plan.host_config()["network"] == "none"


def test_full_network_keeps_the_hosts_network_namespace(tmp_path: Path) -> None:
    assert "--unshare-net" not in _plan(tmp_path, namespaces=True, network="full").bwrap_argv()


def test_mode_off_means_no_plan(tmp_path: Path) -> None:
    settings = SessionSettings(sandbox=SandboxSettings(mode="off"))
    assert sandbox.plan_for(m.SandboxBoot(namespaces=True), settings, tmp_path, False) is None
    assert sandbox.plan_for(None, SessionSettings(), tmp_path, False) is None


def test_a_session_may_narrow_the_network_and_nothing_else_of_the_sandbox() -> None:
    base = SessionSettings(sandbox=SandboxSettings(network="loopback"))
    assert resolve_overrides(base, {"sandbox.network": "none"}).settings.sandbox.network == "none"
    with pytest.raises(OverrideError, match="sandbox.network"):
        resolve_overrides(base, {"sandbox.network": "full"})
    for key, value in (("mode", "off"), ("namespaces", "off"), ("read_paths", ["/"])):
        with pytest.raises(OverrideError, match=f"sandbox.{key}"):
            resolve_overrides(base, {f"sandbox.{key}": value})


def test_what_a_plan_reports_follows_what_the_daemon_found(tmp_path: Path) -> None:
    settings = SessionSettings()
    without = sandbox.plan_for(m.SandboxBoot(namespaces=False, why_not="no bwrap"), settings, tmp_path, False)
    assert without is not None
    report = without.describe()
    assert "landlock" in report["inactive"] and report["inactive"]["namespaces"] == "no bwrap"
    found = sandbox.plan_for(m.SandboxBoot(namespaces=True, landlock_abi=6), settings, tmp_path, False)
    assert found is not None and {"landlock", "namespaces"} <= set(found.describe()["active"])
    off = SessionSettings(sandbox=SandboxSettings(namespaces="off"))
    chosen = sandbox.plan_for(m.SandboxBoot(namespaces=True, landlock_abi=6), off, tmp_path, False)
    assert chosen is not None and not chosen.namespaces
    assert chosen.describe()["inactive"]["namespaces"] == "sandbox.namespaces = off"


def test_tools_fail_closed_where_the_configured_isolation_cannot_be_built(tmp_path: Path) -> None:
    """Issue 21: a daemon whose bubblewrap could not make namespaces ran
    every tool under Landlock alone, as if the operator had chosen it."""
    no_bwrap = m.SandboxBoot(namespaces=False, why_not="bubblewrap (bwrap) is not installed", landlock_abi=7)
    plan = sandbox.plan_for(no_bwrap, SessionSettings(), tmp_path, False)
    assert plan is not None
    assert "bubblewrap (bwrap) is not installed" in plan.why_refused
    assert '[sandbox] namespaces = "off"' in plan.why_refused and 'mode = "off"' in plan.why_refused
    assert plan.describe()["refused"] == plan.why_refused
    # The operator's explicit weaker choice runs them, under Landlock and seccomp.
    chosen = SessionSettings(sandbox=SandboxSettings(namespaces="off"))
    plan = sandbox.plan_for(no_bwrap, chosen, tmp_path, False)
    assert plan is not None and plan.why_refused == "" and "refused" not in plan.describe()
    # No Landlock: only mode = "off" runs tools.
    no_landlock = m.SandboxBoot(namespaces=True, landlock_abi=0)
    plan = sandbox.plan_for(no_landlock, chosen, tmp_path, False)
    assert plan is not None and "Landlock" in plan.why_refused and 'mode = "off"' in plan.why_refused
    assert sandbox.plan_for(no_landlock, SessionSettings(sandbox=SandboxSettings(mode="off")), tmp_path,
                            False) is None


def test_without_a_mount_namespace_no_unix_socket_and_the_report_says_why(tmp_path: Path) -> None:
    boot = m.SandboxBoot(namespaces=True, landlock_abi=7)
    with_ns = sandbox.plan_for(boot, SessionSettings(sandbox=SandboxSettings(network="full")), tmp_path, False)
    assert with_ns is not None and with_ns.describe()["socket_families"] == ["unix", "inet", "inet6"]
    assert "unix_sockets" not in with_ns.describe()
    off = SessionSettings(sandbox=SandboxSettings(namespaces="off"))
    plan = sandbox.plan_for(boot, off, tmp_path, False)
    assert plan is not None
    report = plan.describe()
    assert report["socket_families"] == [] and "connect()" in report["unix_sockets"]
    program = bytes.fromhex(plan.host_config()["seccomp"])
    assert _run(program, SOCKET, AF["unix"]) == EACCES and _run(program, SOCKETPAIR, AF["unix"]) == ALLOW


def test_a_tool_hosts_stderr_reaches_the_log_escaped_tagged_and_within_a_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 21: 200,000 forged lines reached the daemon's log in 5 s."""
    errors = sandbox._HostErrors()
    errors.ready = True
    with caplog.at_level(logging.WARNING, logger="sessiond.sandbox"):
        for _ in range(100):
            errors._feed(b"\r\x1b[2Ksessiond[1]: INFO: forged\n" * 2000)
        errors._feed(b"x" * (1 << 20))  # one endless line: cut, and counted in the same budget
        errors.note_dropped()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) <= 64 + 2, len(said)
    assert sum(len(s) for s in said) < 64 * 500
    assert all(not any(c in s for c in "\r\n\x1b") for s in said), said[:3]
    assert said[0] == r"tool host: \r\x1b[2Ksessiond[1]: INFO: forged", said[0]
    assert any("199936 lines dropped" in s for s in said), said[-2:]


def test_socket_directories_are_masked_inside_a_broad_read_path(tmp_path: Path) -> None:
    """A read-only bind still lets a tool connect() to a Unix socket in it:
    /run, /var/lib, /var/tmp, /tmp never come along with a read path."""
    plan = _plan(tmp_path, namespaces=True, read_paths=["/var"])
    argv = plan.bwrap_argv()
    masked = {argv[i + 1] for i, a in enumerate(argv) if a == "--tmpfs"}
    assert {"/var/lib", "/var/tmp"} <= masked and "/run" not in argv, argv
    assert "/var/run" not in argv or not Path("/var/run").is_symlink()
    paths = dict(_plan(tmp_path, namespaces=False, read_paths=["/var"]).landlock_paths())
    assert "/var/cache" in paths and "/var" not in paths
    assert not any(p.startswith(("/var/lib", "/var/tmp", "/var/run", "/run")) for p in paths), paths
    # Where no root holds them, nothing changes.
    assert "/var/lib" not in _plan(tmp_path, namespaces=True).bwrap_argv()


def test_a_read_path_under_tmp_or_a_socket_directory_is_bound_on_top_never_a_guarded_one(tmp_path: Path) -> None:
    """Listed, it is meant: a read path under /tmp (the private tmpfs) or a
    masked socket directory is bound again after the masks (it was hidden:
    an MCP server's checkout under /tmp never reached its sandbox).  One
    that holds or lies in the daemon's own paths or a secret stays masked."""
    listed = tmp_path / "models"
    listed.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    plan = _plan(tmp_path, namespaces=True, read_paths=[str(listed), str(state / "x"), str(tmp_path), "/etc/ssl"])
    argv = plan.bwrap_argv()
    tmpfs = max(i for i, a in enumerate(argv) if a == "/tmp" and argv[i - 1] == "--tmpfs")
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind" and i > tmpfs]
    assert str(listed) in binds, argv
    assert str(tmp_path) not in binds and str(state / "x") not in binds, binds  # hold / lie in `hide`
    assert "/etc/ssl" not in binds  # not under a masked directory: bound once, with the roots


def test_the_report_names_what_the_kernels_landlock_adds_and_what_it_lacks(tmp_path: Path) -> None:
    def report(abi: int) -> dict[str, object]:
        plan = sandbox.plan_for(m.SandboxBoot(namespaces=True, landlock_abi=abi), SessionSettings(), tmp_path, False)
        assert plan is not None
        return plan.describe()

    assert {"landlock", "landlock-scope", "landlock-net"} <= set(report(7)["active"])  # type: ignore[arg-type]
    old = report(3)
    assert "landlock-scope" in old["inactive"] and "landlock-net" in old["inactive"], old  # type: ignore[operator]


def test_a_file_in_read_paths_is_bound_and_a_socket_is_refused(tmp_path: Path) -> None:
    """A read path may be one file (a tool's config, a key it may read):
    bound alone, read-only (it used to be left out without a word); one
    that is neither a file nor a directory is refused at config check."""
    import socket

    from supervisor.config import ConfigError, parse_config

    listed = str(Path(__file__).resolve())  # a file outside /usr and /tmp
    argv = _plan(tmp_path, namespaces=True, read_paths=[listed]).bwrap_argv()
    assert any(argv[i:i + 3] == ["--ro-bind", listed, listed] for i in range(len(argv))), argv
    assert (listed, "ro") in _plan(tmp_path, namespaces=False, read_paths=[listed]).landlock_paths()
    sock_path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        with pytest.raises(ConfigError, match=r"sandbox.read_paths\[1\].*neither a directory nor a file"):
            parse_config({"sandbox": {"read_paths": [listed, str(sock_path)]}}, "c.toml")
