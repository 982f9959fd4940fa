"""The PostgreSQL store's schema: its tables, and the migrations that take
a database from any earlier version to this one (supervisor.store.postgres.store opens
the store with `migrate`, in a transaction of its own)."""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from supervisor.errors import StoreError

__all__ = ["SCHEMA_VERSION", "migrate"]

log = logging.getLogger("sessiond.store")

# Each entry moves the schema one version up; never edit one that shipped.
_MIGRATIONS: list[str] = [
    """
    CREATE TABLE sessiond_sessions (
        id text PRIMARY KEY,
        gen bigint NOT NULL,
        next_pos bigint NOT NULL,
        snap_gen bigint NOT NULL DEFAULT 0,
        snapshot bytea,
        created_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE sessiond_records (
        session text NOT NULL REFERENCES sessiond_sessions (id) ON DELETE CASCADE,
        pos bigint NOT NULL,
        frame bytea NOT NULL,
        PRIMARY KEY (session, pos)
    );
    """,
    # Several daemons on one database (supervisor.cluster.fronts): which one holds
    # each session, and until when each daemon's hold lasts unrenewed.
    """
    ALTER TABLE sessiond_sessions ADD COLUMN holder text;
    CREATE TABLE sessiond_fronts (
        id text PRIMARY KEY,
        host text NOT NULL,
        pid integer NOT NULL,
        expires_at timestamptz NOT NULL
    );
    """,
    # The spend ledger (supervisor.store.postgres.spend): one row a session
    # or uid, outliving the sessions; `entry` NULL only inside a charge.
    """
    CREATE TABLE sessiond_spend (
        principal text PRIMARY KEY,
        entry bytea
    );
    """,
]
SCHEMA_VERSION = len(_MIGRATIONS)
# pg_advisory_xact_lock key: daemons starting together migrate one at a time.
_MIGRATION_LOCK = 0x5E55_10D0


def migrate(cur: psycopg.Cursor[Any], where: str) -> None:
    """Inside a transaction: create or migrate the schema; one daemon at a
    time (daemons starting together wait for each other)."""
    cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
    cur.execute("CREATE TABLE IF NOT EXISTS sessiond_schema (version integer NOT NULL)")
    cur.execute("SELECT version FROM sessiond_schema")
    row = cur.fetchone()
    version = row[0] if row is not None else 0
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the database at {where} holds sessiond schema version {version}, newer than "
            f"this sessiond knows ({SCHEMA_VERSION}): upgrade sessiond, or use another database")
    for number, ddl in enumerate(_MIGRATIONS[version:], start=version + 1):
        cur.execute(ddl.encode())
        log.info("PostgreSQL store at %s: schema migrated to version %d", where, number)
    if row is None:
        cur.execute("INSERT INTO sessiond_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
    elif version != SCHEMA_VERSION:
        cur.execute("UPDATE sessiond_schema SET version = %s", (SCHEMA_VERSION,))
