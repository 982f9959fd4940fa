"""The README's (and every page of docs/'s) commands and TOML, run as printed.

The pages read are README.md, ARCHITECTURE.md and docs/*.md, in that order
(the README's "First session" creates the session later examples use), so a
block that moves from the README to a page of docs/ stays tested.
Every fenced `sh`/`console` block's command lines are either run here (the
`sessiond config …` and `sessionctl …` lines, against a daemon this test
starts, and `make …` as `make -n …`) or listed in NOT_RUN with the reason,
so a new command in the README is either tested or consciously exempted.
Every `toml` block parses and passes `sessiond config check`."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import FAST_CONFIG
from harness import REPO, Daemon, env_for_children

pytestmark = pytest.mark.process

README = REPO / "README.md"
# Every page a reader walks from the README; a missing one (a renamed page)
# fails the extraction test below rather than silently testing less.
PAGES = [README, REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").glob("*.md"))]
# The venv the suite runs in holds the scripts the README names as .venv/bin/….
VENV = Path(sys.prefix)

# Commands printed in the README that a test cannot run here, with why.
NOT_RUN = {
    "sudo systemd/install.sh": "installs into / as root; tests/test_systemd_units.py stages it into a temp root",
    "sudo systemctl enable --now sessiond.socket": "needs systemd as PID 1",
    "RAY_health_check_period_ms=1000 RAY_health_check_failure_threshold=3 ray start --head --port=6379 "
    "--disable-usage-stats": "starts Ray for good; tests/ray_cluster.py starts the same on loopback addresses",
    "ray start --address=HEAD:6379 --resources='{\"sessiond_slots\": 50}' --disable-usage-stats":
        "needs a Ray head; tests/ray_cluster.py starts nodes so",
    "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/etc/sessiond/ray-token   # on every machine":
        "the environment of the ray start commands; tests/ray_cluster.py sets the same (RayCluster.auth_env)",
    "sudo install -m 644 sessionctl.bash /etc/bash_completion.d/sessionctl":
        "installs into /etc as root; the line before it writes the file, and is run",
}
# TOML blocks that only a real provider key could check: none today (an unset
# api_key_env variable is a warning, not an error). Name them here by their
# first line if one ever needs it.
NEEDS_PROVIDER_KEY: set[str] = set()
# The example id of the "First session" transcript, replaced by the real one.
EXAMPLE_ID = "3f2a9c1d7b4e"


@dataclass
class Command:
    line: str
    expected: list[str] = field(default_factory=list)  # transcript output (console blocks)


@dataclass
class Block:
    lang: str
    body: str
    lineno: int
    page: str = "README.md"
    before: str = ""  # the last non-empty line above the fence ("prints" announces a python block's output)


def fenced_blocks(text: str, page: str = "README.md") -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if m is None:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i + 1
        before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        body: list[str] = []
        i += 1
        while not re.match(rf"^{indent}```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        blocks.append(Block(lang, "\n".join(body) + "\n", start, page, before))
        i += 1
    return blocks


def commands(blocks: list[Block]) -> list[Command]:
    found: list[Command] = []
    for block in blocks:
        if block.lang == "sh":
            found += [Command(line) for line in block.body.splitlines() if line and not line.startswith("#")]
        elif block.lang == "console":
            for line in block.body.splitlines():
                if line.startswith("$ "):
                    found.append(Command(line[2:]))
                else:
                    found[-1].expected.append(line)
    return found


BLOCKS = [b for page in PAGES if page.exists()
          for b in fenced_blocks(page.read_text(), str(page.relative_to(REPO)))]
COMMANDS = commands(BLOCKS)
TOML_BLOCKS = [b for b in BLOCKS if b.lang == "toml"]
# Python blocks, each with the output the page says it prints (None: not said).
PYTHON_BLOCKS = [(b, after.body if after.lang == "text" and after.before == "prints" else None)
                 for b, after in zip(BLOCKS, [*BLOCKS[1:], Block("", "", 0)]) if b.lang == "python"]
# Files a page shows before the commands and TOML that read them: a JSON
# block introduced as a `.mcp.json` (docs/agent.md) is that file, beside
# the config and in the commands' directory.
COMPANIONS = {".mcp.json": b.body for b in BLOCKS if b.lang == "json" and ".mcp.json" in b.before}
# A command whose output a page sends into a file (`> f`, `| tee f`).
_INTO_A_FILE = re.compile(r"(?<![<>&2])>(?!&)|\|\s*(sudo\s+)?tee\b")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory where `.venv/bin/…` means the suite's venv, as it means
    the checkout's venv to a reader in the checkout."""
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(VENV)
    for name, body in COMPANIONS.items():
        (work / name).write_text(body)
    return work


