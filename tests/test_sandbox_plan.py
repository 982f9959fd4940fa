"""The sandbox's plan, without starting anything: which paths, which filter,
which bubblewrap arguments, and what a session may override."""

from __future__ import annotations

import errno
import struct
from pathlib import Path

import pytest

from ipc import messages as m
from ipc.settings import SandboxSettings, SessionSettings
from session_worker import _seccomp, sandbox
from supervisor.overrides import OverrideError, resolve_overrides

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


def test_only_network_none_refuses_inet_sockets() -> None:
    def socket_checks(network: str) -> int:
        return sum(1 for code, _, _, k in _decode(_seccomp.build(network, machine="x86_64"))
                   if code == 0x15 and k == 41)

    assert socket_checks("none") == 1
    assert socket_checks("loopback") == socket_checks("full") == 0


def test_jumps_stay_inside_the_program() -> None:
    for network in ("none", "full"):
        ins = _decode(_seccomp.build(network, machine="x86_64"))
        for i, (code, jt, jf, _) in enumerate(ins):
            if code & 0x07 == 0x05:  # a jump
                assert i + 1 + max(jt, jf) < len(ins), (network, i)
        assert all(code == 0x06 for code, *_ in ins[-1:])


def test_other_machines_say_why_there_is_no_filter() -> None:
    assert "aarch64" in _seccomp.unsupported("aarch64")
    with pytest.raises(_seccomp.UnsupportedArch):
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
