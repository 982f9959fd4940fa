"""A cgroup v1 session's kill (supervisor.spawn.cgroups_v1.CgroupsV1.kill),
its decision alone, on a directory laid out as the kernel's: when the
members are still listed once the kill's time is up, the kernel's OOM
killer is handed the cgroup only if one of them could not be sent our
SIGKILL.  Members killed and still exiting (a busy machine; a process
freeing hundreds of MiB) go by themselves.  The finding: under load, the
unit-emulation suite (tests/test_hostile_unit.py) read a slow exit as
"the daemon's kills did not land".  The real kill, on real v1
hierarchies: tests/test_cgroups_v1.py."""

from __future__ import annotations

import errno
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from supervisor.spawn import cgroups_v1
from supervisor.spawn.cgroups_v1 import CgroupsV1

pytestmark = pytest.mark.component


def _session(tmp_path: Path) -> dict[str, Path]:
    """A session's cgroups as the kernel lays them out; its one member (this
    test's own pid, never really signalled) stays listed: it exits slowly."""
    dirs = {}
    for ctrl in ("memory", "pids", "freezer"):
        cg = tmp_path / ctrl / "sessiond" / "d-1-2" / "u-1000" / "s-x"
        cg.mkdir(parents=True)
        (cg / "cgroup.procs").write_text(f"{os.getpid()}\n")
        dirs[ctrl] = cg
    (dirs["memory"] / "memory.oom_control").write_text("1")
    (dirs["freezer"] / "freezer.state").write_text("THAWED")
    return dirs


@pytest.mark.parametrize("refused", [False, True], ids=["sent-but-exiting", "refused"])
def test_the_oom_killer_is_the_fallback_only_for_a_member_our_kill_could_not_reach(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, refused: bool) -> None:
    sent: list[int] = []

    def send(fd: int, sig: int) -> None:
        assert sig == signal.SIGKILL
        if refused:  # (no CAP_KILL)
            raise PermissionError(errno.EPERM, "Operation not permitted")
        sent.append(fd)

    monkeypatch.setattr(cgroups_v1.signal, "pidfd_send_signal", send)
    dirs = _session(tmp_path)
    with caplog.at_level(logging.WARNING):
        CgroupsV1({c: tmp_path / c for c in dirs}).kill("x", where=dirs)
    handed_over = (dirs["memory"] / "memory.oom_control").read_text().strip() == "0"
    said = "processes outlived the kill" in caplog.text
    if refused:
        assert handed_over and said
    else:
        assert sent and not handed_over and not said


def test_a_dead_daemons_tree_cleaned_by_two_starting_daemons_at_once_stops_neither(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two daemons starting at the same moment both clean a dead daemon's
    directory; the one whose walk met a directory the other had just
    removed raised FileNotFoundError and started without cgroups (seen in
    the suite, daemons starting side by side: `no cgroup per session:
    cannot set up a cgroup v1 per session (...): No such file or directory`)."""
    stale = tmp_path / "pids" / "sessiond" / "d-999999999-2"
    for uid, sid in (("u-1000", "s-a"), ("u-1001", "s-b"), ("u-1002", "s-c")):
        (stale / uid / sid).mkdir(parents=True)
    real_scandir = os.scandir
    taken: list[str] = []

    def scandir(path: Any) -> Any:
        name = os.path.basename(os.fspath(path))
        if name.startswith("u-") and not taken:  # the other daemon, meanwhile, takes the other users'
            for other in real_scandir(stale):
                if other.name != name:
                    for s in real_scandir(other.path):
                        os.rmdir(s.path)
                    os.rmdir(other.path)
                    taken.append(other.name)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    ours = CgroupsV1({"pids": tmp_path / "pids"})
    ours.setup()
    monkeypatch.undo()
    assert len(taken) == 2 and not stale.exists() and ours.base["pids"].is_dir()
