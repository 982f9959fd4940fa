"""A resumed agent turn reads as what happened (component tier: the agent
loop against the scripted LLM on loopback, its steps journaled by a stand-in
context and given back to a second run, as a restarted worker gets them).

The resumed run rebuilds the turn from its journaled steps: the tool that
ran before the worker died is not shown as run again (its `tool_result`
says `replayed`, and no `tool_call` is sent for it), the reply does not
begin with the blank lines meant to part two pieces of text, and the turn's
record says how each tool call went (for `history`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fakellm import FakeLLM, fake_llm, text_stream, tool_call_stream
from session_worker.handler import Interruption, TurnResult
from test_agent_support import FakeCtx, ToolsSettings, make_handler, make_settings, run

pytestmark = pytest.mark.component

__all__ = ["fake_llm"]


class _Died(BaseException):
    """The worker dies here (a stand-in for SIGKILL)."""


class StepCtx(FakeCtx):
    """Journals each step's result (msgpack round trip, as the daemon keeps
    it); dies when step `die_at` begins; given a journal, replays it as a
    resumed turn's steps, and answers the step in flight as killed."""

    def __init__(self, *args: Any, journal: list[tuple[str, bytes]] | None = None, die_at: int | None = None,
                 **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.journal: list[tuple[str, bytes]] = list(journal or [])
        self.replay = len(self.journal)
        self.die_at = die_at
        self.n = 0
        if journal is not None:
            self.resumed = Interruption(reason="crashed", cause="the worker crashed (signal SIGKILL)",
                                        key="", step=len(journal))

    async def step(self, key: str, fn: Callable[[], Any], *, kind: str = "",
                   interrupted: Callable[[Interruption], Any] | None = None, idempotent: bool = False,
                   wait: bool = True) -> Any:
        n, self.n = self.n, self.n + 1
        if n < self.replay:
            assert self.journal[n][0] == key
            return msgspec.msgpack.decode(self.journal[n][1])
        if n == self.die_at:
            raise _Died
        value = fn()
        if hasattr(value, "__await__"):
            value = await value
        self.journal.append((key, msgspec.msgpack.encode(value)))
        return msgspec.msgpack.decode(msgspec.msgpack.encode(value))


def test_a_resumed_turn_shows_no_tool_run_again_and_no_stray_blank_lines(fake_llm: FakeLLM, tmp_path: Path) -> None:
    settings = make_settings(fake_llm, tools=ToolsSettings(enabled=["list_dir"]))
    (tmp_path / "a.txt").write_text("x")
    # The first response only calls a tool (no text); the worker dies in the
    # second LLM call; the resumed run asks it again and gets the answer.
    fake_llm.script(tool_call_stream(("c1", "list_dir", {"path": "."})), text_stream("done"))

    first = StepCtx(settings, tmp_path, die_at=2)
    with pytest.raises(_Died):
        run(make_handler(settings, tmp_path).handle("look", first))
    assert [kind for kind, _ in first.notices] == ["tool_call", "tool_result"]
    assert [key for key, _ in first.journal] == ["llm:1", "tool:list_dir:c1"]

    fake_llm.script(text_stream("done"))
    again = StepCtx(settings, tmp_path, journal=first.journal)
    result: TurnResult = run(make_handler(settings, tmp_path).handle("look", again))
    # The reply: what the model said, without the separator meant for text
    # that came before it (there was none: '\n\ndone').
    assert result.reply == "done" and again.text == "done"
    # The journaled tool is not shown as a new run.
    assert again.notices_of("tool_call") == []
    [shown] = again.notices_of("tool_result")
    assert shown["id"] == "c1" and shown["ok"] is True and shown["replayed"] is True
    assert "replayed" not in first.notices_of("tool_result")[0]
    # How each call went is in the turn's record (history shows it).
    assert result.record["tool_ok"] == {"c1": True}


def test_text_on_both_sides_of_a_replayed_tool_is_still_parted(fake_llm: FakeLLM, tmp_path: Path) -> None:
    settings = make_settings(fake_llm, tools=ToolsSettings(enabled=["list_dir"]))
    fake_llm.script(tool_call_stream(("c1", "list_dir", {"path": "."}), text="Looking."), text_stream("done"))
    first = StepCtx(settings, tmp_path, die_at=2)
    with pytest.raises(_Died):
        run(make_handler(settings, tmp_path).handle("look", first))
    fake_llm.script(text_stream("done"))
    again = StepCtx(settings, tmp_path, journal=first.journal)
    result = run(make_handler(settings, tmp_path).handle("look", again))
    assert result.reply == "Looking.\n\ndone"
    assert again.text == "\n\ndone"  # (the resumed run streams only what is new)


def test_a_failed_tool_is_recorded_as_failed(fake_llm: FakeLLM, tmp_path: Path) -> None:
    settings = make_settings(fake_llm, tools=ToolsSettings(enabled=["list_dir"]))
    fake_llm.script(tool_call_stream(("c1", "list_dir", {"path": "/nowhere/at/all"}), ("c2", "nosuch", {})),
                    text_stream("ok"))
    result = run(make_handler(settings, tmp_path).handle("look", FakeCtx(settings, tmp_path)))
    assert result.record["tool_ok"] == {"c1": False, "c2": False}
