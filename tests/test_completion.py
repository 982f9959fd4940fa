"""Shell completion and the man page, both generated from sessionctl's
argparse definitions: every subcommand is in them, the scripts parse, and
bash completes session ids from a running daemon."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import env_for_children
from supervisor.ctl.completion import bash_script, commands, man_page, zsh_script
from supervisor.ctl.cli import _parser

SUBCOMMANDS = [c.name for c in commands(_parser())]


@pytest.mark.pure
def test_the_man_page_and_scripts_mention_every_subcommand() -> None:
    assert {"create", "send", "top", "history", "logs", "export", "import", "completion"} <= set(SUBCOMMANDS)
    page = man_page(_parser())
    bash, zsh = bash_script(_parser()), zsh_script(_parser())
    for name in SUBCOMMANDS:
        assert f"\n.SS {name}\n" in page, name
        assert f"        {name})\n" in bash, name
        assert f"'{name}:" in zsh and f"    {name})\n" in zsh, name
    assert page.startswith(".TH SESSIONCTL 1 ")
    for section in ("NAME", "SYNOPSIS", "OPTIONS", "COMMANDS", "EXAMPLES", "EXIT STATUS", "ENVIRONMENT"):
        assert f"\n.SH {section}\n" in page
    assert "\\-\\-limit" in page and "no such session" in page


def sessionctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.ctl", *args], capture_output=True, text=True,
                          env=env_for_children(), timeout=30)


@pytest.mark.process
def test_the_generated_scripts_parse_in_their_shells(tmp_path) -> None:
    bash = sessionctl("completion", "bash")
    assert bash.returncode == 0
    (tmp_path / "c.bash").write_text(bash.stdout)
    checked = subprocess.run(["bash", "-n", str(tmp_path / "c.bash")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    zsh = sessionctl("completion", "zsh")
    assert zsh.returncode == 0 and zsh.stdout.startswith("#compdef sessionctl")
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed: its script was generated, not parsed")
    (tmp_path / "_sessionctl").write_text(zsh.stdout)
    checked = subprocess.run(["zsh", "-n", str(tmp_path / "_sessionctl")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.process
def test_bash_completes_commands_options_and_session_ids_from_the_daemon(make_daemon, tmp_path) -> None:
    d = make_daemon()
    with d.client() as c:
        c.create(session="alpha")
        c.create(session="beta")
    (tmp_path / "c.bash").write_text(sessionctl("completion", "bash").stdout)
    # `sessionctl` on PATH as the completion function calls it.
    shim = tmp_path / "bin" / "sessionctl"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m supervisor.ctl \"$@\"\n")
    shim.chmod(0o755)

    def complete(*words: str) -> list[str]:
        line = " ".join(["sessionctl", *words])
        script = (f"source {tmp_path / 'c.bash'}\n"
                  f"COMP_WORDS=(sessionctl {' '.join(repr(w) for w in words)}); COMP_CWORD={len(words)}\n"
                  f"COMP_LINE={line!r}\n_sessionctl\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
        env = env_for_children() | {"PATH": f"{shim.parent}:/usr/bin:/bin"}
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)
        assert done.returncode == 0, done.stderr
        return sorted(w for w in done.stdout.split("\n") if w)

    assert complete("hi") == ["history"]
    assert complete("--socket", str(d.socket), "status", "") == ["alpha", "beta"]
    assert complete("--socket", str(d.socket), "logs", "a") == ["alpha"]
    assert complete("logs", "alpha", "--f") == ["--follow"]
    assert complete("top", "--sort", "r") == ["restarts", "rss"]
    assert complete("completion", "") == ["bash", "zsh"]


@pytest.mark.process
def test_bash_completes_session_ids_when_sessionctl_is_not_on_path(make_daemon, tmp_path) -> None:
    """The README runs `.venv/bin/sessionctl`; the script used to call a
    bare `sessionctl` for the ids, which is not on PATH there."""
    d = make_daemon()
    with d.client() as c:
        c.create(session="gamma")
    venv_bin = Path(sys.prefix) / "bin"
    assert (venv_bin / "sessionctl").exists()
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(sys.prefix)
    generated = subprocess.run([str(venv_bin / "sessionctl"), "completion", "bash"], capture_output=True,
                               text=True, env=env_for_children(), timeout=30)
    assert generated.returncode == 0 and generated.stdout, generated.stderr
    (tmp_path / "c.bash").write_text(generated.stdout)

    def complete(command: str) -> list[str]:
        script = (f"source {tmp_path / 'c.bash'}\n"
                  f"COMP_WORDS=({command} status ''); COMP_CWORD=2\n"
                  f"_sessionctl\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
        env = env_for_children() | {"PATH": "/usr/bin:/bin", "SESSIOND_SOCKET": str(d.socket)}
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=work,
                              timeout=30)
        assert done.returncode == 0, done.stderr
        return sorted(w for w in done.stdout.split("\n") if w)

    assert complete(".venv/bin/sessionctl") == ["gamma"]  # as typed
    assert complete("sessionctl") == ["gamma"]  # not on PATH: the one that wrote the script
