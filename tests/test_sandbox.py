"""The hostile-tool suite: a prompt-injected agent's `bash`, against the sandbox.

From inside one session's tool, try everything issue 11 lists: the
daemon's environ, another session's workspace and log, the control socket,
/etc/shadow, the daemon's config, a planted symlink, a path through
/proc/self/root, the network under `network = "none"`, signalling the
daemon and the worker, mounting, new namespaces, keyrings; then fork 2,000
children and allocate past the cap.  Each attempt must fail, the session
survive or die as documented, the other session keep answering, and nothing
be left behind.

Run in three set-ups: a root daemon on its defaults (a uid per session,
bubblewrap namespaces), a daemon of an unprivileged user (one uid for all,
namespaces through user namespaces), and the same without namespaces
(Landlock, seccomp and the rest: what the hardened systemd unit gets).  The
unprivileged set-up also runs with the sandbox off, as the control: the
same probes must leak there, or they would prove nothing.  Which mechanisms
were active is printed for each set-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import wait_for
from ipc import messages as m
from test_access import NOBODY, open_root, root_only  # noqa: F401 (fixture)
from test_agent_e2e import agent_config, tool_results

# A tool script here ends in an argument of its own (sandbox-bomb, sandbox-hog,
# sandbox-pages), which the tests look for among all of the machine's processes:
# test_hostile_unit runs the same scripts, perhaps at the same time (make test -n 3).
pytestmark = [pytest.mark.process, root_only]

SECRET = "victim-secret-0815"


@pytest.fixture(autouse=True)
def _key_and_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-operator-key-0001")
    assert shutil.which("bwrap"), "bubblewrap is missing: apt-get install bubblewrap (make test does, as root)"

# name -> shell test that succeeds only if the attack worked.
PROBES = {
    "daemon-environ": 'grep -q SESSIOND_TEST_KEY "/proc/$DPID/environ"',
    "worker-environ": 'grep -q SESSIOND_TEST_KEY "/proc/$WPID/environ"',
    "worker-mem": 'head -c1 "/proc/$WPID/mem"',
    "other-workspace": 'grep -q "$SECRET" "$VICTIM_WS/secret.txt"',
    "other-workspace-listing": 'ls "$VICTIM_WS" | grep -q secret',
    "state-dir": 'ls "$STATE/sessions" | grep -q victim',
    "other-log": 'grep -rqa "$SECRET" "$STATE/sessions/victim"',
    "control-socket": 'python3 "$WS_TOOLS/drive_daemon.py" "$SOCK"',
    "daemon-config": 'grep -q provider "$CONFIG"',
    "etc-shadow": "grep -q root /etc/shadow",
    "planted-symlink": 'ln -sf "$VICTIM_WS/secret.txt" planted && grep -q "$SECRET" planted',
    "proc-self-root": 'grep -q "$SECRET" "/proc/self/root$VICTIM_WS/secret.txt"',
    "network": ('python3 -c "import socket,sys; socket.create_connection((\'127.0.0.1\', int(sys.argv[1])), 3)" '
                '"$LLM_PORT"'),
    "signal-daemon": 'kill -0 "$DPID"',
    "signal-worker": 'kill -0 "$WPID"',
    "mount": "mkdir -p mnt && mount -t tmpfs none mnt",
    "user-namespace": "unshare -U true",
    "keyring": 'python3 -c "import ctypes,sys; l=ctypes.CDLL(None); sys.exit(l.syscall(250,0,-3,0,0,0)<0)"',
}
# What must stay possible: the session's own workspace and /tmp.
SANITY = "echo inside > own.txt && grep -q inside own.txt && echo tmp > \"${TMPDIR:-/tmp}/t\" && echo SANE"

# Leaks the control run (sandbox off, one uid for daemon and workers) must
# show, so the probes above demonstrably test something.
CONTROL_LEAKS = {
    "other-workspace", "other-workspace-listing", "state-dir", "other-log",
    "daemon-config", "planted-symlink", "proc-self-root", "network", "signal-daemon", "signal-worker",
    "user-namespace", "keyring",
}


# Speaks the control protocol with the standard library only (no msgspec in
# the sandbox): Hello, then ls; succeeds only if the daemon lists sessions.
DRIVE_DAEMON = r"""
import socket, struct, sys
def s(x):
    b = x.encode()
    return bytes([0xA0 | len(b)]) + b
