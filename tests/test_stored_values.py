"""Values read back from a store are data: a session whose stored owner,
workspace, uid or handler would not pass create's checks is not acted on
after a restart.  It is `damaged` with the reason (in `status` and the
log), never given to the uid written in, its workspace never used, and its
`rm` removes nothing outside its own directory.

What a tool that reached the store (the issue's PostgreSQL attack) could
write is written here the same way: rows rewritten with SQL, or the file
store's snapshot rewritten, while the daemon is down."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import psycopg
import pytest
import tomli_w

from conftest import FAST_CONFIG
from harness import Daemon
from pg_server import PgServer
from supervisor.store.logscan import frame_record
from supervisor.store.state_store import Meta, Snapshot
from supervisor.store.files import SessionStore
from test_access import open_root  # noqa: F401 (fixture)

STRANGER = 4321  # a uid the daemon does not admit


def _config(extra: dict[str, Any] | None = None) -> str:
    data = tomllib.loads(FAST_CONFIG)
    data.setdefault("agent", {})["handler"] = "echo"
    for key, value in (extra or {}).items():
        data.setdefault(key, {}).update(value)
    return tomli_w.dumps(data)


def _forgeries(canary: Path) -> dict[str, dict[str, Any]]:
    """Session id -> the fields a tool rewrites."""
    return {
        "owner": {"owner_uid": STRANGER},
        "dotdot": {"workspace": ".."},
        "absolute": {"workspace": str(canary)},
        "nested": {"workspace": "a/b"},
        "handler": {"handler": "os:system"},
    }


def _canary(root: Path) -> Path:
    canary = root / "canary"
    canary.mkdir()
    (canary / "keep").write_text("mine")
    return canary


def _create_all(d: Daemon, ids: list[str]) -> None:
    with d.client() as c:
        for sid in ids:
            c.create(session=sid)
            assert c.send_text(sid, "hi") == "1: hi"


def _check_after_restart(d: Daemon, forged: dict[str, dict[str, Any]], canary: Path,
                         good: list[str]) -> None:
    state = d.state_dir
    with d.client() as c:
        for sid, fields in forged.items():
            info = c.status(sid)
            assert info.state == "damaged", (sid, info)
            what = {"owner_uid": "stored owner uid", "workspace": "stored workspace",
                    "handler": "stored handler", "run_uid": "stored uid"}[next(iter(fields))]
            assert what in (info.error or ""), (sid, info.error)
            assert info.owner_uid != STRANGER
        for sid in good:
            assert c.status(sid).state == "hibernated"
        for sid in forged:
            c.remove(sid)
        # Nothing outside each session's own directory went.
        assert state.is_dir() and (state / "workspaces").is_dir()
        assert (canary / "keep").read_text() == "mine"
        for sid in good:
            assert d.workspace(sid).is_dir()
            assert c.send_text(sid, "again") == "2: again"
    for sid in forged:
        assert f"session={sid} is damaged" in d.log or f"{sid} is damaged" in d.log, d.log[-2000:]


@pytest.mark.process
def test_forged_values_in_the_file_store_are_not_acted_on(make_daemon, open_root: Path) -> None:  # noqa: F811
    canary = _canary(open_root)
    # Each session its own uid (a root daemon's default): a uid rewritten
    # to another session's is caught too.
    d = make_daemon(_config(), root=open_root / "d", trust=False)
    forged = _forgeries(canary)
    ids = [*forged, "shared_uid", "missing_ws", "victim", "good"]
    _create_all(d, ids)
    with d.client() as c:
        victim_ws = d.workspace("victim")
    victim_uid = victim_ws.stat().st_uid
    forged["shared_uid"] = {"run_uid": victim_uid}
    # The victim's uid again, with a workspace of its own that was never made.
    forged["missing_ws"] = {"run_uid": victim_uid, "workspace": f"missing_ws@{'f' * 16}"}
    d.stop()
    for sid, fields in forged.items():
        st, loaded = SessionStore.load(d.state_dir / "sessions" / sid)
        meta = msgspec.structs.replace(loaded.meta, **fields)
        st.write_snapshot(Snapshot(gen=0, meta=meta, turns=loaded.turns, seq=loaded.seq, mark=loaded.mark,
                                   usage=loaded.usage))
        st.close()
    d.start()
    _check_after_restart(d, forged, canary, ["victim", "good"])
    assert victim_ws.is_dir() and victim_ws.stat().st_uid == victim_uid


def _sql(dsn: str, query: str, *args: object) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query.encode(), args)
        return cur.fetchall() if cur.description else []


@pytest.mark.process
def test_forged_rows_in_postgresql_are_not_acted_on(make_daemon, pg_server: PgServer, tmp_path: Path) -> None:
    dsn = pg_server.fresh_dsn()
    canary = _canary(tmp_path)
    d = make_daemon(_config({"store": {"backend": "postgres", "dsn": dsn}}))
    forged = _forgeries(canary)
    _create_all(d, [*forged, "good"])
    d.stop()
    for sid, fields in forged.items():
        frame = bytes(_sql(dsn, "SELECT frame FROM sessiond_records WHERE session = %s AND pos = "
                                "(SELECT min(pos) FROM sessiond_records WHERE session = %s)", sid, sid)[0][0])
        meta = msgspec.msgpack.decode(frame[8:], type=Meta)
        forged_frame = frame_record(msgspec.structs.replace(meta, **fields))
        _sql(dsn, "UPDATE sessiond_records SET frame = %s WHERE session = %s AND pos = "
                  "(SELECT min(pos) FROM sessiond_records WHERE session = %s)", forged_frame, sid, sid)
    d.start()
    _check_after_restart(d, forged, canary, ["good"])


@pytest.mark.process
def test_a_row_filed_under_another_sessions_id_is_not_believed(make_daemon, pg_server: PgServer) -> None:
    """A row whose metadata names another session (the victim's) would
    otherwise be restored as that session."""
    dsn = pg_server.fresh_dsn()
    d = make_daemon(_config({"store": {"backend": "postgres", "dsn": dsn}}))
    _create_all(d, ["victim", "mine"])
    d.stop()
    frame = bytes(_sql(dsn, "SELECT frame FROM sessiond_records WHERE session = 'mine' ORDER BY pos LIMIT 1")[0][0])
    meta = msgspec.msgpack.decode(frame[8:], type=Meta)
    _sql(dsn, "UPDATE sessiond_records SET frame = %s WHERE session = 'mine' AND pos = "
              "(SELECT min(pos) FROM sessiond_records WHERE session = 'mine')",
         frame_record(msgspec.structs.replace(meta, id="victim", owner_uid=os.geteuid())))
    d.start()
    with d.client() as c:
        assert c.status("victim").state == "hibernated"
        mine = c.status("mine")
        assert mine.state == "damaged" and "another session" in (mine.error or "")
        assert c.send_text("victim", "still mine") == "2: still mine"


@pytest.mark.process
def test_an_import_with_a_uid_of_its_own_is_not_damaged(make_daemon, open_root: Path) -> None:  # noqa: F811
    """Its workspace is made at its first start: not being there yet is no
    sign of a forgery."""
    d = make_daemon(_config(), root=open_root / "d", trust=False)
    _create_all(d, ["orig"])
    with d.client() as c:
        doc = c.export("orig")
        copy = c.import_session(doc, session="copy")
        assert copy.state != "damaged", copy
        assert c.send_text("copy", "more") == "2: more"
        assert d.workspace("copy").stat().st_uid != d.workspace("orig").stat().st_uid
