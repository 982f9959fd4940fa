"""A session's stored past, read back: `history`, `export` and `import`.

Runs in the daemon's loop, and keeps off it what grows with a document:
one request for a 10 MB document must not hold every other client's ping
for the time its turns take to decode, check or encode.  So decoding,
checking, encoding and the replay of what an import wrote run in a thread
(`asyncio.to_thread`), and the store's reads too where the store is files
(`SessionStore.read_history` opens and reads files by path, touching no
state the loop changes); other stores are read on the loop, as before.
An import is admitted by the core (supervisor.core.imports), as `create`
is: its writes stay on the loop, yielding to other work between slices.
Documents are bounded: `[daemon] max_document_bytes` for an import's
input and an export's output, and one frame must carry either.

Reading is the store's `read_history()`: the
last snapshot and the records after it (at most `snapshot_every_turns`
turns' worth), so a history or an export costs O(what the log holds), not
O(every turn ever).

The export document is JSON (`ExportDocument`, supervisor.api.document,
which decodes and encodes it in slices): the session's handler,
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import msgspec

from ipc import operator as op
from supervisor.api import story
from ipc.framing import FrameEncoder
from ipc.budget import SPEND_KEYS, total
from supervisor.errors import BadRequest, Conflict, LimitError
from supervisor.core.imports import Imported
from supervisor.core.session import Session
from supervisor.store.state_store import (
    Abort,
    Commit,
    InputRecord,
    Record,
    Resume,
    Snapshot,
    StoreDamaged,
    StoreError,
)
from supervisor.store.files import SessionStore

from supervisor.api.document import (
    FORMAT, ExportDocument, ExportedAbort, ExportedCommit, ExportedInput, ExportedRecord, ExportedSnapshot,
    Pause, check_msgpack, decode_document, encode_document, free,
)

if TYPE_CHECKING:
    from supervisor.core.damage import Damage
    from supervisor.core.manager import SessionManager

log = logging.getLogger("sessiond.manager")

__all__ = ["Encoded", "ExportDocument", "ExportedAbort", "ExportedCommit", "ExportedInput", "ExportedRecord",
           "ExportedSnapshot", "decode_document", "encoded", "export_document", "history", "import_session",
           "spent_figures", "turn_records"]


_msgpack = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class Encoded:
    """A reply and its frame, encoded off the loop (`encoded`): msgpack of
    a history of 40,000 turns holds the GIL ~8 ms; the server sends the frame."""

    reply: Any
    frame: bytearray


async def encoded(reply: Any) -> Encoded:
    return Encoded(reply, await asyncio.to_thread(_encode_reply, reply))


def _encode_reply(reply: Any) -> bytearray:
    """(In a thread.)  A FrameEncoder of its own: the connection's is the
    loop's.  A history's turns are freed here too, not on the loop."""
    frame = FrameEncoder().encode(reply)
    if isinstance(reply, op.HistoryReply):
        free(reply.turns)
        free(reply.earlier_messages)
    return frame


async def _read(session: Session, damage: Damage | None) -> tuple[Snapshot | None, list[Record]]:
    """The store's read; damage it finds makes the session `damaged` at
    once (supervisor.core.damage), as the next start would."""
    store = session.store
    if isinstance(store, SessionStore):
        try:
            return await asyncio.to_thread(store.read_history)
        except (OSError, StoreError):
            pass  # a snapshot replaced the logs meanwhile: read again, on the loop
    try:
        return await store.read_history_soon()
    except StoreDamaged as exc:
        if damage is not None:
            raise await damage.found(session, exc) from None
        raise Conflict(f"session {session.id} is damaged: {exc.reason}") from None
    except StoreError as exc:
        raise Conflict(f"session {session.id}: its stored state cannot be read: {exc}") from None


# ---------------------------------------------------------------- history


async def history(session: Session, limit: int | None, damage: Damage | None = None,
                  max_bytes: int = 8 << 20) -> op.HistoryReply:
    """The turns the log holds (the last `limit` of them), with the tool
    calls the agent handler recorded, and the running turn as "open".
    The newest turns that fit in `max_bytes` (one frame must carry the
    reply); those left out are counted in `omitted_turns`."""
    if limit is not None and limit < 0:
        raise BadRequest("--limit must be 0 or more")
    snap, records = await _read(session, damage)
    return await asyncio.to_thread(_history, session.id, session.meta.handler, snap, records, limit, max_bytes)


def _history(session_id: str, handler: str, snap: Snapshot | None, records: list[Record],
             limit: int | None, max_bytes: int) -> op.HistoryReply:
    """(In a thread: reads only its arguments.)"""
    turns: dict[int, op.HistoryTurn] = {}
    between: list[Record] = []  # the open turn's records after its input
    pause = Pause()
    for rec in records:
        pause.item()
        match rec:
            case InputRecord(turn=turn, text=text, at=at):
                turns[turn] = op.HistoryTurn(turn=turn, input=text, at=at)
                between = []
                continue
            case Commit(turn=turn) if turn in turns:
                t = turns[turn]
                t.outcome, t.reply, t.interrupted, t.usage = "done", rec.reply, rec.interrupted, rec.usage
                t.stop_reason, t.stop_detail = rec.stop_reason, rec.stop_detail
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
        pause.item()
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
    omitted = len(ordered) - len(kept)
    free(records)  # (what was read: freed here, not where the reply is sent)
    free(ordered)
    return op.HistoryReply(id=0, session=session_id, earlier_turns=snap.turns if snap else 0,
                          earlier_messages=earlier, turns=kept, omitted_turns=omitted)


def _tools(record: bytes) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Tool calls and results from an agent turn record ({"ops": [{"op":
    "append", "message": {...}}]}, the framework adapters' too, whose
    messages may be Responses API items); nothing for other handlers' records."""
    data = story.decoded(record)
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    if not isinstance(data, dict) or not isinstance(data.get("ops"), list):
        return calls, results
    names: dict[str, str] = {}
    raw_ok = data.get("tool_ok")
    tool_ok: dict[str, Any] = raw_ok if isinstance(raw_ok, dict) else {}

    def result(cid: str, output: Any) -> dict[str, Any]:
        out = {"id": cid, "name": names.get(cid, "?"), "output": output}
        if isinstance(tool_ok.get(cid), bool):
            out["ok"] = tool_ok[cid]  # (none in a record older than outcomes: unknown)
        return out

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
            results.append(result(str(msg.get("tool_call_id", "")), msg.get("content", "")))
        # The Responses API's items (the OpenAI Agents SDK adapter's records).
        if msg.get("type") == "function_call":
            names[str(msg.get("call_id", ""))] = str(msg.get("name", "?"))
            calls.append({"id": str(msg.get("call_id", "")), "name": str(msg.get("name", "?")),
                          "arguments": msg.get("arguments", "")})
        elif msg.get("type") == "function_call_output":
            results.append(result(str(msg.get("call_id", "")), msg.get("output", "")))
    return calls, results