def frame(body):
    return struct.pack(">I", len(body)) + body
hello = b"\x83" + s("type") + s("hello") + s("protocol") + b"\x01" + s("client") + s("x")
ls = b"\x82" + s("type") + s("ls") + s("id") + b"\x01"
c = socket.socket(socket.AF_UNIX)
c.settimeout(5)
c.connect(sys.argv[1])
c.sendall(frame(hello) + frame(ls))
got = b""
while True:
    chunk = c.recv(65536)
    if not chunk:
        break
    got += chunk
    if b"sessions" in got:
        sys.exit(0)
sys.exit(1)
"""


def attack_script() -> str:
    lines = ['t() { if (eval "$2") >/dev/null 2>&1; then echo "LEAK:$1"; else echo "SAFE:$1"; fi; }']
    lines += [f"t {name} {shell_quote(cmd)}" for name, cmd in PROBES.items()]
    lines.append(SANITY)
    return "\n".join(lines)


def shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


SETUPS = {
    # name: (sandbox TOML, run the daemon as nobody?)
    "root-uid-per-session": ("", False),
    "user-namespaces": ("", True),
    "landlock-only": ('namespaces = "off"', True),
    "control-sandbox-off": ('mode = "off"', True),
}
# Root's own tools ([daemon] allow_root_tools, as the harness's trusting
# config sets): namespaces, but RLIMIT_NPROC never holds root.
ROOT_TOOLS = "root-tools"


def make(make_daemon, llm: FakeLLM, open_root: Path, setup: str, limits: str = ""):
    sandbox, as_nobody = SETUPS.get(setup, ("", False))
    extra = f"[sandbox]\n{sandbox}\n[agent.limits]\nmemory_poll_interval_ms = 50\n{limits}"
    d = make_daemon(agent_config(llm, extra), start=False, root=open_root / "d", trust=setup == ROOT_TOOLS)
    if as_nobody:
        d.run_as_user(NOBODY, NOBODY)
    d.start()
    return d


def mechanisms(d, sid: str) -> dict:
    with d.client() as c:
        return dict(c.status(sid).sandbox)


def show(setup: str, report: dict, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print(f"\n[sandbox {setup}] active: {', '.join(report.get('active', [])) or 'none'}; "
              f"inactive: {report.get('inactive') or 'none'}; network: {report.get('network', '-')}")


def run_tool(d, llm: FakeLLM, sid: str, command: str, env: dict[str, str]) -> str:
    prelude = "".join(f"export {k}={shell_quote(v)}\n" for k, v in env.items())
    llm.script(tool_call_stream(("t1", "bash", {"command": prelude + command})), text_stream("done"))
    with d.client() as c:
        events = list(c.send(sid, "go"))
    assert isinstance(events[-1], m.TurnDone), events[-1]
    return tool_results(llm.requests[-1].json)[-1]


def victim_with_secret(d, llm: FakeLLM) -> str:
    llm.script(tool_call_stream(("w", "write_file", {"path": "secret.txt", "content": SECRET})),
               text_stream("stored"))
    with d.client() as c:
        victim = c.create(session="victim").id
        assert c.send_text(victim, f"remember {SECRET}") == "stored"
    return victim


@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_hostile_tool_reaches_nothing_outside_its_session(
    make_daemon, llm: FakeLLM, open_root: Path, setup: str, capsys: pytest.CaptureFixture[str]
) -> None:
    d = make(make_daemon, llm, open_root, setup)
    victim = victim_with_secret(d, llm)
    with d.client() as c:
        attacker = c.create(session="attacker").id
        worker = c.status(attacker).pid
    env = {
        "DPID": str(d.pid), "WPID": str(worker), "SECRET": SECRET, "VICTIM_WS": str(d.workspace(victim)),
        "STATE": str(d.state_dir), "SOCK": str(d.socket), "CONFIG": str(d.config_path),
        "LLM_PORT": str(llm.base_url.rsplit(":", 1)[1].split("/")[0]),
    }
    # The attacker brings its own client, written into its workspace.
    llm.script(tool_call_stream(("w", "write_file", {"path": "drive_daemon.py", "content": DRIVE_DAEMON})),
               text_stream("written"))
    with d.client() as c:
        assert c.send_text(attacker, "prepare") == "written"
    env["WS_TOOLS"] = str(d.workspace(attacker))
    # The client works from outside a session (the daemon refuses session
    # peers, sandbox or not: that layer is test_security_socket's).
    driver = subprocess.run([sys.executable, str(d.workspace(attacker) / "drive_daemon.py"), str(d.socket)],
                            timeout=30, check=False)
    assert driver.returncode == 0
    out = run_tool(d, llm, attacker, attack_script(), env)
    report = mechanisms(d, attacker)
    show(setup, report, capsys)
    results = {name: verdict for verdict, name in re.findall(r"^(LEAK|SAFE):(\S+)$", out, re.M)}
    assert set(results) == set(PROBES), out
    assert "SANE" in out, out
    leaks = {name for name, verdict in results.items() if verdict == "LEAK"}
    if setup == "control-sandbox-off":
        assert report == {}
        assert CONTROL_LEAKS <= leaks, f"the probes prove nothing: {sorted(CONTROL_LEAKS - leaks)} held\n{out}"
        return
    assert not leaks, f"{setup}: {sorted(leaks)} reached\n{out}"
    active = set(report["active"])
    assert {"tool-host", "landlock", "seccomp", "no_new_privs"} <= active, report
    assert ("namespaces" in active) == (setup != "landlock-only"), report
    # The other session still answers, and so does the attacker.
    with d.client() as c:
        assert c.status(victim).state in ("idle", "hibernated")
    llm.script(text_stream("still here"))
    with d.client() as c:
        assert c.send_text(victim, "are you there?") == "still here"


@pytest.mark.parametrize("setup", ["root-uid-per-session", "user-namespaces", "landlock-only", ROOT_TOOLS])
def test_a_fork_bomb_stays_inside_its_session(
    make_daemon, llm: FakeLLM, open_root: Path, setup: str
) -> None:
    d = make(make_daemon, llm, open_root, setup, "max_processes = 64\n")
    with d.client() as c:
        other = c.create(session="other", handler="echo").id
        bomber = c.create(session="bomber").id
    bomb = (
        'python3 -c "\nimport os, signal\nn = 0\nfor _ in range(2000):\n'
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        signal.pause()\n        os._exit(0)\n    n += 1\n"
        "print('FORKED', n)\n\" sandbox-bomb; echo BOMB-DONE"
    )
    llm.script(tool_call_stream(("b", "bash", {"command": bomb})), text_stream("bombed"))
    with d.client() as c:
        events = list(c.send(bomber, "go"))
        # Meanwhile, and after, the other session answers.
        assert c.send_text(other, "ping") == "1: ping"
    last = events[-1]
    if setup == "landlock-only":
        # One uid for every session, no user namespace and (not root) no
        # cgroup: the kernel cannot count per session, so the sweep counts
        # and kills.  (Root's own tools: the session's cgroup v1 pids.max.)
        assert isinstance(last, m.TurnFailed) or any(
            isinstance(e, m.LimitExceeded) and e.kind == "processes" for e in events), events
        with d.client() as c:
            wait_for(lambda: c.status(bomber).last_exit is not None, 10, "the bomber's worker to be killed")
            assert c.status(bomber).last_exit.reason == "killed_processes"
    else:
        assert isinstance(last, m.TurnDone), last
        out = tool_results(llm.requests[-1].json)[-1]
        forked = int(re.search(r"FORKED (\d+)", out).group(1))
        assert forked < 64, out  # the kernel refused the rest (RLIMIT_NPROC or pids.max per session)
    with d.client() as c:
        assert c.send_text(other, "again") == "2: again"
        c.remove(bomber)
    wait_for(lambda: not _sleepers(), 10, "every forked child to be gone")


def _sleepers() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd[:2] == ["python3", "-c"] and cmd[-1] == "sandbox-bomb":
            out.append(p)
    return out


@pytest.mark.parametrize("setup", ["root-uid-per-session", "landlock-only"])
def test_memory_past_the_cap_kills_the_session_and_spares_the_others(
    make_daemon, llm: FakeLLM, open_root: Path, setup: str
) -> None:
    d = make(make_daemon, llm, open_root, setup, "max_memory_mb = 96\n")
    with d.client() as c:
        other = c.create(session="other", handler="echo").id
        hog = c.create(session="hog").id
    grab = 'python3 -c "import signal; b = b\'x\' * (400 << 20); signal.pause()" sandbox-hog; echo UNREACHED'
    llm.script(tool_call_stream(("g", "bash", {"command": grab})), text_stream("hogged"))
    with d.client() as c:
        events = list(c.send(hog, "go"))
        assert any(isinstance(e, m.LimitExceeded) and e.kind == "memory" for e in events), events
        wait_for(lambda: c.status(hog).last_exit is not None, 10, "the hog's worker to be killed")
        assert c.status(hog).last_exit.reason == "killed_memory"
        assert c.send_text(other, "ping") == "1: ping"
        c.remove(hog)
    wait_for(lambda: not [p for p in psutil.process_iter(["cmdline"])
                          if "sandbox-hog" in (p.info["cmdline"] or [])], 10, "the hog to be gone")


@pytest.mark.parametrize("setup", ["root-uid-per-session", "landlock-only"])
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_daemonized_tool_dies_with_its_session(
    make_daemon, llm: FakeLLM, open_root: Path, setup: str, how: str
) -> None:
    """setsid plus a double fork used to re-parent a tool to the zygote and
    survive stop and rm.  Now, with namespaces, it is in the session's PID
    namespace; without, the tool host adopts it (subreaper) and kills it
    when the worker stops, or the zygote does when the worker is killed."""
    d = make(make_daemon, llm, open_root, setup)
    with d.client() as c:
        sid = c.create(session="daemonizer").id
    out = run_tool(d, llm, sid, "(setsid bash -c 'exec -a sessiond-escapee sleep 300' &) ; echo LAUNCHED", {})
    assert "LAUNCHED" in out
    escapees = lambda: [p for p in psutil.process_iter(["cmdline"])  # noqa: E731
                        if (p.info["cmdline"] or [""])[0] == "sessiond-escapee"]
    wait_for(lambda: escapees(), 5, "the escapee to start")
    with d.client() as c:
        if how == "stop":
            c.stop(sid)
        else:
            os.kill(c.status(sid).pid, signal.SIGKILL)
    wait_for(lambda: not escapees(), 5, "the escapee to die with its session")


def test_a_per_session_override_may_only_narrow_the_network(make_daemon, llm: FakeLLM, open_root: Path) -> None:
    d = make_daemon(agent_config(llm, '[sandbox]\nnetwork = "loopback"\n'), root=open_root / "d", trust=False)
    r = d.ctl("create", "--set", 'sandbox.network="full"')
    assert r.returncode == 2 and "sandbox.network" in r.stderr and "loopback" in r.stderr, r
    r = d.ctl("create", "--set", 'sandbox.mode="off"')
    assert r.returncode == 2 and "sandbox.mode" in r.stderr, r
    r = d.ctl("--json", "create", "--id", "narrowed", "--set", 'sandbox.network="none"')
    assert r.returncode == 0, r
    with d.client() as c:
        assert c.status("narrowed").sandbox["network"] == "none"
        # Without an override, the operator's policy is the session's.
        assert c.status(c.create(session="plain").id).sandbox["network"] == "loopback"
    # Daemon-wide: what this host gives every session, and why not the rest.
    stats = json.loads(d.ctl("--json", "stats").stdout)["sandbox"]
    assert stats["mode"] == "auto" and stats["namespaces"] is True and stats["seccomp"] is True
    # A root daemon on this cgroup v1 host: a cgroup per session, named.
    assert stats["landlock_abi"] >= 1 and "cgroup v1" in stats["cgroups"], stats
    assert "memory" in stats["cgroups"] and "pids" in stats["cgroups"], stats
    text = d.ctl("stats").stdout
    assert "sandbox (auto): namespaces, Landlock ABI" in text and "cgroups" in text, text


def test_required_refuses_to_start_where_namespaces_cannot_be_made(tmp_path: Path) -> None:
    """A host without bubblewrap: `required` says what is missing and exits."""
    from harness import Daemon

    d = Daemon(tmp_path / "d", '[sandbox]\nmode = "required"\n')
    bare = tmp_path / "bin"
    bare.mkdir()
    env = {**os.environ, "PATH": str(bare)}
    r = subprocess.run(d.cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "sandbox.mode = required" in r.stderr and "bubblewrap" in r.stderr, r.stderr


@pytest.mark.parametrize("setup", ["root-uid-per-session", "landlock-only"])
def test_a_tool_that_kills_its_host_costs_only_that_command(
    make_daemon, llm: FakeLLM, open_root: Path, setup: str
) -> None:
    d = make(make_daemon, llm, open_root, setup)
    with d.client() as c:
        sid = c.create(session="parricide").id
    out = run_tool(d, llm, sid, "echo before; kill -9 $PPID; sleep 2; echo unreachable", {})
    assert "before" in out and "tool host exited" in out, out
    out = run_tool(d, llm, sid, "echo after", {})
    assert "after" in out and "[exit code: 0]" in out, out
    with d.client() as c:
        assert c.status(sid).last_exit is None  # the worker never noticed more than that


def test_pages_forks_share_count_once_against_the_cap(make_daemon, llm: FakeLLM, open_root: Path) -> None:
    """Ten processes sharing one parent's 40 MiB copy-on-write: ~480 MiB of
    RSS summed, ~50 MiB of PSS.  Summing RSS killed such a session; the cap
    counts PSS once the RSS sum is over it."""
    d = make(make_daemon, llm, open_root, "root-uid-per-session", "max_memory_mb = 200\n")
    with d.client() as c:
        sid = c.create(session="forker").id
        pid = c.status(sid).pid
    forker = ("import os, signal\nb = b'x' * (40 << 20)\nfor _ in range(9):\n"
              "    if os.fork() == 0:\n        break\nsignal.pause()")
    out = run_tool(d, llm, sid, f'(python3 -c "{forker}" sandbox-pages > /dev/null 2>&1 &) ; echo STARTED', {})
    assert "STARTED" in out, out

    def forks() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if "sandbox-pages" in (p.info["cmdline"] or [])]

    cap = 200 << 20
    wait_for(lambda: len(forks()) == 10 and sum(p.memory_info().rss for p in forks()) > cap, 10,
             "ten forks whose RSS sums past the cap")
    with d.client() as c:
        wait_for(lambda: (c.status(sid).rss_bytes or 0) < cap, 10, "the sweep to count their PSS")
        assert c.status(sid).last_exit is None and c.status(sid).pid == pid
        c.remove(sid)
    wait_for(lambda: not forks(), 10, "the forks to go with their session")


def test_the_tool_host_command_line_is_short(make_daemon, llm: FakeLLM, open_root: Path) -> None:
    """`ps` used to show the tool host's whole source (~19 KB) as its
    command line, twice (bubblewrap's and the host's); the source and its
    config now come over its socket."""
    d = make(make_daemon, llm, open_root, "root-uid-per-session")
    with d.client() as c:
        sid = c.create(session="cmdline-7e1a").id
    assert "ran" in run_tool(d, llm, sid, "echo ran", {})
    hosts = []
    for p in d.descendants():
        with contextlib.suppress(psutil.Error):
            cmdline = p.cmdline()
            if "-I" in cmdline and "-S" in cmdline:
                hosts.append(cmdline)
            # No title or argument names the session (nor its workspace,
            # ID@TOKEN, which bubblewrap reads from a pipe): `ps` shows every user.
            assert sid not in " ".join(cmdline), cmdline
    assert hosts, "no tool host among the daemon's descendants"
    for cmdline in hosts:
        assert len("\0".join(cmdline)) < 2048, (len("\0".join(cmdline)), cmdline[:3])
        assert not any("def confine" in arg for arg in cmdline)


def test_a_sandboxed_tool_s_command_is_in_no_process_s_arguments(make_daemon, llm: FakeLLM, open_root: Path) -> None:
    """As tests/test_agent_tools.py's, through the tool host: the command
    reaches bash on its stdin (a pipe the host hands it), not in its argv."""
    from test_agent_tools import LIST_ARGVS

    d = make(make_daemon, llm, open_root, "root-uid-per-session")
    with d.client() as c:
        sid = c.create(session="argv").id
    out = run_tool(d, llm, sid, LIST_ARGVS, {})
    assert "/bin/bash -c IFS= read" in out and "ARGV-MARKER-7f3a" not in out, out[-2000:]
