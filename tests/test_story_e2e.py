"""One story, live and stored, through the real daemon and `sessionctl`:
an agent turn with a permission request (allowed), a failed tool and its
worker SIGKILLed in an LLM call (the turn resumes), printed by `attach` as
it happens and by `history` once it is over, and again after a daemon
restart.  Both say the same: each tool with its outcome (a failure stays a
failure), the request with who allowed it, the crash and the resume where
they happened, no tool shown as run twice, the reply without stray blank
lines.  (The console renders the same events: tests/test_web_console.py.)"""

from __future__ import annotations

import os
import re
import signal

import pytest

from fakellm import FakeLLM, Hang, Stream, chunk, text_stream, tool_call_stream
from harness import wait_for
from test_agent_e2e import agent_config
from test_operator_ctl import _ctl_process, _read_until

pytestmark = pytest.mark.process

ASK_BASH = """
[[permissions]]
tool = "bash"
match = "*"
action = "ask"
"""


def _story(text: str) -> list[str]:
    """The lines that tell the turn: tools, permissions, the crash, the
    resume and the reply (attach also prints the turn's own states, which
    the log does not keep, and hints on what to type)."""
    out = []
    for line in text.splitlines():
        line = re.sub(r" \(sessionctl approve\|deny .*\)$", "", line)
        line = re.sub(r"\d\d:\d\d:\d\d", "T", line)
        if line.startswith(("[tool]", "[permission", "[turn resumed", "[running -> crashed", "[crashed -> ")):
            out.append(line)
        elif line and not line.startswith(("[", "---", ">")):
            out.append(f"text {line}")
    return out


def script_the_turn(llm: FakeLLM, command: str) -> None:
    """bash (asked: the rule says ask), list_dir outside the workspace
    (fails), an LLM call its worker is killed in, the resumed call's reply."""
    llm.script(
        tool_call_stream(("c1", "bash", {"command": command})),
        tool_call_stream(("c2", "list_dir", {"path": "/nowhere"})),
        Stream([chunk({"role": "assistant", "content": ""}), Hang()]),
        text_stream("all ", "done"),
    )


def test_attach_and_history_tell_one_story_before_and_after_a_daemon_restart(
        make_daemon, llm: FakeLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test-secret-123")
    d = make_daemon(agent_config(llm, ASK_BASH))
    script_the_turn(llm, "echo hi")
    with d.client() as c:
        sid = c.create().id
    attach = _ctl_process(d, "attach", sid, "--from", "0")  # (from the start, however late it connects)
    try:
        with d.client() as c:
            c.send_input(sid, "go")
            [waiting] = wait_for(lambda: c.status(sid).waiting, 15, "the request")
            assert d.ctl("approve", sid).returncode == 0
            wait_for(lambda: len(llm.requests) >= 3, 15, "the third LLM call")
            os.kill(c.status(sid).pid, signal.SIGKILL)
        live = _read_until(attach.stdout, "[turn 1 done]", 30)
    finally:
        attach.kill()
        attach.wait()
    live_story = _story(live)
    assert live_story == [
        '[tool] bash {"command": "echo hi"}',
        f'[permission request {waiting.request_id}: bash {{"command": "echo hi"}}]',
        f"[permission request {waiting.request_id} (bash) allowed by uid {os.getuid()} (sessionctl) at T]",
        live_story[3],  # bash's output: hi
        '[tool] list_dir {"path": "/nowhere"}',
        live_story[5],  # list_dir's error, whatever it says
        live_story[6],  # running -> crashed: ...
        live_story[7],  # crashed -> restarting: restart in ...
        live_story[8],  # the resume, at step 4
        "text all done",
    ], live
    assert live_story[3].startswith("[tool] bash ok: hi")
    assert live_story[5].startswith("[tool] list_dir failed: error:")
    assert live_story[6].startswith("[running -> crashed") and live_story[7].startswith("[crashed -> restarting") and "turn resumed at step 4 after crashed" in live_story[8]
    stored = d.ctl("history", sid)
    assert stored.returncode == 0, stored.stderr
    assert _story(stored.stdout) == live_story, stored.stdout
    d.stop()
    d.start()
    assert _story(d.ctl("history", sid).stdout) == live_story
