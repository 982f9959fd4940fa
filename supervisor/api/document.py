"""The export document: its schema, and its decoding and encoding in slices.

Runs in the daemon, on a helper thread (supervisor.api.transfer hands it
the work with `asyncio.to_thread`).  A thread is not enough: one
`msgspec` call over a whole 10 MB document holds the GIL for all of it,
and the daemon's loop waits that long (85 to 332 ms in an audit).  So no
call here is given more than one record, or a slice of `_CHUNK` bytes:

- decoding: the document is walked member by member (`_Walk`: a regular
  expression finds where each value ends, each match one record at most),
  each record is decoded alone, the snapshot's handler state (base64, most
  of an agent's document) is decoded a chunk at a time, and what is left
  (the id, handler, overrides, figures: `_SHELL_MAX` at most) is decoded
  whole, with the very checks of `ExportDocument` (strict types and bounds);
- encoding: the same pieces, each encoded alone, then joined.

Between slices the thread lets the loop have the GIL (`Pause`).  The
result is the document `msgspec` would decode from the same bytes (a test
holds them equal over mutated documents), and a document it would refuse
is refused; one that hides most of its bytes outside its records and its
state is refused too (`_SHELL_MAX`).

`SESSIOND_BENCH_WHOLE_DOCUMENTS=1` (bench/transfer.py, for comparison
only; not a setting) decodes and encodes documents whole, as before.
"""

from __future__ import annotations

import binascii
import os
from array import array
import re
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta as Bound

from supervisor.errors import BadRequest

__all__ = ["ExportDocument", "ExportedAbort", "ExportedCommit", "ExportedInput", "ExportedRecord",
           "ExportedSnapshot", "FORMAT", "Pause", "check_msgpack", "decode_document", "encode_document", "free"]

FORMAT: Literal["sessiond-session"] = "sessiond-session"
_TEXT_MAX = 8 * 1024 * 1024
_Turn = Annotated[int, Bound(ge=1, le=1 << 40)]
_Text = Annotated[str, Bound(max_length=_TEXT_MAX)]
_Usage = dict[Annotated[str, Bound(max_length=64)], Annotated[int, Bound(ge=0, le=1 << 53)]]


class _Doc(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True, gc=False):
    """Untracked by the cyclic collector (`gc=False`, inherited): a
    document's 100,000 records would otherwise set off full collections,
    each holding the GIL far longer than any slice here (127 ms measured)."""


class ExportedInput(_Doc, tag="input", tag_field="kind"):
    turn: _Turn
    text: _Text
    at: Annotated[float, Bound(ge=0)] = 0.0


class ExportedCommit(_Doc, tag="commit", tag_field="kind"):
    turn: _Turn
    reply: _Text
    record: bytes = b""  # the handler's record of the turn (msgpack)
    interrupted: bool = False
    usage: _Usage = {}


class ExportedAbort(_Doc, tag="abort", tag_field="kind"):
    turn: _Turn
    reason: Annotated[str, Bound(max_length=65536)]
    record: bytes = b""
    usage: _Usage = {}  # what its calls spent before it ended


ExportedRecord = ExportedInput | ExportedCommit | ExportedAbort


class ExportedSnapshot(_Doc):
    turns: Annotated[int, Bound(ge=0, le=1 << 40)]
    handler_state: bytes = b""  # msgpack
    usage: _Usage = {}


class ExportDocument(_Doc):
    format: Literal["sessiond-session"]
    version: Literal[1]
    id: Annotated[str, Bound(max_length=64)]
    handler: Annotated[str, Bound(max_length=256)]
    overrides: dict[Annotated[str, Bound(max_length=128)], Any] = {}
    created_at: Annotated[float, Bound(ge=0)] = 0.0
    exported_at: Annotated[float, Bound(ge=0)] = 0.0
    # What the session spent, as the daemon's spend ledger counts it (its
    # LLM calls as they began, killed ones included); None: not said (an
    # older export, or one edited): see transfer.spent_figures.
    spent: _Usage | None = None
    snapshot: ExportedSnapshot | None = None
    records: list[ExportedRecord] = []


WHOLE = os.environ.get("SESSIOND_BENCH_WHOLE_DOCUMENTS") == "1"  # (benches only)
# Bytes one call may take: base64 is decoded and encoded this much at a time.
_CHUNK = 256 * 1024  # (a multiple of 4: base64's quantum; of 3 for encoding: `_CHUNK // 4 * 3`)
# The document less its records and its handler state: ids, overrides, figures.
_SHELL_MAX = 1 << 20
_ITEMS = 128  # pieces of work (records...) between two pauses

