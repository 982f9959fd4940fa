"""Pure parsing: the SSE parser and the chunk assembler, no network."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from session_worker.agent._errors import ProviderError
from session_worker.agent._sse import SSEEvent, SSEParser
from session_worker.agent._stream import StreamAssembler

pytestmark = pytest.mark.pure

STREAM = (
    b": ping\r\n\r\n"
    b"data: {\"a\": \"h\xc3\xa9\"}\r\n\r\n"
    b"event: error\ndata: line1\ndata:line2\n\n"
    b"id: 7\nretry: 10\ndata: [DONE]\r\r"
)
EXPECTED = [
    SSEEvent('{"a": "hé"}'),
    SSEEvent("line1\nline2", "error"),
    SSEEvent("[DONE]"),
]


def parse_in_pieces(data: bytes, cuts: list[int]) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    start = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        events += parser.feed(data[start:cut])
        start = cut
    return events + parser.close()


def test_whole_stream() -> None:
    assert parse_in_pieces(STREAM, []) == EXPECTED


def test_every_single_split_point() -> None:
    # Includes a cut between \r and \n and inside the two-byte "é".
    for cut in range(len(STREAM) + 1):
        assert parse_in_pieces(STREAM, [cut]) == EXPECTED, cut


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_split_points(cuts: list[int]) -> None:
    assert parse_in_pieces(STREAM, cuts) == EXPECTED


# Byte pieces that make up arbitrary streams: field names with and without the
# space, comments, every line break (also split: "\r" then "\n"), UTF-8 of
# two and three bytes (U+2028 is not a line break in SSE), an invalid byte.
_PIECES = [
    b"data:", b"data: ", b"event: ", b"event:error", b": c", b":", b"id: 1", b"retry: 5",
    b"x", b" ", b"[DONE]", b"{\"a\": 1}", b"\xc3\xa9", b"\xe2\x80\xa8", b"\xff",
    b"\r", b"\n", b"\r\n",
]


def reference_parse(stream: bytes) -> list[SSEEvent]:
    """The format as the spec states it, on the whole stream at once."""
    lines = re.split("\r\n|\r|\n", stream.decode("utf-8", "replace"))
    lines.pop()  # no line break after it: cut off in transit
    events: list[SSEEvent] = []
    data: list[str] = []
    event = ""
    for line in lines + [""]:  # close(): a last event without its blank line
        if not line:
            if data:
                events.append(SSEEvent("\n".join(data), event or "message"))
            data, event = [], ""
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            elif name == "event":
                event = value
    return events


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(_PIECES), max_size=40).map(b"".join).flatmap(
        lambda stream: st.tuples(
            st.just(stream),
            st.lists(st.integers(min_value=0, max_value=len(stream)), max_size=10),
        )
    )
)
def test_any_stream_split_anywhere_parses_as_a_whole(case: tuple[bytes, list[int]]) -> None:
    stream, cuts = case
    whole = parse_in_pieces(stream, [])
    assert whole == reference_parse(stream)
    assert parse_in_pieces(stream, cuts) == whole


def test_empty_read_between_cr_and_lf_keeps_one_line_break() -> None:
    parser = SSEParser()
    events = parser.feed(b"data: a\r") + parser.feed(b"") + parser.feed(b"\ndata: b\n\n")
    assert events == [SSEEvent("a\nb")]


def test_close_flushes_an_event_without_blank_line_but_drops_half_lines() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: 1\n") == []
    assert parser.close() == [SSEEvent("1")]
    parser = SSEParser()
    assert parser.feed(b"data: {\"trunc") == []
    assert parser.close() == []


def test_comment_only_and_blank_lines_dispatch_nothing() -> None:
    assert SSEParser().feed(b": keep-alive\n\n\n\r\n: x\n\n") == []


def feed_all(*chunks: dict[str, object]) -> tuple[StreamAssembler, str]:
    assembler = StreamAssembler()
    text = "".join(assembler.feed(c)[0] for c in chunks)
    return assembler, text


def delta(d: dict[str, object], finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


def call(index: int | None, **fields: object) -> dict[str, object]:
    out: dict[str, object] = dict(fields)
    if index is not None:
        out["index"] = index
    return out


def test_interleaved_tool_calls_assemble_exactly() -> None:
    a_args = json.dumps({"path": "a/ü.txt", "content": "x\"y"})
    b_args = json.dumps({"command": "ls -la"})
    chunks = [
        delta({"role": "assistant", "content": None}),
        delta({"tool_calls": [call(0, id="c0", type="function", function={"name": "write_file", "arguments": ""})]}),
        delta({"tool_calls": [call(1, id="c1", type="function", function={"name": "bash"})]}),
    ]
    # Alternate 3-character pieces of the two argument strings.
    for i in range(0, max(len(a_args), len(b_args)), 3):
        if a_args[i : i + 3]:
            chunks.append(delta({"tool_calls": [call(0, function={"arguments": a_args[i : i + 3]})]}))
        if b_args[i : i + 3]:
            chunks.append(delta({"tool_calls": [call(1, function={"arguments": b_args[i : i + 3]})]}))
    chunks.append(delta({}, "tool_calls"))
    chunks.append({"choices": [], "usage": {"prompt_tokens": 3}})
    assembler, text = feed_all(*chunks)
    done = assembler.finish()
    assert text == ""
    assert [(c.id, c.name, c.arguments) for c in done.tool_calls] == [
        ("c0", "write_file", a_args),
        ("c1", "bash", b_args),
    ]
    assert done.finish_reason == "tool_calls"
    assert done.usage == {"prompt_tokens": 3}


def test_calls_without_index_are_told_apart_by_id() -> None:
    assembler, _ = feed_all(
        delta(
            {
                "tool_calls": [
                    call(None, id="a", function={"name": "list_dir", "arguments": '{"path": "."}'}),
                    call(None, id="b", function={"name": "read_file", "arguments": '{"path": "x"}'}),
                ]
            }
        ),
        delta({"tool_calls": [call(None, function={"arguments": ""})]}),
        delta({}, "stop"),
    )
    calls = assembler.finish().tool_calls
    assert [(c.id, c.name) for c in calls] == [("a", "list_dir"), ("b", "read_file")]


def test_repeated_name_is_not_doubled_and_missing_id_is_generated() -> None:
    assembler, _ = feed_all(
        delta({"tool_calls": [call(0, function={"name": "bash", "arguments": "{}"})]}),
        delta({"tool_calls": [call(0, function={"name": "bash", "arguments": ""})]}),
    )
    (only,) = assembler.finish().tool_calls
    assert only.name == "bash" and only.id and only.arguments == "{}"


def test_text_null_content_and_other_choices() -> None:
    assembler, text = feed_all(
        delta({"role": "assistant", "content": None}),
        delta({"content": "a"}),
        {"choices": [{"index": 1, "delta": {"content": "OTHER"}}]},
        delta({"content": "b"}, "length"),
    )
    assert text == "ab" and assembler.finish().finish_reason == "length"


def test_error_chunk_raises() -> None:
    with pytest.raises(ProviderError, match="overloaded"):
        StreamAssembler().feed({"error": {"message": "overloaded", "code": 503}})
