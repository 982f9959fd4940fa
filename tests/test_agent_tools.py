"""Tools without the LLM: workspace confinement, bash limits and environment,
custom tool schemas (plus one pass through the loop)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from fakellm import FakeLLM, fake_llm, text_stream, tool_call_stream
from session_worker.agent._builtins import builtin_tools, resolve_inside
from session_worker.agent._errors import ToolError, ToolLoadError
from session_worker.agent._bash import OutputCap
from session_worker.agent._tools import ToolEnv
from ipc.settings import SessionSettings
from test_agent_support import FakeCtx, ToolsSettings, make_handler, make_settings, run

__all__ = ["fake_llm"]


def call(tool: str, args: dict[str, Any], ws: Path, **tools_kw: Any) -> str:
    settings = SessionSettings(tools=ToolsSettings(**tools_kw))
    ws.mkdir(exist_ok=True)
    env = ToolEnv(ws.resolve(), settings, FakeCtx(settings, ws))
    return run(builtin_tools()[tool].run(args, env))


# --- workspace confinement ------------------------------------------------------


@pytest.mark.component
def test_paths_outside_the_workspace_are_refused(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (tmp_path / "outside.txt").write_text("secret")
    (ws / "link_out").symlink_to(tmp_path / "outside.txt")
    (ws / "dir_out").symlink_to(tmp_path)
    (ws / "link_in").symlink_to(ws / "sub")
    real = ws.resolve()
    for bad in ["../outside.txt", "sub/../../outside.txt", str(tmp_path / "outside.txt"), "/etc/passwd",
                "link_out", "dir_out/outside.txt", "dir_out/ws/../outside.txt", "", "a\x00b"]:
        with pytest.raises(ToolError):
            resolve_inside(real, bad)
    assert resolve_inside(real, "sub/../x") == real / "x"
    assert resolve_inside(real, str(ws / "sub" / "f")) == real / "sub" / "f"
    assert resolve_inside(real, "link_in/f") == real / "sub" / "f"
    assert resolve_inside(real, ".") == real


@pytest.mark.component
def test_file_tools_give_readable_errors_and_do_not_escape(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "outside.txt").write_text("secret")
    (ws / "link_out").symlink_to(tmp_path / "outside.txt")
    for tool, args in [
        ("read_file", {"path": "../outside.txt"}),
        ("read_file", {"path": "link_out"}),
        ("write_file", {"path": "link_out", "content": "pwned"}),
        ("write_file", {"path": "../new.txt", "content": "x"}),
        ("list_dir", {"path": ".."}),
    ]:
        with pytest.raises(ToolError, match="outside the workspace"):
            call(tool, args, ws)
    assert (tmp_path / "outside.txt").read_text() == "secret"
    assert not (tmp_path / "new.txt").exists()
    with pytest.raises(ToolError, match="no such file"):
        call("read_file", {"path": "missing"}, ws)
    with pytest.raises(ToolError, match="is a directory"):
        call("read_file", {"path": "."}, ws)


@pytest.mark.component
def test_write_read_list_and_read_cap(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    assert call("write_file", {"path": "d/e/f.txt", "content": "héllo"}, ws) == "wrote 6 bytes to d/e/f.txt"
    assert call("read_file", {"path": "d/e/f.txt"}, ws) == "héllo"
    call("write_file", {"path": "big", "content": "x" * 1000}, ws)
    listing = call("list_dir", {"path": "."}, ws)
    assert listing.splitlines() == ["big\t1000 bytes", "d/"]
    capped = call("read_file", {"path": "big"}, ws, output_limit_bytes=300)
    assert capped.startswith("x" * 300) and "first 300 of 1000 bytes" in capped


# --- bash -----------------------------------------------------------------------


@pytest.mark.process
def test_bash_exit_code_stdin_and_workspace(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    out = call("bash", {"command": "pwd; cat; echo err >&2; exit 3"}, ws)
    assert out == f"{ws.resolve()}\nerr\n[exit code: 3]"


@pytest.mark.process
def test_bash_output_cap_keeps_head_and_tail(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    out = call("bash", {"command": "echo START; seq 1 100000; echo END"}, ws, output_limit_bytes=1000)
    assert out.startswith("START\n1\n2\n") and out.endswith("END\n[exit code: 0]")
    total = len("START\n") + sum(len(f"{i}\n") for i in range(1, 100001)) + len("END\n")
    assert f"[... {total - 1000} bytes of output cut" in out
    assert len(out) < 1300


# Lists every process's command line from inside the command; the marker
# is in the command's comment only, so only an argv holding the command
# itself could show it.
# Every bash's arguments on the machine (the command, had it leaked into
# an argv, would be in a bash's); only those: a busy machine's whole list
# would pass the tool's output cap, whose cut could drop the line looked for.
LIST_ARGVS = ("# ARGV-MARKER-7f3a\nfor f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null; echo; done"
              " | grep -a bash")


@pytest.mark.process
def test_the_bash_tool_s_command_is_in_no_process_s_arguments(tmp_path: Path) -> None:
    """Other users see every process's arguments (`ps`): the command goes
    to bash on its stdin, never in its argv."""
    out = call("bash", {"command": LIST_ARGVS}, tmp_path / "ws")
    assert "/bin/bash -c IFS= read" in out, out[-2000:]  # (bash's own, the same for every command)
    assert "ARGV-MARKER-7f3a" not in out
    # And the command still reads as bash -c would: a multi-line script,
    # stdin at /dev/null for what it runs, its exit code.
    assert call("bash", {"command": "x=1\nif [ $x = 1 ]; then cat; echo yes; fi\nexit 4"}, tmp_path / "ws") \
        == "yes\n[exit code: 4]"


@pytest.mark.pure
def test_output_cap_unit() -> None:
    cap = OutputCap(10)
    for piece in [b"abc", b"defgh", b"ijklmnop", b"qrstuvwxyz"]:
        cap.feed(piece)
    text = cap.text()
    assert text.startswith("abcde\n") and text.endswith("\nvwxyz") and "[... 16 bytes" in text
    small = OutputCap(10)
    small.feed(b"0123456789")
    assert small.text() == "0123456789"


@pytest.mark.process
def test_bash_timeout_kills_the_command_and_its_children(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    start = time.monotonic()
    out = call(
        "bash",
        {"command": "sleep 300 & echo $! > child; echo started; sleep 301", "timeout_secs": 0.5},
        ws,
    )
    assert time.monotonic() - start < 5
    assert out.startswith("started\n") and "timed out after 0.5 s" in out
    child = int((ws / "child").read_text())
    try:
        assert psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass


@pytest.mark.process
def test_bash_timeout_is_capped_by_settings(tmp_path: Path) -> None:
    start = time.monotonic()
    out = call("bash", {"command": "sleep 30", "timeout_secs": 999}, tmp_path / "ws", bash_timeout_secs=0.3)
    assert time.monotonic() - start < 5 and "timed out after 0.3 s" in out


@pytest.mark.process
def test_bash_environment_is_scrubbed_and_shares_our_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ["SESSIOND_SOCKET", "SESSIOND_WORKER_FD", "NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "OPENAI_API_KEY"]:
        monkeypatch.setenv(name, "leak-" + name)
    ws = tmp_path / "ws"
    out = call("bash", {"command": "env; echo PGID=$(ps -o pgid= -p $$ | tr -d ' ')"}, ws)
    assert "leak-" not in out
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line and not line.startswith("PGID"))
    assert env["HOME"] == str(ws.resolve()) and env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert env["LANG"] == "C.UTF-8"
    assert not {k for k in env if k.startswith(("SESSIOND_", "LISTEN_")) or k == "NOTIFY_SOCKET"}
    pgid = int(out.split("PGID=")[1].split()[0])
    assert pgid == os.getpgid(0)


# --- custom tools ---------------------------------------------------------------


@pytest.mark.component
def test_custom_tool_schemas(fake_llm: FakeLLM, tmp_path: Path) -> None:
    settings = make_settings(
        fake_llm,
        tools=ToolsSettings(enabled=[], custom=["agent_tools_example:word_count", "agent_tools_example:scale"]),
    )
    handler = make_handler(settings, tmp_path / "ws")
    schemas = {s["function"]["name"]: s["function"] for s in handler.tools.schemas()}
    run(handler.aclose())
    assert schemas["word_count"] == {
        "name": "word_count",
        "description": "Count the words in a text.\n\nWords shorter than min_length and words in ignore are not counted.",
        "parameters": {
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "min_length": {"type": "integer"},
                "ignore": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["text"],
            "additionalProperties": False,
        },
    }
    assert schemas["scale"]["parameters"]["properties"] == {
        "values": {"type": "array", "items": {"type": "number"}},
        "factor": {"type": "number"},
        "label": {"type": "string"},
        "exact": {"type": "boolean"},
    }
    assert schemas["scale"]["parameters"]["required"] == ["values", "factor"]


@pytest.mark.component
@pytest.mark.parametrize(
    "spec, message",
    [
        ("agent_tools_example:untyped", "needs a type annotation"),
        ("agent_tools_example:with_varargs", "only named parameters"),
        ("agent_tools_example:with_dict", "unsupported type"),
        ("agent_tools_example:missing", "has no function"),
        ("no_such_module_xyz:f", "cannot import"),
        ("agent_tools_example", "package.module:function"),
        ("agent_tools_example:word_count", None),
    ],
)
def test_bad_custom_tools_fail_at_construction(fake_llm: FakeLLM, tmp_path: Path, spec: str, message: str | None) -> None:
    settings = make_settings(fake_llm, tools=ToolsSettings(custom=[spec]))
    if message is None:
        run(make_handler(settings, tmp_path / "ws").aclose())
        return
    with pytest.raises(ToolLoadError, match=message):
        make_handler(settings, tmp_path / "ws")


@pytest.mark.component
def test_unknown_enabled_tool_fails_at_construction(fake_llm: FakeLLM, tmp_path: Path) -> None:
    with pytest.raises(ToolLoadError, match="unknown tool 'bsh'"):
        make_handler(make_settings(fake_llm, tools=ToolsSettings(enabled=["bsh"])), tmp_path / "ws")


@pytest.mark.component
def test_custom_tools_run_through_the_loop(fake_llm: FakeLLM, tmp_path: Path) -> None:
    from ipc.settings import PermissionRule

    settings = make_settings(
        fake_llm,
        tools=ToolsSettings(custom=["agent_tools_example:word_count", "agent_tools_example:scale", "agent_tools_example:explode"]),
        # Custom tools match on their first argument.
        permissions=[PermissionRule(tool="word_count", match="*forbidden*", action="deny")],
    )
    fake_llm.script(
        tool_call_stream(
            ("w", "word_count", {"text": "a bb ccc dd", "min_length": 2, "ignore": ["dd"]}),
            ("s", "scale", {"values": [1, 2.5], "factor": 2}),
            ("e", "explode", {"reason": "why"}),
            ("x", "word_count", {"text": "a forbidden text"}),
            ("b", "word_count", {"text": "x", "min_length": "two"}),
        ),
        text_stream("done"),
    )

    async def go() -> None:
        handler = make_handler(settings, tmp_path / "ws")
        await handler.handle("count", FakeCtx(settings, tmp_path / "ws"))
        await handler.aclose()

    run(go())
    results = {m["tool_call_id"]: m["content"] for m in fake_llm.requests[1].json["messages"] if m["role"] == "tool"}
    assert results["w"] == "2"
    assert json.loads(results["s"]) == {"label": None, "values": [2.0, 5.0], "exact": False}
    assert results["e"] == "error: tool explode failed: ValueError: exploded: why"
    assert "permission denied" in results["x"]
    assert "'min_length' must be of type integer" in results["b"]


@pytest.mark.process
def test_background_child_holding_stdout_does_not_hang_the_tool(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    start = time.monotonic()
    out = call("bash", {"command": "sleep 30 & echo $! > bg; echo hi"}, ws)
    took = time.monotonic() - start
    bg = psutil.Process(int((ws / "bg").read_text()))
    bg.kill()
    assert took < 3, took
    assert out.startswith("hi\n[exit code: 0]") and "background process" in out
