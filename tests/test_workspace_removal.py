"""Removing a workspace the daemon may not open up (a unit without
CAP_FOWNER/CAP_DAC_OVERRIDE, a tree another uid locked): the removal fails
once with the reason, never recursing until Python gives up."""

from __future__ import annotations

import os
import pwd
import tempfile
from pathlib import Path

import pytest

from supervisor.host.workspaces import rmtree as _rmtree

pytestmark = pytest.mark.process


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a tree another uid cannot open")
def test_a_tree_that_cannot_be_opened_up_fails_with_its_reason() -> None:
    nobody = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="sd-rmtree-"))
    os.chmod(base, 0o755)
    os.chown(base, nobody.pw_uid, nobody.pw_gid)
    locked = base / "locked"
    locked.mkdir(mode=0o700)  # root's, closed to nobody
    (locked / "f").write_text("x")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child, as nobody: what a daemon without the capabilities meets
        os.close(r)
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            _rmtree(base)
            outcome = "removed"
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            outcome = type(exc).__name__
        os.write(w, outcome.encode())
        os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            outcome = f.read().decode()
        os.waitpid(pid, 0)
        assert outcome == "PermissionError", outcome
        assert (locked / "f").exists()
    finally:
        import shutil
        shutil.rmtree(base)
