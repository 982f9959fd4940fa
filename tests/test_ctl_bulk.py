"""Issue 25, against real daemons: bulk stop/restart/rm/interrupt, `ls`
filters, sorting, CPU and age, `reload` over the socket, and the defects a
new user hit (a request cut off by its client, `send | head`, a limit that
cut a turn, unit-less limit lines, error texts, `attach --from 0`,
`stats --json`, a handler or tool the config cannot have)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAST_CONFIG
from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import Daemon, env_for_children, raw_connect, run_as, trusting, wait_for
from ipc import messages as m
from ipc.framing import encode_frame
from test_agent_e2e import agent_config

pytestmark = pytest.mark.process

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")

CONFIG = FAST_CONFIG + """
[agent]
allowed_handlers = ["agent", "echo", "fixture_handlers:*"]
"""


def _ids(d: Daemon, *args: str) -> list[str]:
    r = d.ctl("ls", "-q", *args)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def _states(d: Daemon) -> dict[str, str]:
    with d.client() as c:
        return {s.id: s.state for s in c.list()}


def test_bulk_commands_and_ls_filters(make_daemon) -> None:
    d = make_daemon(CONFIG)
    with d.client() as c:
        for sid in ("a1", "a2", "a3"):
            c.create(session=sid, handler="echo")
        c.create(session="s1", handler="fixture_handlers:slow")
        c.stop("a3")
    # ls: filters (repeatable, combined), sort, and the listed values on a bad one.
    assert _ids(d, "--state", "stopped") == ["a3"]
    assert _ids(d, "--state", "idle", "--handler", "echo") == ["a1", "a2"]
    assert _ids(d, "--state", "stopped", "--state", "idle", "--handler", "fixture_handlers:slow") == ["s1"]
    assert _ids(d, "--owner", "4242") == []
    assert _ids(d, "--sort", "state") == ["a1", "a2", "s1", "a3"]
    assert _ids(d, "--sort", "id", "--owner", str(os.geteuid())) == ["a1", "a2", "a3", "s1"]
    for flag, value, listed in (("--state", "sleepy", "hibernated"), ("--sort", "colour", "restarts")):
        r = d.ctl("ls", flag, value)
        assert r.returncode == 2 and value in r.stderr and listed in r.stderr, r.stderr
    # CPU (the daemon's sweep) and age: columns of the table, a field of --json.
    table = d.ctl("ls").stdout.splitlines()
    assert table[0].split() == ["ID", "STATE", "PID", "RSS", "CPU%", "AGE", "TURNS", "RESTARTS", "HANDLER"]

    def cpu_measured() -> bool:
        rows = {s["id"]: s for s in json.loads(d.ctl("--json", "ls").stdout)["sessions"]}
        return isinstance(rows["a1"]["cpu_percent"], float) and rows["a3"]["cpu_percent"] is None
    wait_for(cpu_measured, 15, "the sweep's CPU figure of a1")
    row = next(line.split() for line in d.ctl("ls").stdout.splitlines() if line.startswith("a1 "))
    assert re.fullmatch(r"\d+", row[4]) and re.fullmatch(r"\d+[smhd]\w*", row[5]), row

    # --dry-run says what it would do and does nothing.
    r = d.ctl("stop", "--state", "idle", "--handler", "echo", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["would stop a1", "would stop a2"]
    assert _states(d)["a1"] == "idle"
    r = d.ctl("--json", "rm", "--all", "--dry-run")
    doc = json.loads(r.stdout)
    assert doc["dry_run"] is True and sorted(doc["would"]) == ["a1", "a2", "a3", "s1"] and doc["matched"] == 4
    assert len(_states(d)) == 4
    # Usage: an id and a selection, or neither.
    for args in (("stop",), ("stop", "a1", "--all"), ("rm", "a1", "--state", "idle")):
        r = d.ctl(*args)
        assert r.returncode == 2 and "--all" in r.stderr, (args, r.stderr)
    # interrupt --all: only running turns; the idle ones are skipped.
    slow = subprocess.Popen([sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket), "send", "s1", "500"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_for_children())
    try:
        wait_for(lambda: _states(d)["s1"] == "running", 10, "s1's turn to run")
        r = d.ctl("--json", "interrupt", "--all")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["done"] == ["s1"] and {s["id"] for s in doc["skipped"]} == {"a1", "a2", "a3"}
        out, _ = slow.communicate(timeout=20)
        assert b"tick 0" in out
    finally:
        if slow.poll() is None:
            slow.kill()
            slow.wait()
    # stop, then restart, a selection; a stopped one is skipped by stop.
    r = d.ctl("stop", "--handler", "echo")
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["stopped a1", "stopped a2"]
    assert "2 of 3 matching" in r.stderr and "1 skipped" in r.stderr
    assert _states(d) == {"a1": "stopped", "a2": "stopped", "a3": "stopped", "s1": "idle"}
    r = d.ctl("restart", "--state", "stopped")
    assert r.returncode == 0 and sorted(r.stdout.splitlines()) == ["restarted a1", "restarted a2", "restarted a3"]
    assert set(_states(d).values()) == {"idle"}
    # Nothing matching is not a failure.
    r = d.ctl("rm", "--state", "failed")
    assert r.returncode == 0 and "no sessions match" in r.stderr
    r = d.ctl("rm", "--all")
    assert r.returncode == 0, r.stderr
    assert _states(d) == {}


@root_only
def test_a_user_acts_in_bulk_on_their_own_sessions_only(make_daemon) -> None:
    d = make_daemon(FAST_CONFIG + f'socket_mode = "0666"\nallowed_uids = [{NOBODY}]\n')
    os.chmod(d.sockdir, 0o755)
    path = str(d.socket)
    with d.client() as c:
        c.create(session="roots", handler="echo")

    def nobody_removes_all() -> list[object]:
        from supervisor.ctl.cli import main
        from supervisor.ctl.client import Client

        with Client(path) as c:
            c.create(session="mine", handler="echo")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["--socket", path, "--json", "rm", "--all"])
        return [code, out.getvalue()]

    code, out = run_as(NOBODY, nobody_removes_all)
    assert code == 0 and json.loads(out)["done"] == ["mine"], out
    assert _states(d) == {"roots": "idle"}
    # --owner names another user's sessions: a non-admin sees none of them.
    def nobody_stops_roots() -> list[object]:
        from supervisor.ctl.cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["--socket", path, "--json", "stop", "--owner", "0"])
        return [code, out.getvalue()]

    code, out = run_as(NOBODY, nobody_stops_roots)
    assert code == 0 and json.loads(out)["matched"] == 0
    assert _states(d) == {"roots": "idle"}


def test_a_request_runs_to_its_end_when_its_client_goes(make_daemon) -> None:
    """A client sending `rm` and closing at once used to cancel the delete
    (mid-way: the session stuck in `stopping`; after a restart it came back
    hibernated)."""
    d = make_daemon(CONFIG)
    with d.client() as c:
        c.create(session="doomed", handler="echo")
        c.create(session="halted", handler="echo")
    for request in (m.Remove(id=1, session="doomed"), m.Stop(id=1, session="halted")):
        s = raw_connect(d.socket)
        s.sendall(encode_frame(m.Hello(protocol=m.PROTOCOL_VERSION)) + encode_frame(request))
        s.close()
    wait_for(lambda: _states(d) == {"halted": "stopped"}, 15, "the rm and the stop to finish")
    assert d.ctl("send", "halted", "x").returncode == 1  # stopped, as asked: not stuck
    d.stop()
    d.start()
    assert _states(d) == {"halted": "stopped"}  # the delete holds after a restart
    r = d.ctl("restart", "halted")
    assert r.returncode == 0, r.stderr
    assert d.ctl("send", "halted", "x").stdout == "1: x\n"


def test_a_daemon_killed_during_an_rm_finishes_it_at_its_next_start(make_daemon) -> None:
    """An rm is durable once begun: its worker is slow to stop (a turn
    blocking its loop: the rm waits out stop_grace_secs), the daemon is
    SIGKILLed meanwhile; the session must not come back."""
    d = make_daemon(CONFIG.replace("stop_grace_secs = 2.0", "stop_grace_secs = 30"))
    with d.client() as c:
        c.create(session="doomed", handler="fixture_handlers:blocking_sleep")
        c.create(session="kept", handler="echo")
    turn = subprocess.Popen([sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket), "send", "doomed", "block"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env_for_children())
    try:
        wait_for(lambda: _states(d).get("doomed") == "running", 15, "the blocking turn")
        s = raw_connect(d.socket)
        s.sendall(encode_frame(m.Hello(protocol=m.PROTOCOL_VERSION)) + encode_frame(m.Remove(id=1, session="doomed")))
        wait_for(lambda: _states(d).get("doomed") == "stopping", 15, "the rm to begin")
        d.kill()
        s.close()
    finally:
        turn.kill()
        turn.wait(10)
    d.start()
    wait_for(lambda: _states(d) == {"kept": "hibernated"}, 15, "the rm to be finished")
    assert not (d.state_dir / "sessions" / "doomed").exists()


def test_reload_over_the_socket(make_daemon) -> None:
    d = make_daemon(CONFIG)
    r = d.ctl("reload")
    assert r.returncode == 0 and r.stdout.startswith(f"reloaded {d.config_path}: nothing changed"), r
    d.config_path.write_text(trusting(CONFIG + "max_turns = 7\n[agent.limits]\nmax_memory_mb = 300\n"
                                      '[tracing]\nservice_name = "elsewhere"\n'))
    r = d.ctl("--json", "reload")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["taken"] is True, r
    assert any(n.startswith("[tracing] changed: it takes effect at the next start") for n in doc["notes"]), doc
    assert "agent.max_turns: 25 -> 7" in doc["changed"] and "agent.limits.max_memory_mb: 1024 -> 300" in doc["changed"]
    assert "id" not in doc
    d.config_path.write_text(trusting(CONFIG + 'max_turns = "many"\n'))
    r = d.ctl("reload")
    assert r.returncode == 1, r
    assert "refused" in r.stderr and "'agent.max_turns'" in r.stderr and str(d.config_path) in r.stderr
    with d.client() as c:  # the daemon lives on, under the config it took
        c.create(session="after", handler="echo")


@root_only
def test_reload_is_for_admins(make_daemon) -> None:
    d = make_daemon(FAST_CONFIG + f'socket_mode = "0666"\nallowed_uids = [{NOBODY}]\n')
    os.chmod(d.sockdir, 0o755)
    path = str(d.socket)

    def nobody_reloads() -> list[object]:
        from supervisor.ctl.client import Client
        from supervisor.ctl.errors import RequestError

        with Client(path) as c:
            try:
                c.reload()
            except RequestError as exc:
                return [exc.code, exc.message]
        return ["ok", ""]

    code, message = run_as(NOBODY, nobody_reloads)
    assert code == "permission_denied" and "admin" in message


def test_send_and_its_output(make_daemon, tmp_path: Path) -> None:
    d = make_daemon(CONFIG)
    with d.client() as c:
        c.create(session="e", handler="echo")
        c.create(session="t", handler="fixture_handlers:slow", settings={"agent.turn_timeout_secs": 1})
    # `send | head`: no traceback; the exit code a shell gives a command SIGPIPE ended.
    text = "x" * 100_000
    done = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -c 1 >/dev/null', "bash",
                           sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket), "send", "e", text],
                          capture_output=True, text=True, env=env_for_children(), timeout=60)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 141, (done.returncode, done.stderr)
    # A turn cut by turn_timeout exits 1, and the limit line has units.
    r = d.ctl("send", "t", "100000")
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert re.search(r"limit turn_timeout: (\d+\.\d s > 1 s|1 s reached)", r.stderr), r.stderr
    assert "agent.turn_timeout_secs" in r.stderr
    # attach --from 0: every retained event, and no gap that never was.
    r = d.ctl("--json", "logs", "e")
    assert r.returncode == 0
    attach = subprocess.Popen([sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket), "--json",
                               "attach", "e", "--from", "0"], stdout=subprocess.PIPE, env=env_for_children())
    try:
        first = json.loads(attach.stdout.readline())
        assert first["type"] != "gap" and first["seq"] == 1, first
    finally:
        attach.kill()
        attach.wait()
    # stats --json: the daemon's figures, not the request's number; both paths.
    for argv in ([sys.executable, "-m", "supervisor.ctl"], [str(Path(sys.prefix) / "bin" / "sessionctl")]):
        r = subprocess.run([*argv, "--socket", str(d.socket), "--json", "stats"], capture_output=True, text=True,
                           env=env_for_children(), timeout=30)
        stats = json.loads(r.stdout)
        assert "id" not in stats and stats["sessions"] == 2, (argv, stats)
    # A bad --set: the TOML type expected and the value given; an enum's values.
    r = d.ctl("create", "--handler", "echo", "--set", "agent.max_turns=abc")
    assert r.returncode == 2 and 'agent.max_turns: expected a whole number, got "abc"' in r.stderr, r.stderr
    r = d.ctl("create", "--handler", "echo", "--set", "sandbox.network=wide")
    assert r.returncode == 2 and "none, loopback, full" in r.stderr, r.stderr


def test_a_turn_cut_by_max_turns_fails_the_send(make_daemon, llm: FakeLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test-secret-123")
    d = make_daemon(agent_config(llm, "[tools]\nenabled = [\"list_dir\"]\n"))
    with d.client() as c:
        sid = c.create(settings={"agent.max_turns": 1}).id
    llm.script(tool_call_stream(("c1", "list_dir", {"path": "."})), text_stream("never asked"))
    r = d.ctl("send", sid, "look")
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "limit turns: 1 model call reached" in r.stderr, r.stderr
    assert "agent.max_turns" in r.stderr


@pytest.mark.parametrize("toml, key, says", [
    ('[agent]\nhandler = "nocolon"\n', "agent.handler", "package.module:factory"),
    ('[agent]\nhandler = "no_such_module_here:make"\n', "agent.handler", "no_such_module_here"),
    ('[tools]\nenabled = ["bash", "curl"]\n', "tools.enabled", "read_file, write_file"),
    ('[sandbox]\nmode = "strict"\n', "sandbox.mode", "auto, required, off"),
])
def test_config_check_and_start_refuse_what_no_session_could_use(tmp_path: Path, toml: str, key: str,
                                                                 says: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    check = subprocess.run([sys.executable, "-m", "supervisor.cli", "config", "check", str(config)],
                           capture_output=True, text=True, env=env_for_children(), timeout=30)
    assert check.returncode == 2, (check.returncode, check.stdout, check.stderr)
    assert f"{config}: invalid value for '{key}'" in check.stderr and says in check.stderr, check.stderr
    start = subprocess.run([sys.executable, "-m", "supervisor.cli", "run", "--config", str(config),
                            "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "state")],
                           capture_output=True, text=True, env=env_for_children(), timeout=30)
    assert start.returncode == 2 and f"'{key}'" in start.stderr and str(config) in start.stderr, start.stderr