_whole = msgspec.json.Decoder(ExportDocument)
_shell = msgspec.json.Decoder(ExportDocument)
_record = msgspec.json.Decoder(ExportedRecord)
_key = msgspec.json.Decoder(str)
_msgpack = msgspec.msgpack.Decoder()
_msgpack_items = msgspec.msgpack.Decoder(list[msgspec.Raw] | dict[Any, msgspec.Raw])
_json = msgspec.json.Encoder()

# JSON's lexemes, as regular expressions over bytes, each written so that it
# matches one way only (no backtracking to speak of, whatever the input).
_WS = rb"[ \t\n\r]*"
_STR = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
_NUM = rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SCALAR = rb"(?:" + _STR + rb"|" + _NUM + rb"|true|false|null)"
_FLAT = (rb"\{" + _WS + rb"(?:" + _STR + _WS + rb":" + _WS + _SCALAR
         + rb"(?:" + _WS + rb"," + _WS + _STR + _WS + rb":" + _WS + _SCALAR + rb")*)?" + _WS + rb"\}")
_MEMBER = _STR + _WS + rb":" + _WS + rb"(?:" + _SCALAR + rb"|" + _FLAT + rb")"
# One record: an object of scalars and flat objects (its usage), which is
# all a record of any kind may hold.
_RECORD_RE = re.compile(rb"\{" + _WS + rb"(?:" + _MEMBER + rb"(?:" + _WS + rb"," + _WS + _MEMBER + rb")*)?"
                        + _WS + rb"\}")
_STR_RE = re.compile(_STR)
_SCALAR_RE = re.compile(_SCALAR)
_WS_RE = re.compile(_WS)
_DEPTH_MAX = 64  # (a record's or the shell's values: a few levels)


def _bad(why: str) -> BadRequest:
    return BadRequest(f"not a sessiond export: {why}")


class Pause:
    """Lets the loop's thread have the GIL after every `_CHUNK` bytes of
    work, or every `_ITEMS` pieces of it (records, in a Python loop): a
    thread would otherwise keep it for the interpreter's switch interval
    (5 ms), and the loop wait that long at each wake-up."""

    def __init__(self) -> None:
        self._bytes = self._items = 0

    def after(self, nbytes: int) -> None:
        """One piece of work, of `nbytes`, was done."""
        self._bytes += nbytes
        self._items += 1
        if self._bytes >= _CHUNK or self._items >= _ITEMS:
            self._bytes = self._items = 0
            time.sleep(0)

    def item(self) -> None:
        self.after(0)


class _Walk:
    """A cursor over the document's bytes, one lexeme or value at a time."""

    def __init__(self, data: bytes, pause: Pause) -> None:
        self.data = data
        self.view = memoryview(data)
        self.pos = 0
        self.pause = pause

    def ws(self) -> None:
        m = _WS_RE.match(self.data, self.pos)
        self.pos = m.end() if m else self.pos

    def char(self) -> bytes:
        self.ws()
        return self.data[self.pos:self.pos + 1]

    def expect(self, c: bytes, where: str) -> None:
        if self.char() != c:
            raise _bad(f"expected {c.decode()!r} at byte {self.pos} ({where})")
        self.pos += 1

    def match(self, pattern: re.Pattern[bytes], what: str) -> tuple[int, int]:
        self.ws()
        m = pattern.match(self.data, self.pos)
        if m is None:
            raise _bad(f"not JSON, or not {what}, at byte {self.pos}")
        start, self.pos = m.start(), m.end()
        self.pause.after(self.pos - start)
        return start, self.pos

    def key(self) -> str:
        start, end = self.match(_STR_RE, "a key")
        try:
            return _key.decode(self.view[start:end])
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise _bad(f"a key at byte {start}: {exc}") from None

    def value(self) -> tuple[int, int]:
        """The span of the value here, whatever it is (strings are found by
        `bytes.find`: a regular expression takes ~2 ms a MB of string)."""
        start = self.pos = self._ws_from(self.pos)
        self._skip(0)
        self.pause.after(self.pos - start)
        return start, self.pos

    def _ws_from(self, pos: int) -> int:
        m = _WS_RE.match(self.data, pos)
        return m.end() if m else pos

    def _skip(self, depth: int) -> None:
        if depth > _DEPTH_MAX:
            raise _bad(f"values nested more than {_DEPTH_MAX} deep")
        self.pos = self._ws_from(self.pos)
        c = self.data[self.pos:self.pos + 1]
        if c == b'"':
            self.pos = self._string_end(self.pos)
            return
        if c not in (b"{", b"["):
            self.match(_SCALAR_RE, "a value")
            return
        close = b"}" if c == b"{" else b"]"
        self.pos += 1
        if self.char() == close:
            self.pos += 1
            return
        while True:
            if c == b"{":
                if self.char() != b'"':
                    raise _bad(f"expected a key at byte {self.pos}")
                self.pos = self._string_end(self.pos)
                self.expect(b":", "an object")
            self._skip(depth + 1)
            n = self.char()
            self.pos += 1
            if n == close:
                return
            if n != b",":
                raise _bad(f"expected ',' or {close.decode()!r} at byte {self.pos - 1}")

    def _string_end(self, pos: int) -> int:
        """Past the string that starts at `pos` (its opening quote)."""
        at = pos + 1
        while True:
            quote = self.data.find(b'"', at)
            if quote < 0:
                raise _bad(f"a string at byte {pos} never ends")
            escape = self.data.find(b"\\", at, quote)
            if escape < 0:
                return quote + 1
            at = escape + 2

    def record(self, n: int) -> tuple[int, int]:
        """The span of the record here: one match of its shape when it is
        short (`_CHUNK`), else walked as any value (`msgspec` checks it)."""
        self.ws()
        m = _RECORD_RE.match(self.data, self.pos, self.pos + _CHUNK)
        if m is None:
            if self.char() != b"{":
                raise _bad(f"records[{n}] at byte {self.pos} is not an object")
            return self.value()
        start, self.pos = m.start(), m.end()
        self.pause.after(self.pos - start)
        return start, self.pos

    def members(self, where: str) -> Any:
        """(key, start of its value) for each member of the object here;
        the caller moves the cursor past each value."""
        self.expect(b"{", where)
        if self.char() == b"}":
            self.pos += 1
            return
        while True:
            key = self.key()
            self.expect(b":", where)
            yield key, self.pos
            c = self.char()
            self.pos += 1
            if c == b"}":
                return
            if c != b",":
                raise _bad(f"expected ',' or '}}' at byte {self.pos - 1} ({where})")


