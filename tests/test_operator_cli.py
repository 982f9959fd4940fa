"""The two commands as a new user first meets them: --version, --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness import env_for_children
from supervisor import __version__

pytestmark = pytest.mark.process


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=env_for_children(), timeout=30)


@pytest.mark.parametrize("module, name", [("supervisor.ctl", "sessionctl"), ("supervisor.cli", "sessiond")])
def test_version_and_help_with_examples_and_exit_codes(module: str, name: str) -> None:
    r = _run(module, "--version")
    assert r.returncode == 0 and r.stdout == f"{name} {__version__}\n", r
    r = _run(module, "--help")
    assert r.returncode == 0
    assert "examples:" in r.stdout and f"\n  {name} " in r.stdout
    assert "exit codes:" in r.stdout and "2  usage" in r.stdout


def test_sessionctl_help_lists_every_exit_code_of_the_contract() -> None:
    out = _run("supervisor.ctl", "--help").stdout
    for code, meaning in ((0, "done"), (1, "failed"), (2, "usage"), (3, "cannot reach the daemon"),
                          (4, "no such session")):
        assert any(line.strip().startswith(f"{code}  ") and meaning in line for line in out.splitlines()), code
