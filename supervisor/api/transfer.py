"""A session's stored past, read back: `history`, `export` and `import`.

Runs in the daemon's loop, and keeps off it what grows with a document:
one request for a 10 MB document must not hold every other client's ping
for the time its turns take to decode, check or encode.  So decoding,
checking, encoding and the replay of what an import wrote run in a thread
(`asyncio.to_thread`), and the store's reads too where the store is files
(`SessionStore.read_history` opens and reads files by path, touching no
state the loop changes); other stores are read on the loop, as before.
An import's writes stay on the loop, in the order `create` writes them
(the metadata, durable, then the snapshot and the records, then one
`sync_soon` for them all), yielding to other work every `_SLICE` records.
Documents are bounded: `[daemon] max_document_bytes` for an import's
input and an export's output, and one frame must carry either.

Reading is the store's `read_history()`: the
last snapshot and the records after it (at most `snapshot_every_turns`
turns' worth), so a history or an export costs O(what the log holds), not
O(every turn ever).

The export document is JSON (`ExportDocument`): the session's handler,
its overrides, the snapshot's handler state and the turn records, all
self-contained; it names no path, uid, workspace or generation.  `import`
treats it as hostile: it is decoded strictly (unknown fields, wrong types
and out-of-range values refused), the id, handler and overrides go through
the same checks as `create`, the turns must follow one another, every
handler record must be msgpack, and the daemon picks the workspace, the
uid, the owner and the seq numbers itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta as Bound

from ipc import messages as m
from ipc import operator as op
from supervisor.api import story
from supervisor.errors import BadRequest, Conflict, LimitError
from supervisor.core.ledger import store_failure
from supervisor.ops.logtag import tagged
from supervisor.core.overrides import OverrideError, resolve_overrides
from supervisor.core.session import Session, valid_session_id
from supervisor.store.state_store import (
    Abort,
    Commit,
    InputRecord,
    LoadedSession,
    Record,
    Resume,
    Snapshot,
    StoreError,
)
from supervisor.store.files import SessionStore

from supervisor.core.overrides import check_handler

if TYPE_CHECKING:
    from supervisor.core.manager import SessionManager

log = logging.getLogger("sessiond.manager")

__all__ = ["ExportDocument", "decode_document", "export_document", "history", "import_session", "turn_records"]

_SLICE = 512  # records an import appends between two yields to the loop

FORMAT: Literal["sessiond-session"] = "sessiond-session"
_TEXT_MAX = 8 * 1024 * 1024
_Turn = Annotated[int, Bound(ge=1, le=1 << 40)]
_Text = Annotated[str, Bound(max_length=_TEXT_MAX)]
_Usage = dict[Annotated[str, Bound(max_length=64)], Annotated[int, Bound(ge=0, le=1 << 53)]]


class _Doc(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    pass


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
    snapshot: ExportedSnapshot | None = None
    records: list[ExportedRecord] = []


_decoder = msgspec.json.Decoder(ExportDocument)
_msgpack = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


async def _read(session: Session) -> tuple[Snapshot | None, list[Record]]:
    store = session.store
    if isinstance(store, SessionStore):
        try:
            return await asyncio.to_thread(store.read_history)
        except (OSError, StoreError):
            pass  # a snapshot replaced the logs meanwhile: read again, on the loop
    try:
        return await store.read_history_soon()
    except StoreError as exc:
        raise Conflict(f"session {session.id}: its stored state cannot be read: {exc}") from None


# ---------------------------------------------------------------- history


async def history(session: Session, limit: int | None, max_bytes: int = 8 << 20) -> op.HistoryReply:
    """The turns the log holds (the last `limit` of them), with the tool
    calls the agent handler recorded, and the running turn as "open".
    The newest turns that fit in `max_bytes` (one frame must carry the
    reply); those left out are counted in `omitted_turns`."""
    if limit is not None and limit < 0:
        raise BadRequest("--limit must be 0 or more")
    snap, records = await _read(session)
    return await asyncio.to_thread(_history, session.id, session.meta.handler, snap, records, limit, max_bytes)


def _history(session_id: str, handler: str, snap: Snapshot | None, records: list[Record],
             limit: int | None, max_bytes: int) -> op.HistoryReply:
    """(In a thread: reads only its arguments.)"""
    turns: dict[int, op.HistoryTurn] = {}
    between: list[Record] = []  # the open turn's records after its input
    for rec in records:
        match rec:
            case InputRecord(turn=turn, text=text, at=at):
                turns[turn] = op.HistoryTurn(turn=turn, input=text, at=at)
                between = []
                continue
            case Commit(turn=turn) if turn in turns:
                t = turns[turn]
                t.outcome, t.reply, t.interrupted, t.usage = "done", rec.reply, rec.interrupted, rec.usage
                t.tool_calls, t.tool_results = _tools(rec.record)
                t.events = story.tell(session_id, turn, between, rec)
            case Abort(turn=turn) if turn in turns:
                t = turns[turn]
                t.outcome, t.reason = "aborted", rec.reason
                t.tool_calls, t.tool_results = _tools(rec.record)
                t.events = story.tell(session_id, turn, between, rec)
            case Resume(turn=turn) if turn in turns:
                turns[turn].resumed.append({"at": rec.at, "reason": rec.reason, "cause": rec.cause,
                                            "step": rec.step})
        between.append(rec)
    ordered = sorted(turns.values(), key=lambda t: t.turn)
    if limit is not None:
        ordered = ordered[len(ordered) - limit:] if limit else []
    kept: list[op.HistoryTurn] = []
    budget = max_bytes
    for t in reversed(ordered):
        budget -= len(_encoder.encode(t))
        if budget < 0:
            break
        kept.append(t)
    kept.reverse()
    earlier: list[dict[str, Any]] = []
    if snap is not None and handler == "agent" and len(kept) == len(ordered):
        state = story.decoded(snap.handler_state)
        if isinstance(state, dict) and isinstance(state.get("messages"), list):
            earlier = [msg for msg in state["messages"] if isinstance(msg, dict)]
            if len(_encoder.encode(earlier)) > budget:
                earlier = []  # the turns came first; `history --json` of the export has them all
    return op.HistoryReply(id=0, session=session_id, earlier_turns=snap.turns if snap else 0,
                          earlier_messages=earlier, turns=kept, omitted_turns=len(ordered) - len(kept))


def _tools(record: bytes) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Tool calls and results from an agent turn record ({"ops": [{"op":
    "append", "message": {...}}]}); nothing for other handlers' records."""
    data = story.decoded(record)
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    if not isinstance(data, dict) or not isinstance(data.get("ops"), list):
        return calls, results
    names: dict[str, str] = {}
    raw_ok = data.get("tool_ok")
    tool_ok: dict[str, Any] = raw_ok if isinstance(raw_ok, dict) else {}
    for op in data["ops"]:
        msg = op.get("message") if isinstance(op, dict) and op.get("op") == "append" else None
        if not isinstance(msg, dict):
            continue
        for call in msg.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            if isinstance(fn, dict):
                names[str(call.get("id", ""))] = str(fn.get("name", "?"))
                calls.append({"id": str(call.get("id", "")), "name": str(fn.get("name", "?")),
                              "arguments": fn.get("arguments", "")})
        if msg.get("role") == "tool":
            cid = str(msg.get("tool_call_id", ""))
            result = {"id": cid, "name": names.get(cid, "?"), "output": msg.get("content", "")}
            if isinstance(tool_ok.get(cid), bool):
                result["ok"] = tool_ok[cid]  # (none in a record older than outcomes: unknown)
            results.append(result)
    return calls, results


