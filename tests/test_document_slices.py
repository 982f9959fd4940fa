"""The export document decoded and encoded in slices
(supervisor/api/document.py) is the document `msgspec` decodes and encodes
whole: the same result for the same bytes, the same refusals, over
documents mutated every way hypothesis finds; and no one call holds the
GIL for a whole large document (the daemon's loop waits that long)."""

from __future__ import annotations

import binascii
import json

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from supervisor.api import document as d
from supervisor.api.document import (
    ExportDocument, ExportedAbort, ExportedCommit, ExportedInput, ExportedSnapshot, decode_document,
    encode_document,
)
from supervisor.errors import BadRequest


def _doc(turns: int = 3, state: bytes = b"", text: str = "hello") -> ExportDocument:
    records: list[ExportedInput | ExportedCommit | ExportedAbort] = []
    for t in range(1, turns + 1):
        records.append(ExportedInput(turn=t, text=f"{text} {t}", at=1.5))
        if t % 3:
            records.append(ExportedCommit(turn=t, reply=f"r\n\"{t}\"", record=msgspec.msgpack.encode({"t": t}),
                                          usage={"prompt_tokens": t, "llm_calls": 1}))
        else:
            records.append(ExportedAbort(turn=t, reason="killed", usage={"llm_calls": 1}))
    return ExportDocument(format="sessiond-session", version=1, id="s1", handler="agent",
                          overrides={"agent.max_turns": 3}, created_at=1.0, exported_at=2.0,
                          spent={"llm_calls": turns}, records=records,
                          snapshot=ExportedSnapshot(turns=0, handler_state=state, usage={"llm_calls": 2})
                          if state else None)


def _whole(data: bytes) -> ExportDocument | str:
    try:
        doc = msgspec.json.decode(data, type=ExportDocument)
        if doc.snapshot is not None and doc.snapshot.handler_state:
            msgspec.msgpack.decode(doc.snapshot.handler_state)
        return doc
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
        return "refused"


def _sliced(data: bytes) -> ExportDocument | str:
    try:
        return decode_document(data)
    except BadRequest:
        return "refused"


STATE = msgspec.msgpack.encode({"messages": [{"role": "user", "content": "x" * 50}] * 4})
GOOD = [msgspec.json.encode(_doc()), msgspec.json.encode(_doc(4, STATE)),
        json.dumps(json.loads(msgspec.json.encode(_doc(2, STATE))), indent=2).encode(),  # another layout
        json.dumps(json.loads(msgspec.json.encode(_doc(2, STATE)))).replace("/", "\\/").encode()]  # escaped


@pytest.mark.pure
@pytest.mark.parametrize("data", GOOD)
def test_a_good_document_decodes_to_what_msgspec_makes_of_it(data: bytes) -> None:
    assert decode_document(data) == _whole(data)


@pytest.mark.pure
def test_the_encoding_is_the_same_document() -> None:
    for doc in (_doc(), _doc(5, STATE), _doc(0), ExportDocument(format="sessiond-session", version=1, id="e",
                                                                 handler="echo")):
        data = encode_document(doc)
        assert json.loads(data) == json.loads(msgspec.json.encode(doc))
        assert decode_document(data) == doc


_MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10_000),
              st.sampled_from(list(b'{}[],:"\\ 0-1eE.tfn\n\x00'))),
)


@pytest.mark.pure
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(GOOD), mutations=st.lists(_MUTATIONS, min_size=1, max_size=3))
@example(base=GOOD[0], mutations=[("insert", 1, ord("["))])
def test_a_mutated_document_is_taken_or_refused_as_msgspec_would(base: bytes,
                                                                 mutations: list[tuple[str, int, int]]) -> None:
    data = bytearray(base)
    for kind, at, value in mutations:
        at %= len(data) + 1
        if kind == "flip" and at < len(data):
            data[at] ^= value
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = bytes([value])
        if not data:
            data = bytearray(b"{")
    assert _sliced(bytes(data)) == _whole(bytes(data))


@pytest.mark.pure
def test_a_document_that_hides_its_bytes_outside_its_records_is_refused() -> None:
    doc = json.loads(msgspec.json.encode(_doc()))
    doc["overrides"] = {"agent.system_prompt": "x" * (d._SHELL_MAX + 10)}
    with pytest.raises(BadRequest, match="other than records"):
        decode_document(json.dumps(doc).encode())


@pytest.mark.pure
def test_no_decoder_is_handed_a_whole_large_document(monkeypatch: pytest.MonkeyPatch) -> None:
    """One call over a whole 10 MB document held the GIL for all of it (the
    daemon's loop waited as long).  Sliced, no decoder, base64 or regular
    expression call is handed more than `_CHUNK` bytes of it (its records
    are short; a record longer than that is one call of its own).  The
    figures, old and new side by side: bench/transfer.py."""
    big = _doc(3600, msgspec.msgpack.encode({"messages": ["y" * 4000] * 1000}), text="z" * 1000)
    data = encode_document(big)
    assert len(data) > 9_000_000
    sizes: list[int] = []

    class Spy:
        def __init__(self, real: object) -> None:
            self.real = real

        def decode(self, buf: bytes) -> object:
            sizes.append(len(buf))
            return self.real.decode(buf)  # type: ignore[attr-defined]

    # (`_msgpack_items` skims the state to cut it into its items: it makes
    # no object, ~0.1 ms for 8 MB, and is left out.)
    for name in ("_record", "_shell", "_key", "_msgpack"):
        monkeypatch.setattr(d, name, Spy(getattr(d, name)))
    real_b64 = binascii.a2b_base64
    monkeypatch.setattr(binascii, "a2b_base64", lambda buf, **kw: (sizes.append(len(buf)), real_b64(buf, **kw))[1])
    assert decode_document(data) == big
    assert sizes and max(sizes) <= d._CHUNK, max(sizes)