def run(line: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_the_readme_has_the_commands_this_test_expects() -> None:
    # The extraction itself: an empty list would make the tests below vacuous.
    lines = [c.line for c in COMMANDS]
    assert "make run" in lines and "make test" in lines
    assert any(line.startswith("make run CONFIG=") for line in lines)
    assert any(line.startswith(".venv/bin/sessionctl send ") for line in lines)
    assert any(line.startswith(".venv/bin/sessiond config check ") for line in lines)
    assert len(TOML_BLOCKS) >= 5
    for page in PAGES:
        assert page.exists(), f"{page} is gone: update PAGES (and the README's contents)"
    assert ".mcp.json" in COMPANIONS, "docs/agent.md's Claude Code .mcp.json block"
    # The pages the cluster and agent blocks moved to are read too.
    assert {b.page for b in TOML_BLOCKS} >= {"README.md", "docs/agent.md", "docs/cluster.md"}
    for exempt in NOT_RUN:
        assert exempt in lines, f"NOT_RUN names {exempt!r}, which no page prints any more"


@pytest.mark.timeout(300)  # every documented command in turn: 12 s at rest, past a minute beside 8 busy loops
def test_readme_commands_run_as_printed(tmp_path: Path, workdir: Path) -> None:
    for name in ("sessiond", "sessionctl"):
        assert (VENV / "bin" / name).exists(), f"{VENV}/bin/{name} is missing: run `make .venv/.installed`"
    daemon = Daemon(tmp_path / "daemon", FAST_CONFIG)
    try:
        daemon.start()
        env = {**env_for_children(), "SESSIOND_SOCKET": str(daemon.socket)}
        created: str | None = None
        ran = 0
        for cmd in COMMANDS:
            line = cmd.line
            if line in NOT_RUN:
                continue
            if line.startswith("make "):
                # What make would run, without running a daemon in the foreground.
                done = subprocess.run(["make", "-n", *shlex.split(line)[1:]], cwd=REPO, env=env,
                                      capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, (line, done.stderr)
                if line.startswith("make run"):
                    config = re.search(r"CONFIG=(\S+)", line)
                    want = ".venv/bin/sessiond run" + (f' --config "{config.group(1)}"' if config else "")
                    assert want in done.stdout.splitlines(), (line, done.stdout)
            elif line.startswith((".venv/bin/sessionctl ", ".venv/bin/sessiond config ", ".venv/bin/sessiond mcp ")):
                if created is not None:
                    line = line.replace(EXAMPLE_ID, created)
                done = run(line, workdir, env)
                assert done.returncode == 0, (line, done.stdout, done.stderr)
                if _INTO_A_FILE.search(line):
                    # An empty file would mean the command printed nothing.
                    target = workdir / shlex.split(line.split(">")[-1])[0]
                    assert target.stat().st_size > 0, (line, done.stderr)
                if line == ".venv/bin/sessionctl create":
                    created = done.stdout.strip()
                    assert re.fullmatch(r"[0-9a-f]{12}", created), done.stdout
                if cmd.expected:
                    # The transcript's shape: as many lines, each starting with
                    # the same word (pids and sizes differ from run to run).
                    expected = [e.replace(EXAMPLE_ID, created or EXAMPLE_ID) for e in cmd.expected]
                    actual = done.stdout.splitlines()
                    assert [a.split()[:1] for a in actual] == [e.split()[:1] for e in expected], (line, actual)
            else:
                raise AssertionError(f"documented command {line!r} is neither run here nor listed in NOT_RUN")
            ran += 1
        assert ran >= 7
        # `sessiond config default > config.toml` wrote a config that checks.
        assert tomllib.loads((workdir / "config.toml").read_text())
        for block, prints in PYTHON_BLOCKS:
            _run_python_block(block, prints, workdir, env)
        assert created is not None
        _the_log_lines_look_as_documented(daemon, created)
        _an_export_holds_what_the_page_says(daemon, workdir, env)
    finally:
        daemon.cleanup()
    daemon.assert_no_leftovers()


@pytest.mark.parametrize("block", TOML_BLOCKS, ids=lambda b: f"{b.page}:{b.lineno}")
def test_readme_toml_parses_and_passes_config_check(tmp_path: Path, block: Block) -> None:
    data = tomllib.loads(block.body)
    assert data
    first = block.body.splitlines()[0]
    if first in NEEDS_PROVIDER_KEY:
        pytest.skip("needs a real provider key")
    config = tmp_path / "config.toml"
    config.write_text(block.body)
    for name, body in COMPANIONS.items():
        (tmp_path / name).write_text(body)
    env = {k: v for k, v in env_for_children().items() if not k.endswith("_API_KEY")}
    done = subprocess.run([str(VENV / "bin" / "sessiond"), "config", "check", str(config)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (block.body, done.stdout, done.stderr)
    assert done.stdout.startswith(f"{config}: ok"), done.stdout


def _run_python_block(block: Block, prints: str | None, workdir: Path, env: dict[str, str]) -> None:
    """As printed: the block is the whole program (its sessions on the test's
    daemon).  The README's blocks say what they print, and print exactly that
    (a snippet once printed `2: stream meidle`, and its `main()` never ran)."""
    if block.page == "README.md":
        assert prints is not None, f"README.md:{block.lineno}: say what the block prints (a `prints` text block)"
    script = workdir / f"snippet_{block.lineno}.py"
    script.write_text(block.body)
    done = subprocess.run([sys.executable, str(script)], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, (block.page, block.lineno, done.stderr)
    if prints is not None:
        assert done.stdout == prints, (block.page, block.lineno, done.stdout)


def _the_log_lines_look_as_documented(daemon: Daemon, session: str) -> None:
    """docs/operations.md shows a log line about a session; the daemon's
    (here in its plain format: the time and level before it) has that shape."""
    text = (REPO / "docs" / "operations.md").read_text()
    example = re.search(r"`(?:<\d>)?([\w.]+: session=)" + EXAMPLE_ID + r" (\w+)[^`]*`", text)
    assert example, "docs/operations.md shows no log line about a session"
    line = f"{example.group(1)}{session} {example.group(2)} "
    assert line in daemon.log, (line, daemon.log[-2000:])


def _an_export_holds_what_the_page_says(daemon: Daemon, workdir: Path, env: dict[str, str]) -> None:
    """docs/operations.md lists the fields every export has; a new session's
    export has exactly those (the rest are left out when empty)."""
    text = (REPO / "docs" / "operations.md").read_text()
    span = re.search(r"The export is one JSON document: `([^`]*)`", text)
    assert span, "docs/operations.md no longer says what an export holds"
    documented = set(re.findall(r'"([a-z_]+)"\s*[:,}]', span.group(1)))
    with daemon.client() as c:
        sid = c.create(handler="echo").id
    done = run(f".venv/bin/sessionctl export {sid}", workdir, env)
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)) == documented, (documented, done.stdout)


def test_commands_that_write_a_file_name_a_command_that_runs_as_printed() -> None:
    """`sessionctl … > f` (or `| sudo tee f`) with a bare `sessionctl` that
    is not on PATH (it is in .venv/bin) writes an empty file and, in a
    pipe, exits 0: every such line on every page names the command by its
    path, in any block."""
    bare = []
    for block in BLOCKS:
        for line in block.body.splitlines():
            line = line.removeprefix("$ ")
            if _INTO_A_FILE.search(line) and re.match(r"(sudo\s+)?(sessionctl|sessiond)\b", line):
                bare.append(f"{block.page}:{block.lineno}: {line}")
    assert not bare, bare