# ---------------------------------------------------------------- export


async def export_document(session: Session, max_bytes: int) -> bytes:
    """The session as an export document, at most `max_bytes` of it."""
    snap, records = await _read(session)
    meta = session.meta
    doc = ExportDocument(
        format=FORMAT, version=1, id=session.id, handler=meta.handler,
        overrides=dict(meta.overrides), created_at=meta.created_at, exported_at=time.time(),
        snapshot=ExportedSnapshot(turns=snap.turns, handler_state=snap.handler_state, usage=snap.usage)
        if snap is not None else None,
    )
    data = await asyncio.to_thread(_encode_export, doc, records, session.current_turn is not None)
    if len(data) > max_bytes:
        raise LimitError(f"the export of {session.id} is {len(data)} bytes, more than {max_bytes} "
                         "([daemon] max_document_bytes, and one frame must carry it: max_frame_bytes)")
    return data


def _encode_export(doc: ExportDocument, records: list[Record], running: bool) -> bytes:
    """(In a thread: reads only its arguments.)"""
    exported: list[ExportedRecord] = []
    for rec in records:
        match rec:
            case InputRecord():
                exported.append(ExportedInput(turn=rec.turn, text=rec.text, at=rec.at))
            case Commit():
                exported.append(ExportedCommit(turn=rec.turn, reply=rec.reply, record=rec.record,
                                               interrupted=rec.interrupted, usage=rec.usage))
            case Abort():
                exported.append(ExportedAbort(turn=rec.turn, reason=rec.reason, record=rec.record))
    if running and exported and isinstance(exported[-1], ExportedInput):
        exported.pop()  # the running turn: not part of the session's past yet
    doc.records = exported
    return msgspec.json.encode(doc)


# ---------------------------------------------------------------- import


def decode_document(data: bytes) -> ExportDocument:
    """The document, or BadRequest saying what is wrong with it."""
    try:
        doc = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"not a sessiond export: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"not a sessiond export (not JSON): {exc}") from None
    if doc.snapshot is not None and doc.snapshot.handler_state:
        _check_msgpack(doc.snapshot.handler_state, "the snapshot's handler_state")
    return doc


def _check_msgpack(data: bytes, what: str) -> None:
    try:
        _msgpack.decode(data)
    except msgspec.DecodeError:
        raise BadRequest(f"not a sessiond export: {what} is not msgpack") from None