# ---------------------------------------------------------------- export


async def export_document(session: Session, max_bytes: int,
                          spent: Callable[[Session], Mapping[str, int]], damage: Damage | None = None) -> bytes:
    """The session as an export document, at most `max_bytes` of it;
    `spent`: what the spend ledger says it spent (Budgets.spent)."""
    snap, records = await _read(session, damage)
    meta = session.meta
    doc = ExportDocument(
        format=FORMAT, version=1, id=session.id, handler=meta.handler,
        overrides=dict(meta.overrides), created_at=meta.created_at, exported_at=time.time(),
        spent=dict(spent(session)),
        snapshot=ExportedSnapshot(turns=snap.turns, handler_state=snap.handler_state, usage=snap.usage)
        if snap is not None else None,
    )
    data = await asyncio.to_thread(_encode_export, doc, records, session.current_turn is not None)
    if len(data) > max_bytes:
        raise LimitError(f"the export of {session.id} is {len(data)} bytes, more than {max_bytes} "
                         "([daemon] max_document_bytes, and one frame must carry it: max_frame_bytes)")
    # A bytearray, sent as bytes are (msgpack bin): bytes(data) would copy 10 MB on the loop.
    return cast(bytes, data)


def _encode_export(doc: ExportDocument, records: list[Record], running: bool) -> bytes | bytearray:
    """(In a thread: reads only its arguments.)"""
    exported: list[ExportedRecord] = []
    pause = Pause()
    for rec in records:
        pause.item()
        match rec:
            case InputRecord():
                exported.append(ExportedInput(turn=rec.turn, text=rec.text, at=rec.at))
            case Commit():
                exported.append(ExportedCommit(turn=rec.turn, reply=rec.reply, record=rec.record,
                                               interrupted=rec.interrupted, usage=rec.usage))
            case Abort():
                exported.append(ExportedAbort(turn=rec.turn, reason=rec.reason, record=rec.record,
                                              usage=rec.usage))
    if running and exported and isinstance(exported[-1], ExportedInput):
        exported.pop()  # the running turn: not part of the session's past yet
    doc.records = exported
    data = encode_document(doc)
    free(exported)
    free(records)  # (what was read: freed here, not on the loop)
    return data


