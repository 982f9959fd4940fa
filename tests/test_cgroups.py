"""A cgroup v2 per session, on a real cgroup2 hierarchy.

This host's memory and pids controllers are bound to cgroup v1 (tested in
test_cgroups_v1.py), so a cgroup2 mount here has neither: what is tested for real is the part that
needs none (the layout, each worker placed before Boot, cgroup.kill ending
a session's processes however they left its tree, the cgroup removed with
the session) and that the daemon says what it could not enable.  The
fallback (no delegated cgroup v2: rlimits, the sweep, the tool host) is
what every other test runs on.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import FAST_CONFIG
from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import wait_for
from test_access import root_only
from test_agent_e2e import agent_config

pytestmark = [pytest.mark.process, root_only]


@pytest.fixture
def delegated() -> Iterator[Path]:
    """A cgroup of the cgroup2 hierarchy for the daemon, as Delegate=yes gives one."""
    mnt = Path(tempfile.mkdtemp(prefix="sd-cg2-"))
    subprocess.run(["mount", "-t", "cgroup2", "none", str(mnt)], check=True)
    ours = mnt / f"sessiond-test-{os.getpid()}"
    ours.mkdir()
    try:
        yield ours
    finally:
        for cg in sorted(ours.rglob("cgroup.kill"), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                cg.write_text("1")
        wait_for(lambda: not any((d / "cgroup.procs").read_text().strip()
                                 for d in [ours, *[p for p in ours.rglob("*") if p.is_dir()]]),
                 10, "the test cgroup to empty")
        for d in sorted([p for p in ours.rglob("*") if p.is_dir()], key=lambda p: -len(p.parts)):
            d.rmdir()
        ours.rmdir()
        subprocess.run(["umount", str(mnt)], check=True)
        mnt.rmdir()


def _escapees() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0] == "sessiond-cg-escapee"]


def test_each_session_lives_in_its_own_cgroup_and_dies_whole(
    delegated: Path, make_daemon, llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `delegated` first: set up before the daemon, torn down after it.
    monkeypatch.setenv("SESSIOND_TEST_KEY", "k")
    # The sandbox off: what contains the escapee here is the cgroup alone.
    d = make_daemon(agent_config(llm, '[sandbox]\nmode = "off"\n'), start=False)
    d.preexec = lambda: (delegated / "cgroup.procs").write_text(str(os.getpid()))
    d.start()
    assert "a cgroup v2 per session" in d.log, d.log
    assert (delegated / "daemon" / "cgroup.procs").read_text().split()  # daemon and zygote in the leaf
    with d.client() as c:
        sid = c.create(session="contained").id
        worker = c.status(sid).pid
        (cg,) = (delegated / "sessions").glob(f"u-*/s-{sid}")  # under its owner's uid
        assert str(worker) in (cg / "cgroup.procs").read_text().split()
        assert "cgroup-kill" in c.status(sid).sandbox["active"]
    cmd = "(setsid bash -c 'exec -a sessiond-cg-escapee sleep 300' &) ; echo LAUNCHED"
    llm.script(tool_call_stream(("t", "bash", {"command": cmd})), text_stream("done"))
    with d.client() as c:
        assert c.send_text(sid, "go") == "done"
    (escapee,) = wait_for(_escapees, 5, "the escapee to start")
    assert str(escapee.pid) in (cg / "cgroup.procs").read_text().split()
    # It left the worker's tree (re-parented to the zygote, the subreaper):
    assert escapee.ppid() != worker
    with d.client() as c:
        c.stop(sid)
    wait_for(lambda: not _escapees(), 10, "the escapee to die with its session's cgroup")
    with d.client() as c:
        c.remove(sid)
    wait_for(lambda: not cg.exists(), 10, "the session's cgroup to be removed")


def test_without_a_delegated_cgroup_the_daemon_says_what_holds_instead(make_daemon) -> None:
    d = make_daemon(FAST_CONFIG + 'cgroups = "off"\n')
    assert "no cgroup per session" in d.log and "memory sweep" in d.log, d.log
