"""Framing and message decoding, including every way a stream can be cut."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc import messages as m
from ipc.wirebase import Msg
from ipc.errors import BadMessage, FrameTooLarge
from ipc.framing import FrameEncoder, FrameParser, encode_frame

pytestmark = pytest.mark.pure

_dec = msgspec.msgpack.Decoder(m.Request)


def parser(limit: int = 1 << 20) -> FrameParser[m.Request]:
    return FrameParser(_dec, limit)


def test_encoder_matches_one_off_encoding() -> None:
    msg = m.Send(id=3, session="s", text="hé")
    assert bytes(FrameEncoder().encode(msg)) == encode_frame(msg)
    (length,) = struct.unpack(">I", encode_frame(msg)[:4])
    assert length == len(encode_frame(msg)) - 4


@given(st.lists(st.text(max_size=200), min_size=1, max_size=8), st.data())
@settings(max_examples=200, deadline=None)
def test_any_split_of_a_stream_yields_the_same_messages(texts: list[str], data: st.DataObject) -> None:
    msgs = [m.Send(id=i, session="s", text=t) for i, t in enumerate(texts)]
    stream = b"".join(encode_frame(x) for x in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    p = parser()
    out = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        out.extend(p.feed(stream[prev:cut]))
        prev = cut
    assert out == msgs
    assert p.buffered == 0


def test_byte_by_byte() -> None:
    stream = encode_frame(m.Ping(id=1)) + encode_frame(m.List(id=2))
    p = parser()
    out = []
    for i in range(len(stream)):
        out.extend(p.feed(stream[i : i + 1]))
    assert out == [m.Ping(id=1), m.List(id=2)]


def test_length_over_limit_raises_before_the_body_arrives() -> None:
    p = parser(limit=1024)
    with pytest.raises(FrameTooLarge) as err:
        p.feed(struct.pack(">I", 0xFFFFFFFF))
    assert err.value.length == 0xFFFFFFFF and err.value.limit == 1024


def test_frame_exactly_at_limit_is_accepted() -> None:
    frame = encode_frame(m.Send(id=1, session="s", text="x" * 100))
    p = parser(limit=len(frame) - 4)
    assert p.feed(frame) == [m.Send(id=1, session="s", text="x" * 100)]


def test_bad_messages_do_not_desync_the_stream() -> None:
    garbage = b"\xc1"
    unknown = msgspec.msgpack.encode({"type": "nope", "id": 1})
    stream = (
        struct.pack(">I", len(garbage)) + garbage
        + struct.pack(">I", len(unknown)) + unknown
        + encode_frame(m.Ping(id=9))
    )
    out = parser().feed(stream)
    assert isinstance(out[0], BadMessage) and isinstance(out[1], BadMessage)
    assert out[2] == m.Ping(id=9)


def test_empty_frame_is_a_bad_message() -> None:
    out = parser().feed(struct.pack(">I", 0))
    assert len(out) == 1 and isinstance(out[0], BadMessage)


@given(st.binary(max_size=64))
@settings(max_examples=300, deadline=None)
def test_random_bytes_never_raise_anything_but_frame_too_large(blob: bytes) -> None:
    p = parser(limit=4096)
    try:
        for item in p.feed(blob):
            assert isinstance(item, (BadMessage, msgspec.Struct))
    except FrameTooLarge:
        pass


def test_tags_are_explicit_wire_names() -> None:
    # A rename of a class must not change the wire: every struct has a tag.
    for union in (m.Request, m.Reply, m.ToWorker, m.FromWorker):
        for cls in union.__args__:
            assert isinstance(cls.__struct_config__.tag, str)


def test_new_fields_have_defaults_so_old_peers_still_decode() -> None:
    old = msgspec.msgpack.encode({"type": "create", "id": 1})
    assert _dec.decode(old) == m.Create(id=1)


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def test_no_message_is_tracked_by_the_cyclic_collector() -> None:
    """The daemon retains tens of thousands of events for replay; tracked,
    each full collection walked them all (11-18 ms a pass with 50 busy
    sessions: the control plane's whole p99 in bench/load.py).  Messages are
    data and never in a cycle, decoded or built."""
    import gc

    kinds = _subclasses(Msg)
    assert len(kinds) > 40
    for kind in kinds:
        assert kind.__struct_config__.gc is False, kind.__name__
    event = m.StateChanged(session="s", seq=1, old="busy", new="idle")
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=m.StateChanged)
    assert not gc.is_tracked(event) and not gc.is_tracked(decoded)
    # A tuple holding only untracked objects is untracked by the next pass.
    held = (7, decoded)
    gc.collect(0)
    assert not gc.is_tracked(held)
