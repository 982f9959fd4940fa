"""Provider behaviours through the real daemon and sessionctl: what a
client sees when a reply is truncated or filtered, `status --json` usage,
and refusing an agent session that has no provider."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fakellm import FakeLLM, Stream, text_stream
from harness import env_for_children, wait_for
from test_agent_e2e import agent_config

pytestmark = pytest.mark.process


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


def test_agent_without_a_provider_is_refused_at_create(make_daemon) -> None:
    d = make_daemon('[agent]\nhandler = "agent"\n')
    named = d.ctl("create", "--handler", "agent")
    assert named.returncode == 2  # a handler this daemon cannot run, as one it does not allow
    # What is missing, and what to do about it.
    assert ("provider.base_url and provider.model are not set: add them under [provider] in the config file "
            "sessiond runs with (`sessiond config default` shows every key), then `sessionctl reload`; "
            "or create an echo session (--handler echo)") in named.stderr, named.stderr
    # Not named: the offline default, as the start-up log says.
    with d.client() as c:
        assert c.create().handler == "echo"
    assert "no [provider] configured" in d.log


def test_half_a_provider_is_refused_at_create_and_at_config_check(make_daemon, tmp_path) -> None:
    config = '[agent]\nhandler = "agent"\n[provider]\nbase_url = "http://127.0.0.1:9/v1"\n'
    d = make_daemon(config)
    for args in (("create",), ("create", "--handler", "agent")):
        r = d.ctl(*args)
        assert r.returncode == 2 and "provider.model is not set" in r.stderr, r
    assert "[provider] is incomplete: provider.model" in d.log
    path = tmp_path / "half.toml"
    path.write_text(config)
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "config", "check", str(path)],
                       capture_output=True, text=True, env=env_for_children())
    assert r.returncode == 2 and f"provider.model is not set: add it under [provider] in {path}" in r.stderr


def test_unset_api_key_env_is_reported_at_start_up(make_daemon, llm: FakeLLM, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("SESSIOND_TEST_KEY")
    d = make_daemon(agent_config(llm))
    assert wait_for(lambda: "SESSIOND_TEST_KEY, which is not set" in d.log, what="the start-up error")
    assert llm.requests == []
    path = tmp_path / "c.toml"
    path.write_text(agent_config(llm))
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "config", "check", str(path)],
                       capture_output=True, text=True, env=env_for_children())
    assert r.returncode == 0 and "SESSIOND_TEST_KEY, which is not set" in r.stderr


def test_status_json_usage_sums_turns_and_survives_a_restart(make_daemon, llm: FakeLLM) -> None:
    d = make_daemon(agent_config(llm))
    for n in (1, 2):
        stream = text_stream(f"answer {n}")
        stream.events.append({"choices": [], "usage": {"prompt_tokens": 10 * n, "completion_tokens": n,
                                                       "completion_tokens_details": {"reasoning_tokens": n}}})
        llm.script(stream)
    sid = d.ctl("create").stdout.strip()
    first = d.ctl("--json", "send", sid, "one")
    assert json.loads(first.stdout.splitlines()[-1])["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 1, "reasoning_tokens": 1}
    assert d.ctl("send", sid, "two").returncode == 0
    want = {"prompt_tokens": 30, "completion_tokens": 3, "reasoning_tokens": 3}
    assert json.loads(d.ctl("--json", "status", sid).stdout)["usage"] == want
    d.kill()
    d.start()
    assert json.loads(d.ctl("--json", "status", sid).stdout)["usage"] == want
    assert json.loads(d.ctl("--json", "ls").stdout)["sessions"][0]["usage"] == want


def test_anthropic_kind_through_the_daemon(make_daemon, llm: FakeLLM) -> None:
    from test_agent_anthropic import answer, end, ev, start, text_block

    config = agent_config(llm).replace("[provider]\n", '[provider]\nkind = "anthropic"\nmax_tokens = 1000\n')
    d = make_daemon(config)
    llm.script(
        Stream([
            start(),
            ev("content_block_start", index=0, content_block={"type": "thinking", "thinking": "", "signature": ""}),
            ev("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "Write it."}),
            ev("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "c2ln"}),
            ev("content_block_stop", index=0),
            ev("content_block_start", index=1, content_block={"type": "tool_use", "id": "toolu_1", "name": "write_file", "input": {}}),
            ev("content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": '{"path": "n.txt", "content": "hi"}'}),
            ev("content_block_stop", index=1),
            *end("tool_use"),
        ], done=False),
        answer("Written."),
        Stream([start(), *text_block(0, "Once"), *end("max_tokens")], done=False),
    )
    sid = d.ctl("create").stdout.strip()
    r = d.ctl("send", "--reasoning", sid, "write n.txt")
    assert r.returncode == 0 and r.stdout == "Written.\n", r
    assert "Write it." in r.stderr  # the thinking, apart from the reply
    follow_up = llm.requests[1]
    assert follow_up.path == "/v1/messages" and follow_up.headers["x-api-key"] == "sk-test-secret-123"
    assert follow_up.json["max_tokens"] == 1000
    assert follow_up.json["messages"][1]["content"][0] == {"type": "thinking", "thinking": "Write it.", "signature": "c2ln"}
    assert follow_up.json["messages"][2]["content"][0]["type"] == "tool_result"
    cut = d.ctl("--json", "send", sid, "story")
    assert cut.returncode == 1
    last = json.loads(cut.stdout.splitlines()[-1])
    assert last["stop_reason"] == "truncated" and last["stop_detail"] == "max_tokens"
    assert json.loads(d.ctl("--json", "status", sid).stdout)["usage"] == {"prompt_tokens": 75, "completion_tokens": 45}


def test_reasoning_reaches_only_clients_that_ask_for_it(make_daemon, llm: FakeLLM) -> None:
    from fakellm import chunk

    def reasoned(text: str, thought: str) -> Stream:
        stream = text_stream(text)
        stream.events.insert(1, chunk({"reasoning_content": thought, "content": None}))
        return stream

    d = make_daemon(agent_config(llm))
    llm.script(reasoned("one", "thought one"), reasoned("two", "thought two"), reasoned("three", "thought three"))
    sid = d.ctl("create").stdout.strip()
    # An old client (nothing announced in Hello): the reply alone, and it decodes every frame.
    plain = d.ctl("send", sid, "a")
    assert plain.returncode == 0 and plain.stdout == "one\n" and plain.stderr == ""
    shown = d.ctl("send", "--reasoning", sid, "b")
    assert shown.returncode == 0 and shown.stdout == "two\n" and shown.stderr == "thought two"
    lines = [json.loads(x) for x in d.ctl("--json", "send", "--reasoning", sid, "c").stdout.splitlines()]
    (reasoning,) = [x for x in lines if x["type"] == "reasoning"]
    assert reasoning["text"] == "thought three" and reasoning["session"] == sid
    texts = [x for x in lines if x["type"] == "text"]
    assert reasoning["seq"] < texts[0]["seq"] and "".join(x["text"] for x in texts) == "three"
    # Live only: a replay has the text, not the reasoning.
    from supervisor.ctl.client import Client
    from ipc import messages as m

    last = lines[-1]["seq"]
    with Client(d.socket, reasoning=True) as c:
        replayed = []
        for ev in c.attach(sid, from_seq=1):
            replayed.append(ev)
            if ev.seq >= last:
                break
    assert any(isinstance(e, m.TextDelta) for e in replayed)
    assert not any(isinstance(e, m.ReasoningDelta) for e in replayed)
