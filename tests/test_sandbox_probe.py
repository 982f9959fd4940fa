"""The daemon's start-up probe of bubblewrap (supervisor.spawn.sandbox)
binds what its /bin/true needs, as a tool's sandbox binds the system's
directories, never the whole root: with `--ro-bind / /` bubblewrap remounts
every mount of the host read-only one by one, and one going away meanwhile
(another daemon's workspace image unmounted, seen in `make test`: "Can't
bind mount /oldroot/ on /newroot/: ... remount ...: No such file or
directory") failed the probe and turned the daemon's tools off for its life."""

from __future__ import annotations

import shutil

import pytest

from supervisor.spawn import sandbox


@pytest.mark.component
def test_the_probe_binds_the_system_directories_not_the_root_and_passes() -> None:
    roots = sandbox.probe_roots()
    bound = [roots[i + 1] for i, arg in enumerate(roots) if arg in ("--ro-bind", "--bind")]
    assert "/" not in bound and "/tmp" not in bound
    assert "/usr" in bound or "/usr" in roots  # what /bin/true runs from
    bwrap = shutil.which("bwrap")
    assert bwrap is not None, "bubblewrap is missing: make system-deps installs it"
    assert sandbox._try_bwrap(bwrap, None, None) == ""
