"""The spend ledger: what each session and each uid spent on LLM calls,
kept apart from the sessions' logs so that it outlives `export`, `import`
and `rm` (docs/limits.md, "Budgets").

Runs in the daemon: `fold` on its loop (supervisor.core.budgets keeps a
copy of the book folded as charges are made) and on the thread of a store
that writes the book.  A principal is a session (by id) or an owner uid;
each holds a running total, not a log of calls: the book is as large as
the principals it names, and each store keeps it that way (the file store
rewrites its file as one `Book` once its charges outgrow it).

What changes a book is a `Charge`, applied in the order charges were made:

    add      spend counted: the session's total and its uid's grow (an LLM
             call as it begins, tokens as the provider reports them); the
             session's `turn_spent` is the running turn's share, so that a
             daemon that restarts during a turn does not count again what
             the resumed turn replays
    opens    a session's entry starts here, only if it has none: an import
             (its document's figures, or `unknown`, its uid not charged:
             its past was spent elsewhere or is already in the uid's total),
             or a session the book never saw (`uid_too`: its logs' figures,
             from before the ledger, charged to its uid as well)
    drop     the session's entry goes (`rm`); its uid's total keeps it all

`SpendBook` is the seam a `StateStore` offers (`StateStore.spend`); every
implementation passes the same contract (tests/test_store_contract.py):
`read()` gives the book as it was last made durable, and a `write` whose
future completed survives a crash.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import Mapping
from typing import Protocol

import msgspec

from ipc.budget import SPEND_KEYS

__all__ = ["Book", "Charge", "Entry", "SpendBook", "copy_book", "decode_frames", "fold", "frame"]


class Entry(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One session's figures."""

    spent: dict[str, int] = {}
    # The turn whose charges `turn_spent` sums (0: none yet).
    turn: int = 0
    turn_spent: dict[str, int] = {}
    # Imported from a document without figures: what it spent before is not known.
    unknown: bool = False


class Charge(msgspec.Struct, tag="charge", tag_field="k", omit_defaults=True, kw_only=True):
    session: str = ""
    uid: int | None = None
    add: dict[str, int] = {}
    turn: int = 0
    opens: bool = False
    uid_too: bool = False  # (with `opens`)
    unknown: bool = False  # (with `opens`)
    drop: bool = False


class Book(msgspec.Struct, tag="book", tag_field="k", omit_defaults=True, kw_only=True):
    sessions: dict[str, Entry] = {}
    uids: dict[int, dict[str, int]] = {}


def copy_book(book: Book) -> Book:
    return _book_decoder.decode(_encoder.encode(book))


def _grow(into: dict[str, int], more: Mapping[str, int]) -> None:
    for key, value in more.items():
        if key in SPEND_KEYS and value > 0:
            into[key] = into.get(key, 0) + value


def fold(book: Book, charge: Charge) -> None:
    """Apply `charge` to `book` (in place).  Pure; the one rule of what a
    charge does, for every store and for the daemon's copy alike."""
    sid = charge.session
    if charge.drop:
        book.sessions.pop(sid, None)
        return
    if charge.opens:
        if not sid or sid in book.sessions:
            return  # (another daemon sharing the store, or an earlier start, opened it)
        entry = Entry(unknown=charge.unknown)
        _grow(entry.spent, charge.add)
        book.sessions[sid] = entry
        if charge.uid_too and charge.uid is not None:
            _grow(book.uids.setdefault(charge.uid, {}), charge.add)
        return
    if sid:
        entry = book.sessions.setdefault(sid, Entry())
        _grow(entry.spent, charge.add)
        if charge.turn:
            if entry.turn != charge.turn:
                entry.turn, entry.turn_spent = charge.turn, {}
            _grow(entry.turn_spent, charge.add)
    if charge.uid is not None:
        _grow(book.uids.setdefault(charge.uid, {}), charge.add)


class SpendBook(Protocol):
    """The ledger as a store keeps it.  Used from the daemon's loop."""

    def read(self) -> Book:
        """Every principal, as last made durable (at start; a copy)."""
        ...

    def write(self, charges: list[Charge]) -> asyncio.Future[Book | None]:
        """Apply `charges`, in order, after every earlier write; the future
        completes once they are durable, or fails with `StoreError` (then
        none of them is kept).  Its result: None, or, from a store that
        daemons share, the principals the charges named as the store holds
        them now (other daemons' charges to the same uid included)."""
        ...

    def close(self) -> None:
        """Land the writes in flight; no more writes."""
        ...


# ---------------------------------------------------------------- a book in bytes (the file and memory stores)

_HEAD = struct.Struct(">II")  # u32 length | u32 crc32, then msgpack: as a session log's records
_MAX_FRAME = 64 << 20
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Book | Charge)
_book_decoder = msgspec.msgpack.Decoder(Book)


def frame(item: Book | Charge) -> bytes:
    body = _encoder.encode(item)
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def _frame_at(view: memoryview, pos: int) -> tuple[Book | Charge, int] | None:
    if len(view) - pos < _HEAD.size:
        return None
    length, crc = _HEAD.unpack_from(view, pos)
    end = pos + _HEAD.size + length
    if length > _MAX_FRAME or end > len(view) or zlib.crc32(view[pos + _HEAD.size:end]) != crc:
        return None
    try:
        return _decoder.decode(view[pos + _HEAD.size:end]), end
    except msgspec.DecodeError:
        return None


def decode_frames(data: bytes) -> tuple[Book, int, bool]:
    """The book `data` holds, and how many of its bytes are intact frames.
    A torn tail (bad bytes, nothing intact after them) is left out; the
    third value says whether the bytes are damaged: intact frames follow
    bad ones, or the first frame, the book a file starts with (written
    whole, then renamed into place: never torn), is bad.  Damage is never
    cut silently."""
    book = Book()
    view = memoryview(data)
    pos = 0
    while pos < len(data):
        found = _frame_at(view, pos)
        if found is None:
            damaged = pos == 0 or any(_frame_at(view, nxt) is not None for nxt in range(pos + 1, len(data)))
            return book, pos, damaged
        item, pos = found
        if isinstance(item, Book):
            book = item
        else:
            fold(book, item)
    return book, pos, False
