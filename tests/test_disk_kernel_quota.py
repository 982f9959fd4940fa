"""max_disk_mb where the kernel enforces it (issue 21): on btrfs with
quotas enabled, each workspace is a subvolume with a qgroup limit, so a
write past the cap fails with EDQUOT at once (a `fallocate` of 300 MiB in a
20 MiB workspace takes no block) and the session goes on; without quotas
the kernel's cap is an image per workspace (tests/test_disk_images.py),
which says why not a qgroup; and the walk (`disk_quota = "measured"`)
counts subvolumes made inside a workspace.

A real btrfs (mkfs.btrfs on a loop device, mounted by the test as root),
a real root daemon with per-session uids and namespaces, the session's bash
driven through the scripted LLM.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import wait_for
from test_access import open_root, root_only  # noqa: F401 (fixture)
from test_agent_e2e import agent_config, tool_results

pytestmark = [pytest.mark.process, root_only]


def _btrfs(quota: bool) -> Iterator[Path]:
    mkfs = shutil.which("mkfs.btrfs")
    assert mkfs and shutil.which("btrfs"), "btrfs-progs is missing: apt-get install btrfs-progs (make test does, as root)"
    assert os.path.exists("/dev/loop-control"), "a btrfs for the test needs loop devices (/dev/loop-control)"
    where = Path(tempfile.mkdtemp(prefix="sd-btrfs-"))
    image, mnt = where / "fs.img", where / "fs"
    try:
        with open(image, "wb") as f:
            f.truncate(256 << 20)
        subprocess.run([mkfs, "-q", str(image)], check=True, capture_output=True)
        mnt.mkdir()
        subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True, capture_output=True, text=True)
        try:
            if quota:
                subprocess.run(["btrfs", "quota", "enable", str(mnt)], check=True, capture_output=True)
            os.chmod(where, 0o711)
            os.chmod(mnt, 0o711)
            yield mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=False, capture_output=True)
            if os.path.ismount(mnt):
                subprocess.run(["umount", "--lazy", str(mnt)], check=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def quota_fs() -> Iterator[Path]:
    yield from _btrfs(quota=True)


@pytest.fixture
def plain_fs() -> Iterator[Path]:
    yield from _btrfs(quota=False)


@pytest.fixture(autouse=True)
def _key_and_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-operator-key-0001")
    assert shutil.which("bwrap"), "bubblewrap is missing: apt-get install bubblewrap (make test does, as root)"


def _daemon(make_daemon, llm: FakeLLM, open_root: Path, fs: Path, mode: str = "auto"):
    extra = f'[tools]\nworkspace_dir = "{fs}/ws"\ndisk_quota = "{mode}"\n[agent.limits]\nmax_disk_mb = 20\n'
    d = make_daemon(agent_config(llm, extra), start=False, root=open_root / "d", trust=False)
    d.start()
    return d


def _run(d, llm: FakeLLM, sid: str, command: str) -> str:
    llm.script(tool_call_stream(("t1", "bash", {"command": command})), text_stream("done"))
    with d.client() as c:
        list(c.send(sid, "go"))
    return tool_results(llm.requests[-1].json)[-1]


def _used(fs: Path) -> int:
    st = os.statvfs(fs)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_on_btrfs_with_quotas_the_kernel_refuses_writes_past_the_cap(
    make_daemon, llm: FakeLLM, open_root: Path, quota_fs: Path
) -> None:
    d = _daemon(make_daemon, llm, open_root, quota_fs)
    with d.client() as c:
        assert c.stats().sandbox["disk_quota"].startswith("kernel"), c.stats().sandbox
        sid = c.create(session="filler").id
    before = _used(quota_fs)
    out = _run(d, llm, sid, "fallocate -l 300M big; echo rc=$?; "
                            "dd if=/dev/zero of=slow bs=1M count=40 conv=fsync 2>&1 | head -1; "
                            "btrfs subvolume create sub 2>&1; echo rc=$?")
    # The fallocate takes nothing; dd stops at the cap; a subvolume of the
    # tool's own (a qgroup outside the cap) is refused by the seccomp filter.
    assert "Disk quota exceeded" in out and "rc=1" in out, out
    assert "Operation not permitted" in out, out
    assert _used(quota_fs) - before < 40 << 20, "the filesystem took more than the cap"
    with d.client() as c:
        info = c.status(sid)
        # A full workspace, not a killed session: the turn ended, the session goes on.
        assert info.state == "idle" and info.last_exit is None, info
        (workspace,) = (quota_fs / "ws").glob("filler@*")
        assert workspace.stat().st_ino == 256, "the workspace is not a subvolume"
        c.remove(sid)
    wait_for(lambda: not workspace.exists(), 10, "the workspace subvolume to be destroyed")


def test_without_quotas_the_walk_measures_and_counts_a_subvolume_inside(
    make_daemon, llm: FakeLLM, open_root: Path, plain_fs: Path
) -> None:
    d = _daemon(make_daemon, llm, open_root, plain_fs, "measured")
    with d.client() as c:
        text = c.stats().sandbox["disk_quota"]
        assert text.startswith("measured") and 'disk_quota = "measured"' in text, text
        sid = c.create(session="nested").id
        wait_for(lambda: c.status(sid).disk_bytes is not None, 10, "the first walk")
    # A subvolume made inside the workspace by code outside the sandbox (a
    # handler's own): another st_dev, which the walk used to step over.
    (workspace,) = (plain_fs / "ws").glob("nested@*")
    subprocess.run(["btrfs", "subvolume", "create", str(workspace / "sub")], check=True, capture_output=True)
    subprocess.run(["fallocate", "-l", "60M", str(workspace / "sub" / "big")], check=True)
    with d.client() as c:
        wait_for(lambda: c.status(sid).state == "stopped", 15, "the session to be stopped")
        info = c.status(sid)
        assert info.last_exit is not None and info.last_exit.reason == "killed_disk", info.last_exit
        c.remove(sid)
    wait_for(lambda: not workspace.exists(), 10, "the workspace and the subvolume in it to be removed")


def test_a_workspace_cap_is_set_again_and_lifted(quota_fs: Path) -> None:
    """Workspaces sets the cap at every start (a changed max_disk_mb takes
    effect at the next one); None lifts it."""
    from supervisor.host import btrfs

    btrfs.make_workspace(str(quota_fs), "ws@0")
    ws = quota_fs / "ws@0"

    def fill(name: str, mib: int) -> bool:
        try:
            subprocess.run(["fallocate", "-l", f"{mib}M", str(ws / name)], check=True, capture_output=True)
        except subprocess.CalledProcessError as exc:
            assert b"Disk quota exceeded" in exc.stderr, exc.stderr
            return False
        return True

    btrfs.set_limit(str(ws), 8 << 20)
    assert not fill("a", 16)
    btrfs.set_limit(str(ws), 32 << 20)
    assert fill("a", 16) and not fill("b", 24)
    btrfs.set_limit(str(ws), None)
    assert fill("b", 24)
    (quota_fs / "plain").mkdir()  # a workspace made before quotas were on
    with pytest.raises(OSError, match="not a subvolume"):
        btrfs.set_limit(str(quota_fs / "plain"), 1 << 20)
    assert btrfs.destroy(str(quota_fs), "ws@0") and not ws.exists()


def test_without_quotas_a_workspace_image_holds_and_stats_says_why_no_qgroup(
    make_daemon, llm: FakeLLM, open_root: Path, plain_fs: Path
) -> None:
    d = _daemon(make_daemon, llm, open_root, plain_fs)
    with d.client() as c:
        text = c.stats().sandbox["disk_quota"]
        assert text.startswith("kernel: an ext4 image") and "btrfs quota enable" in text, text
