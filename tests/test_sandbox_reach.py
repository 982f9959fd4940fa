"""What a session's tool starts with and can reach (issue 21): descriptors,
the daemon's log, Unix sockets outside the workspace, socket families, and
what happens where the configured isolation cannot be built.

Driven like the hostile-tool suite (tests/test_sandbox.py): a scripted fake
LLM makes a session run `bash`, in each sandbox set-up."""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
from pathlib import Path

import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import wait_for
from ipc import messages as m
from test_access import NOBODY, open_root, root_only  # noqa: F401 (fixture)
from test_agent_e2e import agent_config, tool_results
from test_sandbox import ROOT_TOOLS, SETUPS, _key_and_bwrap, run_tool  # noqa: F401 (fixture)

pytestmark = [pytest.mark.process, root_only]

INHERITED_FD = 7
SECRET = "root-only-secret-4711"


def start(make_daemon, llm: FakeLLM, root: Path, setup: str, extra: str = "", prefix: list[str] | None = None):
    """A daemon in one of test_sandbox's set-ups (or ROOT_TOOLS: a root
    daemon whose tools run as root, as the harness's trusting config has
    it); `prefix` runs before it, as root."""
    sandbox_keys, as_nobody = SETUPS.get(setup, ("", False))
    d = make_daemon(agent_config(llm, f"[sandbox]\n{sandbox_keys}\n{extra}"), start=False, root=root / "d",
                    trust=setup == ROOT_TOOLS)
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


