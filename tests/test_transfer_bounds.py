"""Large documents: import, export and history of a 10 MB session still
round-trip (they run off the daemon's loop now), and documents are bounded
by [daemon] max_document_bytes with a clear error (issue 21)."""

from __future__ import annotations

import msgspec
import pytest

from harness import Daemon
from supervisor.ctl.client import RequestError
from supervisor.api.transfer import ExportDocument, ExportedCommit, ExportedInput

pytestmark = pytest.mark.process


def _document(turns: int, turn_bytes: int, sid: str = "big") -> bytes:
    records: list[ExportedInput | ExportedCommit] = []
    for t in range(1, turns + 1):
        text = f"input {t:06d} " + "x" * (turn_bytes - 13)
        records.append(ExportedInput(turn=t, text=text, at=1.0))
        records.append(ExportedCommit(turn=t, reply="echo: " + text, usage={"tokens": t}))
    return msgspec.json.encode(ExportDocument(format="sessiond-session", version=1, id=sid,
                                              handler="echo", records=records))


def test_a_ten_megabyte_session_round_trips(make_daemon) -> None:
    d: Daemon = make_daemon()
    doc = _document(1000, 5000)
    assert len(doc) > 10_000_000
    with d.client() as c:
        info = c.import_session(doc)
        assert info.id == "big" and info.turns == 1000 and info.state == "hibernated"
        assert info.usage == {"tokens": sum(range(1, 1001))}
        back = msgspec.json.decode(c.export("big"), type=ExportDocument)
        original = msgspec.json.decode(doc, type=ExportDocument)
        assert back.records == original.records and back.handler == "echo"
        h = c.history("big")
        assert len(h.turns) + h.omitted_turns == 1000 and h.turns[-1].turn == 1000
        assert h.turns[-1].input == original.records[-2].text  # type: ignore[union-attr]
        # It lives on: the next turn follows the imported ones.
        assert c.send_text("big", "after").endswith("after")
        assert c.status("big").turns == 1001
        assert c.ping().pid == d.pid


def test_documents_are_bounded_by_max_document_bytes(make_daemon) -> None:
    d: Daemon = make_daemon("[daemon]\nmax_document_bytes = 65536\n")
    with d.client() as c:
        with pytest.raises(RequestError) as big:
            c.import_session(_document(20, 5000, "too-big"))
        assert big.value.code == "limit_exceeded" and "max_document_bytes" in str(big.value)
        assert "too-big" not in {s.id for s in c.list()}
        small = _document(5, 5000, "fits")
        assert len(small) < 65536
        c.import_session(small)
        c.send_text("fits", "y" * 30_000)  # now its export is over the bound
        with pytest.raises(RequestError) as out:
            c.export("fits")
        assert out.value.code == "limit_exceeded" and "max_document_bytes" in str(out.value)
        assert c.ping().pid == d.pid
