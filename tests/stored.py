"""A state directory with many sessions in it, made without a daemon: each
an echo session with one committed turn, written through the file store's
own API (supervisor.store.files), without an fsync (no crash comes before
a daemon reads them).  Thousands a second, against hundreds for creates
through a daemon: for start-up tests and bench/scale.py."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from pathlib import Path

from supervisor.store.files import Commit, InputRecord, Meta, SessionStore

__all__ = ["echo_sessions"]


def echo_sessions(state_dir: Path, ids: Iterable[str], owner_uid: int, *, parent: str | None = None) -> int:
    """Sessions `ids` under `state_dir`/sessions, hibernated, each with one
    turn ("1: stored"); a daemon started there loads them as its own (with
    `[daemon] session_uid_range = ""`: they have no uid of their own).
    Returns how many were made."""
    root = state_dir / "sessions"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    made, now = 0, time.time()
    for sid in ids:
        meta = Meta(id=sid, handler="echo", created_at=now, owner_uid=owner_uid, parent=parent,
                    depth=1 if parent else 0, workspace=f"{sid}@{secrets.token_hex(8)}")
        log = SessionStore.create(root, meta, durable=False)
        log.append(InputRecord(turn=1, text="stored", seq=1, at=now), durable=False)
        log.append(Commit(turn=1, reply="1: stored", record=b"\x01", seq=2), durable=False)
        log.close()
        made += 1
    return made