# ---------------------------------------------------------------- import


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
    pause = Pause()
    for i, rec in enumerate(doc.records):
        pause.item()
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
            check_msgpack(rec.record, f"{where}.record")
        open_turn = None
        if isinstance(rec, ExportedCommit):
            out.append(Commit(turn=rec.turn, reply=rec.reply, record=rec.record,
                              interrupted=rec.interrupted, seq=seq, usage=dict(rec.usage)))
        else:
            out.append(Abort(turn=rec.turn, reason=rec.reason, record=rec.record, seq=seq, usage=dict(rec.usage)))
    if open_turn is not None:
        seq += 1
        out.append(Abort(turn=open_turn, reason="the turn had not ended when it was exported", seq=seq))
    return out, turns


def spent_figures(doc: ExportDocument) -> dict[str, int] | None:
    """What an imported session counts as spent before its import: what
    its document says, the larger of its `spent` and its turns' usage,
    key by key; None (unknown, docs/limits.md "Budgets") when it says
    nothing: no `spent` and no usage on any turn of a session that had
    turns.  A figure is the document's word: a client may write any (the
    uid's ceilings are the ledger's own count, which no document lowers)."""
    usages = [doc.snapshot.usage] if doc.snapshot is not None else []
    usages += [rec.usage for rec in doc.records if not isinstance(rec, ExportedInput)]
    summed = total(*usages)
    if doc.spent is None and not any(summed.values()):
        had_turns = doc.records or (doc.snapshot is not None and doc.snapshot.turns)
        return None if had_turns else {}
    said = doc.spent or {}
    return {k: v for k in SPEND_KEYS if (v := max(said.get(k, 0), summed.get(k, 0)))}


def _decode_and_check(data: bytes) -> tuple[ExportDocument, list[Record], int, dict[str, int] | None]:
    """(In a thread.)  The document (less its records), them as the
    store's, its turns, what it says was spent."""
    doc = decode_document(data)
    records, turns = turn_records(doc)
    figures = spent_figures(doc)
    free(doc.records)  # (as the store's records now: freed here, not on the loop)
    return doc, records, turns, figures


async def import_session(mgr: SessionManager, owner_uid: int, data: bytes, session_id: str | None) -> Session:
    """A new session from an export, owned by `owner_uid`: the document
    decoded and checked here (off the loop), then admitted by the core as
    `create` admits a client's request (supervisor.core.imports)."""
    limit = mgr.config.daemon.max_document_bytes
    if len(data) > limit:
        raise LimitError(f"the document is {len(data)} bytes, more than {limit} "
                         "([daemon] max_document_bytes)")
    if mgr.closing:
        raise Conflict("the daemon is shutting down")
    doc, records, turns, figures = await asyncio.to_thread(_decode_and_check, data)
    snapshot = None
    if doc.snapshot is not None:
        snapshot = (doc.snapshot.turns, doc.snapshot.handler_state, dict(doc.snapshot.usage))
    imported = Imported(id=doc.id, handler=doc.handler, overrides=dict(doc.overrides), created_at=doc.created_at,
                        snapshot=snapshot, records=records, turns=turns, spent=figures)
    return await mgr.import_session(owner_uid, session_id, imported, free)
