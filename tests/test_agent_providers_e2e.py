"""Provider behaviours through the real daemon and sessionctl: what a
client sees when a reply is truncated or filtered, `status --json` usage,
and refusing an agent session that has no provider."""

from __future__ import annotations

import json

import pytest

from fakellm import FakeLLM, text_stream
from test_agent_e2e import agent_config

pytestmark = pytest.mark.process


@pytest.fixture
def llm():
    with FakeLLM() as server:
        yield server


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIOND_TEST_KEY", "sk-test-secret-123")


def test_truncated_and_filtered_replies_fail_sessionctl_send(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm))
    llm.script(
        text_stream("Once upon", finish_reason="length"),
        text_stream("[withheld]", finish_reason="content_filter"),
        text_stream("fine"),
    )
    sid = d.ctl("create").stdout.strip()
    cut = d.ctl("send", sid, "tell a story")
    assert cut.returncode == 1 and cut.stdout == "Once upon\n"
    assert "truncated" in cut.stderr and "'length'" in cut.stderr
    filtered = d.ctl("--json", "send", sid, "again")
    assert filtered.returncode == 1 and "filtered" in filtered.stderr
    last = json.loads(filtered.stdout.splitlines()[-1])
    assert last["type"] == "turn_done" and last["stop_reason"] == "filtered"
    assert last["stop_detail"] == "content_filter"
    ok = d.ctl("send", sid, "third")
    assert ok.returncode == 0 and ok.stdout == "fine\n" and ok.stderr == ""