def decode_document(data: bytes) -> ExportDocument:
    """The document, or BadRequest saying what is wrong with it.  (In a thread.)"""
    if WHOLE:
        return _checked(_decode_whole(data))
    pause = Pause()
    walk = _Walk(data, pause)
    shell: list[bytes] = []
    records: array[int] | None = None  # start, end, start, end... (no object each: freed at once)
    state: tuple[int, int] | None = None
    for key, _ in walk.members("the document"):
        if key == "records":
            if records is not None:
                raise _bad("two records members")
            records = _record_spans(walk)
        elif key == "snapshot" and walk.char() == b"{":
            start = walk.pos
            snap, state = _snapshot(walk)
            shell.append(_json.encode(key) + b":" + snap)
            pause.after(walk.pos - start)
        else:
            start, end = walk.value()
            shell.append(_json.encode(key) + b":" + data[start:end])
    walk.ws()
    if walk.pos != len(data):
        raise _bad(f"trailing bytes at byte {walk.pos}")
    body = b"{" + b",".join(shell) + b"}"
    if len(body) > _SHELL_MAX:
        raise _bad(f"its members other than records and the snapshot's handler_state are {len(body)} bytes, "
                   f"more than {_SHELL_MAX}")
    doc = _decode_whole(body, _shell)
    if state is not None and doc.snapshot is not None:
        doc.snapshot.handler_state = _base64(walk.view[state[0] + 1:state[1] - 1], pause)
    spans = records if records is not None else array("q")
    for i in range(len(spans) // 2):
        start, end = spans[2 * i], spans[2 * i + 1]
        try:
            doc.records.append(_record.decode(walk.view[start:end]))
        except msgspec.ValidationError as exc:
            raise _bad(f"{exc} (in records[{i}])") from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise _bad(f"records[{i}]: {exc}") from None
        pause.after(end - start)
    return _checked(doc)


def _decode_whole(data: bytes | memoryview, decoder: msgspec.json.Decoder[ExportDocument] = _whole) -> ExportDocument:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _bad(str(exc)) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # (msgspec raises the latter for bad UTF-8)
        raise BadRequest(f"not a sessiond export (not JSON): {exc}") from None


def _record_spans(walk: _Walk) -> array[int]:
    """Where each record of the array here lies, start and end (each
    checked to be an object of a record's shape; `msgspec` checks the rest)."""
    spans = array("q")
    if walk.char() != b"[":
        walk.value()  # (not an array: the shell's decode says what it is)
        raise _bad("records is not an array")
    walk.pos += 1
    if walk.char() == b"]":
        walk.pos += 1
        return spans
    while True:
        spans.extend(walk.record(len(spans) // 2))
        c = walk.char()
        walk.pos += 1
        if c == b"]":
            return spans
        if c != b",":
            raise _bad(f"expected ',' or ']' at byte {walk.pos - 1} (records)")


def _snapshot(walk: _Walk) -> tuple[bytes, tuple[int, int] | None]:
    """The snapshot object here without its handler_state (JSON), and
    where that state's string lies."""
    members: list[bytes] = []
    state: tuple[int, int] | None = None
    for key, _ in walk.members("the snapshot"):
        start, end = walk.value()
        if key == "handler_state" and walk.data[start:start + 1] == b'"':
            if state is not None:
                raise _bad("two handler_state members")
            state = (start, end)
        else:
            members.append(_json.encode(key) + b":" + walk.data[start:end])
    return b"{" + b",".join(members) + b"}", state


def _base64(text: memoryview, pause: Pause) -> bytes:
    """The bytes `text` (a JSON string's inside: standard base64, as msgspec
    writes bytes) stands for, a chunk at a time.  Padding ends the string
    only; a string with JSON escapes in it (`\\/`, as some encoders write
    a slash) is read as a string first, whole (no exporter of ours does)."""
    out = []
    for at in range(0, len(text), _CHUNK):
        chunk = bytes(text[at:at + _CHUNK])
        if b"\\" in chunk:
            return _base64_escaped(text)
        if b"=" in chunk[:-2] or (at + _CHUNK < len(text) and b"=" in chunk):
            raise _bad("the snapshot's handler_state is not base64: padding inside it")
        try:
            out.append(binascii.a2b_base64(chunk, strict_mode=True))
        except binascii.Error as exc:
            raise _bad(f"the snapshot's handler_state is not base64: {exc}") from None
        pause.after(_CHUNK)
    return b"".join(out)


def _base64_escaped(text: memoryview) -> bytes:
    try:
        return msgspec.json.decode(b'"' + bytes(text) + b'"', type=bytes)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise _bad(f"the snapshot's handler_state: {exc}") from None


def _checked(doc: ExportDocument) -> ExportDocument:
    if doc.snapshot is not None and doc.snapshot.handler_state:
        check_msgpack(doc.snapshot.handler_state, "the snapshot's handler_state", Pause())
    return doc


def check_msgpack(data: bytes | memoryview, what: str, pause: Pause | None = None) -> None:
    """`data` is one msgpack value, decoded whole when it is short; else
    its array or map is cut into its items' bytes (a skim: no object
    made) and each is checked so, a slice at a time."""
    try:
        if len(data) <= _CHUNK or pause is None:
            _msgpack.decode(data)
            return
        try:
            items = _msgpack_items.decode(data)
        except msgspec.ValidationError:
            _msgpack.decode(data)  # (one string or bytes: a copy, nothing to cut)
            return
    except (msgspec.DecodeError, UnicodeDecodeError):  # (a str of bad UTF-8 raises the latter)
        raise _bad(f"{what} is not msgpack") from None
    for item in items.values() if isinstance(items, dict) else items:
        check_msgpack(memoryview(item), what, pause)
        pause.after(len(item))


def encode_document(doc: ExportDocument) -> bytes | bytearray:
    """`doc` as JSON, its records and its handler state encoded a piece at
    a time into one buffer (no list of 100,000 pieces to join, nor to free
    at once: freeing is work that holds the GIL too).  (In a thread.)"""
    if WHOLE:
        return _json.encode(doc)
    pause = Pause()
    records, snapshot = doc.records, doc.snapshot
    out = bytearray(_json.encode(msgspec.structs.replace(doc, records=[], snapshot=None))[:-1])
    if snapshot is not None:
        rest = _json.encode(msgspec.structs.replace(snapshot, handler_state=b""))
        out += b',"snapshot":'
        state = snapshot.handler_state
        if state:
            out += b'{"handler_state":"'
            step = _CHUNK // 4 * 3
            for at in range(0, len(state), step):
                out += binascii.b2a_base64(state[at:at + step], newline=False)
                pause.after(step)
            out += b'",'
            out += rest[1:]
        else:
            out += rest
    if records:
        out += b',"records":['
        for i, rec in enumerate(records):
            if i:
                out += b","
            piece = _json.encode(rec)
            out += piece
            pause.after(len(piece))
        out += b"]"
    out += b"}"
    return out  # (not bytes(out): a copy of 10 MB, in one call, page faults and all)


def free(items: list[Any]) -> None:
    """Empty `items` a slice at a time (in a thread: freeing 100,000
    records at once, where the last reference to them went, holds the GIL
    for ms; on the loop, the loop)."""
    pause = Pause()
    while items:
        del items[-_ITEMS:]
        pause.item()