def turn_records(doc: ExportDocument) -> tuple[list[Record], int]:
    """The document's records as the store's, checked to tell one story:
    each input's turn follows the one before (from the snapshot's), each
    commit or abort ends the input just before it, only the last input may
    be left open (it becomes an abort: its turn never ended).  Seq numbers
    are ours: 1, 2, ... after the snapshot's.  Returns (records, turns)."""
    turns = doc.snapshot.turns if doc.snapshot else 0
    seq = 0
    out: list[Record] = []
    open_turn: int | None = None
    for i, rec in enumerate(doc.records):
        where = f"records[{i}]"
        seq += 1
        if isinstance(rec, ExportedInput):
            if open_turn is not None:
                raise BadRequest(f"not a sessiond export: {where}: turn {open_turn} never ended")
            if rec.turn != turns + 1:
                raise BadRequest(f"not a sessiond export: {where}: turn {rec.turn} follows turn {turns}")
            turns = open_turn = rec.turn
            out.append(InputRecord(turn=rec.turn, text=rec.text, seq=seq, at=min(rec.at, time.time())))
            continue
        if rec.turn != open_turn:
            raise BadRequest(f"not a sessiond export: {where}: ends turn {rec.turn}, which is not open")
        if rec.record:
            _check_msgpack(rec.record, f"{where}.record")
        open_turn = None
        if isinstance(rec, ExportedCommit):
            out.append(Commit(turn=rec.turn, reply=rec.reply, record=rec.record,
                              interrupted=rec.interrupted, seq=seq, usage=dict(rec.usage)))
        else:
            out.append(Abort(turn=rec.turn, reason=rec.reason, record=rec.record, seq=seq))
    if open_turn is not None:
        seq += 1
        out.append(Abort(turn=open_turn, reason="the turn had not ended when it was exported", seq=seq))
    return out, turns


def _decode_and_check(data: bytes) -> tuple[ExportDocument, list[Record], int]:
    """(In a thread.)"""
    doc = decode_document(data)
    records, turns = turn_records(doc)
    return doc, records, turns


async def import_session(mgr: SessionManager, owner_uid: int, data: bytes, session_id: str | None) -> Session:
    """A new session from an export, owned by `owner_uid`: checked as
    `create` checks a client's request, then written to the store and
    restored as any stored session is (hibernated: the next input starts
    its worker from the imported state)."""
    limit = mgr.config.daemon.max_document_bytes
    if len(data) > limit:
        raise LimitError(f"the document is {len(data)} bytes, more than {limit} "
                         "([daemon] max_document_bytes)")
    if mgr.closing:
        raise Conflict("the daemon is shutting down")
    doc, records, turns = await asyncio.to_thread(_decode_and_check, data)
    session_id = doc.id if session_id is None else session_id
    if not valid_session_id(session_id):
        raise BadRequest(f"invalid session id {session_id!r}: 1-64 characters of A-Z a-z 0-9 . _ -, "
                         "starting with a letter or digit (`sessionctl import --id` renames it)")
    _check_free(mgr, session_id, owner_uid)
    try:
        settings = resolve_overrides(mgr.config.session_settings(), doc.overrides).settings
    except OverrideError as exc:
        raise BadRequest(f"the export's overrides: {exc}") from None
    check_handler(doc.handler, settings)
    if doc.handler == "agent" and (missing := settings.provider.missing_text()) is not None:
        raise BadRequest(f"the agent handler needs an LLM provider: {missing}")
    meta = mgr.new_meta(session_id, doc.handler, dict(doc.overrides), owner_uid, min(doc.created_at, time.time()))
    try:
        # The id is taken from here on: a create or import of it meets the
        # store's FileExistsError (or IdTaken) until this one is done.
        store = mgr.store.create(meta, durable=True)
    except FileExistsError:
        raise Conflict(f"session {session_id!r} already exists") from None
    except StoreError as exc:
        raise store_failure("", exc) from None
    try:
        snap = None
        if doc.snapshot is not None:
            snap = Snapshot(gen=0, meta=meta, turns=doc.snapshot.turns, seq=0,
                            handler_state=doc.snapshot.handler_state, usage=dict(doc.snapshot.usage))
            store.write_snapshot(snap)
        for i, rec in enumerate(records, 1):
            store.append(rec, durable=False)
            if i % _SLICE == 0:
                await asyncio.sleep(0)  # other clients' requests, between slices
        await store.sync_soon()
        loaded = await asyncio.to_thread(
            LoadedSession.replay, session_id, snap, records if snap is not None else [meta, *records])
        _check_free(mgr, session_id, owner_uid)  # (what changed while we wrote)
    except BaseException as exc:
        store.close()
        mgr.store.remove(session_id)
        if isinstance(exc, StoreError):
            raise store_failure(f"session {session_id!r} could not be saved: ", exc) from None
        raise
    mgr.restore(store, loaded)
    session = mgr.sessions[session_id]
    tagged(log, session_id).info("imported (%d turns, handler %s)", turns, doc.handler)
    return session


def _check_free(mgr: SessionManager, session_id: str, owner_uid: int) -> None:
    if mgr.closing:
        raise Conflict("the daemon is shutting down")
    if session_id in mgr.sessions:
        raise Conflict(f"session {session_id!r} already exists (`sessionctl import --id NEW` renames it)")
    mgr.check_quota(owner_uid)