@pytest.mark.parametrize("setup", ["root-uid-per-session", ROOT_TOOLS, "user-namespaces", "landlock-only",
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


# ---------------------------------------------------------------- the daemon's log

FORGED = "sessiond[1]: INFO: forged-by-a-tool"
# Write 200,000 lines (each trying to start a fresh line of the daemon's)
# into every descriptor the tool inherited beyond 0, 1, 2 (under uvloop, a
# copy of the host's stderr was among them) and every copy of the host's
# stderr it can open through /proc: its own host's and bubblewrap's init's.
FLOOD = r"""
import os
chunk = ("\r\x1b[2K%s\n" % FORGED).encode() * 100000
fds = []
for fd in range(3, 1024):
    try:
        os.fstat(fd)
        fds.append((fd, "fd %d" % fd))
    except OSError:
        pass
def parent(pid):
    with open("/proc/%d/status" % pid) as f:
        return int(next(line for line in f if line.startswith("PPid:")).split()[1])
# Every ancestor up to the host (the bash that reads the tool's command
# holds the tool's own output as its stderr: not the host's, not counted).
own = os.fstat(2)
pid, ancestors = os.getpid(), []
while pid > 1:
    try:
        pid = parent(pid)
    except OSError:  # (a /proc that shows no other process)
        break
    ancestors.append(pid)
for pid in dict.fromkeys([*ancestors, 1]):
    try:
        fd = os.open("/proc/%d/fd/2" % pid, os.O_WRONLY | os.O_APPEND)
    except OSError:
        continue
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
        os.close(fd)  # our own stderr, through an ancestor's table
        continue
    fds.append((fd, "host stderr of %d" % pid))
for fd, what in fds:
    view = memoryview(chunk)
    try:
        while view:
            view = view[os.write(fd, view):]
        print("REACHED", what)
    except OSError:
        pass
print("FLOODED")
""".replace("FORGED", repr(FORGED))
LOG_BOUND_BYTES = 64 << 10  # 64 lines of 400 characters, tags and notes: well below


@pytest.mark.parametrize("setup", ["root-uid-per-session", ROOT_TOOLS, "user-namespaces", "landlock-only"])
def test_what_a_tool_host_writes_to_the_log_is_bounded_escaped_and_tagged(
    make_daemon, llm: FakeLLM, open_root: Path, setup: str
) -> None:
    d = start(make_daemon, llm, open_root, setup)
    with d.client() as c:
        sid = c.create(session="flooder").id
    run_tool(d, llm, sid, "true", {})  # the host is up; what it logged at start is not the flood's
    before = d.log_path.stat().st_size
    llm.script(tool_call_stream(("w", "write_file", {"path": "flood.py", "content": FLOOD})),
               text_stream("written"))
    with d.client() as c:
        assert c.send_text(sid, "prepare") == "written"
    out = run_tool(d, llm, sid, "python3 flood.py", {})
    assert "FLOODED" in out, out
    # The host is non-dumpable: its /proc/PID/fd is not the tool's to open
    # (bubblewrap's init never was).  Had it been, the budget holds.
    reached = re.findall(r"^REACHED (.*)$", out, re.M)
    assert not reached, out
    # The other session's turn (and so the loop) goes on; the log has settled.
    with d.client() as c:
        other = c.create(session="other", handler="echo").id
        assert c.send_text(other, "ping") == "1: ping"
    grown = d.log_path.read_bytes()[before:]
    assert len(grown) < LOG_BOUND_BYTES, (reached, len(grown))
    lines = grown.decode(errors="replace").splitlines()
    forged = [line for line in lines if "forged-by-a-tool" in line]
    assert len(forged) <= 64, len(forged)
    for line in forged:
        # Marked as the session's, the tool's control characters written out.
        assert f"session={sid} tool host: " in line and "\r" not in line and "\x1b" not in line, line
        assert not line.startswith(FORGED), line


# ---------------------------------------------------------------- fail closed


@pytest.fixture
def failing_bwrap(open_root: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A bubblewrap that cannot make namespaces (the shipped unit's
    RestrictNamespaces=yes, or a kernel without user namespaces), where a
    session's uid can run it."""
    bin_dir = open_root / "bin"
    bin_dir.mkdir(mode=0o755)
    (bin_dir / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    (bin_dir / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return "No permissions to create new namespace"


def test_without_namespaces_tools_do_not_run_unless_the_operator_says_so(
    make_daemon, llm: FakeLLM, open_root: Path, failing_bwrap: str
) -> None:
    d = start(make_daemon, llm, open_root, "root-uid-per-session")
    with d.client() as c:
        sid = c.create(session="closed").id
        report = dict(c.status(sid).sandbox)
    out = run_tool(d, llm, sid, "echo RAN", {})
    assert "RAN" not in out, out
    assert "tools do not run" in out and failing_bwrap in out and '[sandbox] namespaces = "off"' in out, out
    assert failing_bwrap in report["refused"] and "namespaces" in report["inactive"], report
    stats = json.loads(d.ctl("--json", "stats").stdout)["sandbox"]
    assert stats["tools"] == "refused" and failing_bwrap in stats["refused"], stats
    assert report["tools"] == "refused"
    assert "tools do not run" in d.ctl("stats").stdout
    assert "tools do not run" in d.log and failing_bwrap in d.log
    # The operator's explicit weaker choice: Landlock and seccomp, no namespaces.
    d = start(make_daemon, llm, open_root / "2", "root-uid-per-session", extra='namespaces = "off"')
    with d.client() as c:
        sid = c.create(session="chosen").id
    out = run_tool(d, llm, sid, "echo RAN", {})
    assert "RAN" in out and "[exit code: 0]" in out, out
    with d.client() as c:
        report = dict(c.status(sid).sandbox)
    assert {"landlock", "seccomp", "no_new_privs"} <= set(report["active"]) and report["tools"] == "run", report
    assert "namespaces" not in report["active"] and report["socket_families"] == [], report
    stats = json.loads(d.ctl("--json", "stats").stdout)["sandbox"]
    assert stats["tools"] == "run" and "unix-sockets" in stats["why_not"], stats


# ---------------------------------------------------------------- sockets

# From the tool: connect to each Unix socket given (a path, or @name for an
# abstract one), then try to create a socket of each family; one verdict a line.
SOCKET_PROBE = r"""
import errno, socket, sys
for target in sys.argv[1:]:
    address = "\0" + target[1:] if target.startswith("@") else target
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(3)
        s.connect(address)
        print("CONNECTED", target)
    except OSError as exc:
        print("REFUSED", target, errno.errorcode.get(exc.errno, exc.errno))
for name, family, kind in (("inet", 2, 2), ("inet6", 10, 2), ("unix", 1, 1), ("netlink", 16, 3),
                           ("packet", 17, 3), ("alg", 38, 5), ("vsock", 40, 1)):
    try:
        socket.socket(family, kind).close()
        print("FAMILY", name, "ok")
    except OSError as exc:
        print("FAMILY", name, errno.errorcode.get(exc.errno, exc.errno))
socket.socketpair()
print("SOCKETPAIR ok")
"""


@pytest.fixture
def planted_sockets() -> list[str]:
    """World-writable Unix sockets outside any workspace, listening: under
    /run and /var/tmp (where the store's, Ray's or a metrics socket live)
    and an abstract one."""
    tag = f"sd-planted-{os.getpid()}"
    made, out = [], []
    for path in (f"/run/{tag}.sock", f"/var/tmp/{tag}.sock", f"@{tag}"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\0" + path[1:] if path.startswith("@") else path)
        if not path.startswith("@"):
            os.chmod(path, 0o777)
        s.listen(64)
        made.append(s)
        out.append(path)
    yield out
    for s, path in zip(made, out):
        s.close()
        if not path.startswith("@"):
            os.unlink(path)


@pytest.mark.parametrize("setup,network,read_paths", [
    ("root-uid-per-session", "none", []), ("root-uid-per-session", "full", []),
    # A broad read path: the socket directories inside it stay out.
    ("root-uid-per-session", "full", ["/var"]), ("user-namespaces", "none", []),
    ("landlock-only", "none", []), ("landlock-only", "full", ["/var"]), (ROOT_TOOLS, "full", []),
    ("control-sandbox-off", "none", []),
])
def test_no_unix_socket_outside_the_session_and_only_allowed_families(
    make_daemon, llm: FakeLLM, open_root: Path, planted_sockets: list[str], setup: str, network: str,
    read_paths: list[str],
) -> None:
    d = start(make_daemon, llm, open_root, setup, extra=f'network = "{network}"\nread_paths = {json.dumps(read_paths)}')
    with d.client() as c:
        sid = c.create(session="prober").id
    llm.script(tool_call_stream(("w", "write_file", {"path": "probe.py", "content": SOCKET_PROBE})),
               text_stream("written"))
    with d.client() as c:
        assert c.send_text(sid, "prepare") == "written"
    targets = [*planted_sockets, str(d.socket)]
    out = run_tool(d, llm, sid, "python3 probe.py " + " ".join(targets), {})
    connected = re.findall(r"^CONNECTED (\S+)$", out, re.M)
    families = dict(re.findall(r"^FAMILY (\S+) (\S+)$", out, re.M))
    assert "SOCKETPAIR ok" in out and len(families) == 7, out
    if setup == "control-sandbox-off":
        # Unconfined: the probes reach what they aim at, so they test something.
        assert set(connected) == set(targets) and families["vsock"] != "EACCES", out
        return
    assert connected == [], out
    allowed = ({"unix"} if setup != "landlock-only" else set()) | ({"inet", "inet6"} if network == "full" else set())
    for name, verdict in families.items():
        # EACCES is the filter's answer (the kernel's own would be EPERM or EAFNOSUPPORT).
        assert (verdict == "ok") == (name in allowed) and (verdict == "ok" or verdict == "EACCES"), (name, out)


CUSTOM_TOOL = '''
import asyncio, sys


async def child_fds(note: str) -> str:
    """What a subprocess a custom tool starts (asyncio's, so uvloop's) inherits."""
    probe = "import os\\nfor n in range(1024):\\n    try:\\n        os.fstat(n)\\n        print('OPEN', n)\\n    except OSError:\\n        pass\\n"
    proc = await asyncio.create_subprocess_exec("/usr/bin/python3", "-c", probe, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return out.decode()
'''


def test_a_custom_tools_subprocess_does_not_get_what_the_daemon_inherited(
    make_daemon, llm: FakeLLM, open_root: Path, root_only_file: Path
) -> None:
    """Custom tools run in the worker, unsandboxed (the operator's code), and
    spawn as they like: the worker marks what it inherited close-on-exec.
    (uvloop's child still holds extra copies of its own stdin, stdout and
    stderr above 2: uvloop's doing, and nothing of the daemon's.)"""
    (open_root / "lib" / "spawn_tools.py").write_text(CUSTOM_TOOL)
    (open_root / "lib" / "spawn_tools.py").chmod(0o644)
    prefix = ["sh", "-c", f'exec {INHERITED_FD}<"$0"; exec "$@"', str(root_only_file)]
    d = start(make_daemon, llm, open_root, "root-uid-per-session",
              extra='[tools]\ncustom = ["spawn_tools:child_fds"]\n', prefix=prefix)
    with d.client() as c:
        sid = c.create(session="custom").id
    llm.script(tool_call_stream(("t1", "child_fds", {"note": "x"})), text_stream("done"))
    with d.client() as c:
        events = list(c.send(sid, "go"))
    assert isinstance(events[-1], m.TurnDone), events[-1]
    out = tool_results(llm.requests[-1].json)[-1]
    opened = {int(n) for n in re.findall(r"OPEN (\d+)", out)}
    assert {0, 1, 2} <= opened and INHERITED_FD not in opened, out
