"""The spend ledger in PostgreSQL: `sessiond_spend`, one row a principal
(`s:ID` for a session, `u:UID` for an owner uid) holding its `Entry` (or,
for a uid, its totals) as msgpack.

Runs in the daemon: `write` on its loop; a thread of its own (`BookWriter`,
as the file store's) with a connection of its own applies each batch of
charges in one transaction: the rows it names are made to exist, locked
in a fixed order (`FOR UPDATE`, so that daemons sharing the database
charge one uid's row one after the other and never deadlock), folded
(supervisor.store.spend.fold, as every store) and written back; the write
answers with them, so a daemon learns what the others charged its uids.  The
server's COMMIT waits for its WAL flush, so a completed write is durable.
A connection lost mid-commit is retried (`PgLink.run`): a charge whose
commit did land is then counted twice, which errs high, never low.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import psycopg

from supervisor.store.postgres.link import PgLink
from supervisor.store.spend import Book, Charge, Entry, fold
from supervisor.store.spendfile import BookWriter

__all__ = ["PgSpendBook"]

_encode = msgspec.msgpack.Encoder().encode
_entry = msgspec.msgpack.Decoder(Entry)
_totals = msgspec.msgpack.Decoder(dict[str, int])


def _key(charge: Charge) -> list[str]:
    keys = [f"s:{charge.session}"] if charge.session else []
    return keys + ([f"u:{charge.uid}"] if charge.uid is not None else [])


def _into(book: Book, principal: str, data: bytes) -> None:
    kind, _, name = principal.partition(":")
    if kind == "s":
        book.sessions[name] = _entry.decode(data)
    elif kind == "u" and name.lstrip("-").isdigit():
        book.uids[int(name)] = _totals.decode(data)


def _rows(book: Book, principals: list[str]) -> list[tuple[str, bytes | None]]:
    out: list[tuple[str, bytes | None]] = []
    for principal in principals:
        kind, _, name = principal.partition(":")
        value: Any = book.sessions.get(name) if kind == "s" else book.uids.get(int(name))
        out.append((principal, _encode(value) if value is not None else None))
    return out


class PgSpendBook:
    def __init__(self, dsn: str, retry_secs: float, link: PgLink) -> None:
        # `link`: the loop's connection, for `read` at start.
        self._loop_link = link
        self._link = PgLink(dsn, retry_secs, name="sessiond-spend")
        self._writer = BookWriter(self._persist, "sd-pg-spend")

    def read(self) -> Book:
        def op(cur: psycopg.Cursor[Any]) -> Book:
            book = Book()
            cur.execute("SELECT principal, entry FROM sessiond_spend WHERE entry IS NOT NULL")
            for principal, data in cur.fetchall():
                _into(book, principal, bytes(data))
            return book

        return self._loop_link.run(op, "the spend ledger")

    def write(self, charges: list[Charge]) -> asyncio.Future[Book | None]:
        return self._writer.write(charges)

    def close(self) -> None:
        self._writer.close()
        self._link.close()

    def _persist(self, charges: list[Charge]) -> Book | None:
        """(On the writer thread.)  Returns the principals charged as the
        table holds them now: other daemons' charges to a uid included."""
        principals = sorted({key for c in charges for key in _key(c)})
        if not principals:
            return None

        def op(cur: psycopg.Cursor[Any]) -> Book:
            with self._link.conn.transaction():
                cur.execute("INSERT INTO sessiond_spend (principal) SELECT unnest(%s::text[]) "
                            "ON CONFLICT DO NOTHING", (principals,))
                cur.execute("SELECT principal, entry FROM sessiond_spend WHERE principal = ANY(%s) "
                            "ORDER BY principal FOR UPDATE", (principals,))
                book = Book()
                for principal, data in cur.fetchall():
                    if data is not None:
                        _into(book, principal, bytes(data))
                for charge in charges:
                    fold(book, charge)
                cur.executemany("UPDATE sessiond_spend SET entry = %s WHERE principal = %s",
                                [(data, principal) for principal, data in _rows(book, principals)])
                cur.execute("DELETE FROM sessiond_spend WHERE principal = ANY(%s) AND entry IS NULL",
                            (principals,))
            return book

        return self._link.run(op, "the spend ledger")
