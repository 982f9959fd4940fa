"""A session imported from an export (`sessionctl import`), admitted as
`create` admits a client's request: the daemon open, its id valid and
free, its owner under quota, its overrides held to this daemon's ceilings,
its handler allowed (and a provider for the agent); then written to the
store (the id is taken from the first, durable write), its spend counted,
and restored as any stored session is: hibernated, its next input starts
its worker from the imported state.  A failure leaves nothing behind.

Runs in the daemon's loop; the replay of what was written runs in a
thread.  The document (decoded strictly, its records turned into the
store's) is supervisor.api.transfer's, which hands over an `Imported`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from supervisor.config import Config
from supervisor.errors import BadRequest, Conflict
from supervisor.core.budgets import Budgets
from supervisor.core.ledger import store_failure
from supervisor.core.overrides import OverrideError, check_handler, resolve_overrides
from supervisor.core.session import Session, valid_session_id
from supervisor.logtag import tagged
from supervisor.store.state_store import (
    Abort, Commit, InputRecord, LoadedSession, Meta, Record, SessionLog, Snapshot, StateStore, StoreError,
)

__all__ = ["Imported", "admit"]

log = logging.getLogger("sessiond.manager")

_SLICE = 128  # records appended between two yields to the loop
_SLICE_BYTES = 256 * 1024  # ... or this much of their text, written on the loop


@dataclass(slots=True)
class Imported:
    """What an export says, as the store holds it."""

    id: str
    handler: str
    overrides: dict[str, Any]
    created_at: float
    snapshot: tuple[int, bytes, dict[str, int]] | None  # turns, handler state, usage
    records: list[Record]
    turns: int
    spent: dict[str, int] | None  # None: the document says nothing (unknown, not zero)


class Registry(Protocol):
    """What of the registry an import needs (supervisor.core.intake)."""

    def check_quota(self, uid: int) -> None: ...
    def new_meta(self, session_id: str, handler: str, overrides: dict[str, Any], owner_uid: int,
                 created_at: float) -> Meta: ...
    def restore(self, store: SessionLog, loaded: LoadedSession) -> None: ...
    @property
    def sessions(self) -> dict[str, Session]: ...


async def admit(registry: Registry, store: StateStore, budgets: Budgets, config: Config,
                closing: Callable[[], bool], owner_uid: int, session_id: str | None, doc: Imported,
                free: Callable[[list[Any]], None]) -> Session:
    session_id = doc.id if session_id is None else session_id
    if not valid_session_id(session_id):
        raise BadRequest(f"invalid session id {session_id!r}: 1-64 characters of A-Z a-z 0-9 . _ -, "
                         "starting with a letter or digit (`sessionctl import --id` renames it)")
    _check_free(registry, closing, session_id, owner_uid)
    try:
        settings = resolve_overrides(config.session_settings(), doc.overrides).settings
    except OverrideError as exc:
        raise BadRequest(f"the export's overrides: {exc}") from exc
    check_handler(doc.handler, settings)
    if doc.handler == "agent" and (missing := settings.provider.missing_text()) is not None:
        raise BadRequest(f"the agent handler needs an LLM provider: {missing}")
    meta = registry.new_meta(session_id, doc.handler, dict(doc.overrides), owner_uid,
                             min(doc.created_at, time.time()))
    try:
        # The id is taken from here on: a create or import of it meets the
        # store's FileExistsError (or IdTaken) until this one is done.
        log_ = store.create(meta, durable=True)
    except FileExistsError as exc:
        raise Conflict(f"session {session_id!r} already exists") from exc
    except StoreError as exc:
        raise store_failure("", exc) from None  # unchained: a database's error may quote its DSN
    records = doc.records
    try:
        await budgets.imported(session_id, owner_uid, doc.spent)
        snap = None
        if doc.snapshot is not None:
            turns, state, usage = doc.snapshot
            snap = Snapshot(gen=0, meta=meta, turns=turns, seq=0, handler_state=state, usage=dict(usage))
            log_.write_snapshot(snap)
        count = size = 0
        for rec in records:
            log_.append(rec, durable=False)
            count, size = count + 1, size + _size(rec)
            if count >= _SLICE or size >= _SLICE_BYTES:
                count = size = 0
                await asyncio.sleep(0)  # other clients' requests, between slices
        await log_.sync_soon()
        loaded = await asyncio.to_thread(
            LoadedSession.replay, session_id, snap, records if snap is not None else [meta, *records])
        await asyncio.to_thread(free, records)
        _check_free(registry, closing, session_id, owner_uid)  # (what changed while we wrote)
    except BaseException as exc:
        log_.close()
        store.remove(session_id)
        budgets.forget(session_id)
        if isinstance(exc, StoreError):
            raise store_failure(f"session {session_id!r} could not be saved: ", exc) from None
        raise
    registry.restore(log_, loaded)
    tagged(log, session_id).info("imported (%d turns, handler %s)", doc.turns, doc.handler)
    return registry.sessions[session_id]


def _size(rec: Record) -> int:
    match rec:
        case InputRecord(text=text):
            return len(text)
        case Commit(reply=reply, record=record):
            return len(reply) + len(record)
        case Abort(reason=reason, record=record):
            return len(reason) + len(record)
    return 0


def _check_free(registry: Registry, closing: Callable[[], bool], session_id: str, owner_uid: int) -> None:
    if closing():
        raise Conflict("the daemon is shutting down")
    if session_id in registry.sessions:
        raise Conflict(f"session {session_id!r} already exists (`sessionctl import --id NEW` renames it)")
    registry.check_quota(owner_uid)
