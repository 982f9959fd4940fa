"""The spend ledger's own rules (supervisor.store.spend) and the file that
keeps it (supervisor.store.spendfile): a running total per principal, kept
compact, never reset silently.  The promises every store keeps are in
tests/test_store_contract.py."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from supervisor.errors import StoreDamaged, StoreError
from supervisor.store import spendfile
from supervisor.store.spend import Book, Charge, fold
from supervisor.store.spendfile import FileSpendBook


def _call(sid: str, uid: int, turn: int) -> Charge:
    return Charge(session=sid, uid=uid, add={"llm_calls": 1}, turn=turn)


@pytest.mark.pure
def test_a_charge_counts_for_its_session_its_turn_and_its_uid() -> None:
    book = Book()
    for charge in (_call("a", 1, 1), _call("a", 1, 1), _call("a", 1, 2), _call("b", 1, 1),
                   Charge(session="a", uid=1, add={"prompt_tokens": 10, "bogus": 5, "llm_calls": -3}, turn=2)):
        fold(book, charge)
    assert book.sessions["a"].spent == {"llm_calls": 3, "prompt_tokens": 10}  # (no unknown key, nothing negative)
    assert (book.sessions["a"].turn, book.sessions["a"].turn_spent) == (2, {"llm_calls": 1, "prompt_tokens": 10})
    assert book.uids == {1: {"llm_calls": 4, "prompt_tokens": 10}}
    fold(book, Charge(session="a", drop=True))
    assert "a" not in book.sessions and book.uids[1]["llm_calls"] == 4


def _write(book: FileSpendBook, charges: list[Charge]) -> None:
    async def go() -> None:
        await book.write(charges)

    asyncio.run(go())


@pytest.mark.component
def test_the_file_stays_as_large_as_its_principals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spendfile, "_REWRITE_BYTES", 4096)
    book = FileSpendBook(tmp_path)
    for n in range(400):
        _write(book, [_call(f"s{n % 3}", 7, n // 3 + 1)])
    book.close()
    assert (tmp_path / ".spend").stat().st_size < 4 * 4096
    again = FileSpendBook(tmp_path).read()
    assert again.uids[7] == {"llm_calls": 400}
    assert sum(e.spent["llm_calls"] for e in again.sessions.values()) == 400


@pytest.mark.component
def test_a_torn_charge_is_dropped_and_damage_stops_the_start(tmp_path: Path) -> None:
    book = FileSpendBook(tmp_path)
    _write(book, [_call("a", 1, 1)])
    _write(book, [_call("a", 1, 1)])
    _write(book, [_call("a", 1, 1)])
    book.close()
    path = tmp_path / ".spend"
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # the last charge torn: it was never acknowledged
    book = FileSpendBook(tmp_path)
    assert book.read().uids[1] == {"llm_calls": 2}
    _write(book, [_call("a", 1, 2)])
    book.close()
    # A flipped byte followed by intact charges: never cut silently.
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(StoreDamaged, match="spend ledger .* is damaged"):
        FileSpendBook(tmp_path)


@pytest.mark.component
def test_a_failed_write_fails_its_future_and_keeps_nothing_half(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    book = FileSpendBook(tmp_path)
    _write(book, [_call("a", 1, 1)])

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(spendfile, "fdatasync", full)
    with pytest.raises(StoreError, match="No space left"):
        _write(book, [_call("a", 1, 1)])
    monkeypatch.undo()
    _write(book, [_call("a", 1, 1)])
    book.close()
    assert FileSpendBook(tmp_path).read().uids[1] == {"llm_calls": 2}
