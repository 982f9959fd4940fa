"""What a session's tool starts with and can reach (issue 21): descriptors,
the daemon's log, Unix sockets outside the workspace, socket families, and
what happens where the configured isolation cannot be built.

Driven like the hostile-tool suite (tests/test_sandbox.py): a scripted fake
LLM makes a session run `bash`, in each sandbox set-up."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import wait_for
from ipc import messages as m
from test_access import NOBODY, open_root, root_only  # noqa: F401 (fixture)
from test_agent_e2e import agent_config, tool_results
from test_sandbox import SETUPS, _key_and_bwrap, run_tool  # noqa: F401 (fixture)

pytestmark = [pytest.mark.process, root_only]

INHERITED_FD = 7
SECRET = "root-only-secret-4711"


def start(make_daemon, llm: FakeLLM, root: Path, setup: str, extra: str = "", prefix: list[str] | None = None):
    sandbox_keys, as_nobody = SETUPS[setup]
    d = make_daemon(agent_config(llm, f"[sandbox]\n{sandbox_keys}\n{extra}"), start=False, root=root / "d")
    if as_nobody:
        d.run_as_user(NOBODY, NOBODY)
    d.cmd_prefix = [*(prefix or []), *d.cmd_prefix]
    d.start()
    return d


@pytest.fixture
def root_only_file() -> Path:
    fd, name = tempfile.mkstemp(prefix="sd-rootonly-")
    os.write(fd, SECRET.encode())
    os.close(fd)
    os.chmod(name, 0o600)
    yield Path(name)
    os.unlink(name)


# Every open descriptor of a process the tool starts (by fstat: without a
# mount namespace /proc/self/fd is out of Landlock's reach), then a read
# of the inherited one by its number.
FD_PROBE = (
    "python3 -c 'import os\n"
    "def is_open(n):\n    try:\n        os.fstat(n)\n        return True\n    except OSError:\n        return False\n"
    "print(\"FDS\", *[n for n in range(min(os.sysconf(\"SC_OPEN_MAX\"), 1 << 16)) if is_open(n)])'\n"
    f"if cat <&{INHERITED_FD}; then echo READ-INHERITED; fi\n"
)


@pytest.mark.parametrize("setup", ["root-uid-per-session", "user-namespaces", "landlock-only",
                                   "control-sandbox-off"])
def test_a_tool_starts_with_stdin_stdout_stderr_only(
    make_daemon, llm: FakeLLM, open_root: Path, root_only_file: Path, setup: str
) -> None:
    # The daemon inherits an open root-only file (a careless service
    # manager or shell); no tool may reach it.
    prefix = ["sh", "-c", f'exec {INHERITED_FD}<"$0"; exec "$@"', str(root_only_file)]
    d = start(make_daemon, llm, open_root, setup, prefix=prefix)
    with d.client() as c:
        sid = c.create(session="fds").id
    out = run_tool(d, llm, sid, FD_PROBE, {})
    assert re.search(r"^FDS 0 1 2$", out, re.M), out
    assert SECRET not in out and "READ-INHERITED" not in out, out
