"""The published protocol against the code: docs/protocol.schema.json is
what `python -m ipc.protogen` makes of ipc/messages.py and ipc/operator.py
now (a message changed without regenerating it fails here, naming the
command), docs/protocol.md names every message, and the conformance
client (tests/wire_client.py) uses nothing of the project."""

from __future__ import annotations

import ast
import functools
import json
import operator
import re
import sys

import msgspec
import pytest

from harness import REPO, TESTS
from ipc import messages as m
from ipc.wirebase import Msg
from ipc import operator as op
from ipc import protogen
from wire_schema import conforms

pytestmark = pytest.mark.pure

DOC = (REPO / "docs" / "protocol.md").read_text()


def _tags(union: object) -> set[str]:
    return {str(t.__struct_config__.tag) for t in getattr(union, "__args__", ())}


def test_the_checked_in_schema_is_what_the_code_says(capsys: pytest.CaptureFixture[str]) -> None:
    rc = protogen.main(["--check"])
    err = capsys.readouterr().err
    assert rc == 0, f"{err} (docs/protocol.schema.json is stale: run `.venv/bin/python -m ipc.protogen`)"


def test_a_message_changed_without_regenerating_fails_the_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As if someone added a field to `send` and forgot the schema."""

    class Send(Msg, tag="send"):  # noqa: N801 (stands in for the real one)
        id: int
        session: str
        text: str
        traceparent: str = ""

    stale = tmp_path / "protocol.schema.json"
    stale.write_text(protogen.render())
    monkeypatch.setattr(protogen, "SCHEMA_PATH", stale)
    changed = [Send if t is m.Send else t for t in op.AnyRequest.__args__]  # type: ignore[attr-defined]
    monkeypatch.setattr(op, "AnyRequest", functools.reduce(operator.or_, changed))
    assert protogen.main(["--check"]) == 1
    assert "python -m ipc.protogen" in capsys.readouterr().err
    assert protogen.main([]) == 0  # regenerating fixes it
    assert protogen.main(["--check"]) == 0
    assert "traceparent" in stale.read_text()


def test_every_message_and_error_code_is_in_the_document() -> None:
    tags = _tags(op.AnyRequest) | _tags(op.AnyReply)
    nested = {"session", "exit", "turn", "log", "top_entry", "drain_moved", "drain_left"}
    missing = sorted(t for t in tags | nested if f"`{t}`" not in DOC)
    assert not missing, f"docs/protocol.md does not name {missing}"
    codes = sorted(c.value for c in m.ErrorCode if f"| `{c.value}` |" not in DOC)
    assert not codes, f"docs/protocol.md's error table lacks {codes}"
    for tag in sorted(m.NEW_EVENT_TAGS):
        assert f"`{tag}`" in DOC


def test_the_schema_describes_what_the_code_encodes() -> None:
    """Messages as msgspec encodes them validate; the wrong ones do not."""
    session = m.SessionInfo(id="s", state="idle", handler="echo", pid=3,
                            last_exit=m.ExitInfo(reason="stopped", code=0))
    samples = [
        m.Welcome(protocol=1, server_version="0", pid=1),
        m.Error(code=m.ErrorCode.NOT_FOUND, message="no", id=3),
        m.Created(id=1, session=session),
        m.Accepted(id=2, session="s", turn=1, seq=4),
        m.TurnDone(session="s", seq=5, turn=1, reply="x", usage={"prompt_tokens": 3}),
        op.LogsReply(id=3, session="s", entries=[op.LogEntry(at=1.5, event=m.StateChanged(
            session="s", seq=1, old="idle", new="running"))]),
        op.ExportReply(id=4, session="s", document=b"{}"),
    ]
    for msg in samples:
        conforms(msgspec.msgpack.decode(msgspec.msgpack.encode(msg)), "Reply")
    for msg in (m.Hello(protocol=1, events=["reasoning"]), m.Create(id=1, handler="echo"),
                op.Import(id=4, document=b"{}")):
        conforms(msgspec.msgpack.decode(msgspec.msgpack.encode(msg)), "Request")
    with pytest.raises(AssertionError, match="missing 'text'"):
        conforms({"type": "send", "id": 2, "session": "s"}, "Request")
    with pytest.raises(AssertionError, match="unknown field"):
        conforms({"type": "ok", "id": 2, "extra": 1}, "Reply")


def test_the_conformance_client_uses_nothing_of_the_project() -> None:
    tree = ast.parse((TESTS / "wire_client.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names) | {"msgpack"}, imported


def test_the_node_client_uses_nothing_but_node() -> None:
    for path in (REPO / "clients" / "node").glob("*.mjs"):
        for spec in re.findall(r"""(?:from|import)\s*\(?\s*['"]([^'"]+)['"]""", path.read_text()):
            assert spec.startswith(("node:", "./")), f"{path.name} imports {spec}"


def test_the_documents_example_session_matches_the_schema() -> None:
    block = DOC[DOC.index("## A session, start to end"):DOC.index("## Compatibility")]
    checked = 0
    for line in block.splitlines():
        arrow, _, body = line.partition(" ")
        if arrow in ("→", "←") and "..." not in body:
            conforms(json.loads(body), "Request" if arrow == "→" else "Reply")
            checked += 1
    assert checked >= 10
