"""Stored /v1/responses in one SQLite file (stdlib sqlite3, WAL): the response object as sent,
its input items, and the context a continuation starts from. Every row carries its owner (the
tenant's id and a digest of its key: `Tenant.owner`); a read or delete names the owner, so
another tenant's response, or the response of a tenant id since issued with a new key, is as
good as missing.

Calls block (they are short): the routes run them off the event loop.

The file holds every tenant's conversations: it is this user's alone (0600, and so its -wal and
-shm files, which SQLite creates with the database's mode; an existing one's modes are set so at
open), its directory 0700 if we make it."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from radixserve.server.responses.protocol import Context

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    response BLOB NOT NULL,     -- the response object, JSON, as the client got it
    input_items BLOB NOT NULL,  -- this request's own input items, JSON
    context BLOB NOT NULL       -- a Context, msgpack
)"""
_INDEX = "CREATE INDEX IF NOT EXISTS responses_by_tenant ON responses (tenant, created_at)"


@dataclass
class StoredResponse:
    id: str
    tenant: str
    created_at: int
    response: bytes
    input_items: bytes
    context: bytes

    def loaded_context(self) -> Context:
        return msgspec.msgpack.decode(self.context, type=Context)


def pack_context(ctx: Context) -> bytes:
    return msgspec.msgpack.encode(ctx)


class ResponseStore:
    """One connection, shared by the executor's threads under a lock; opened at first use (a
    server that never stores a response creates no file)."""

    def __init__(self, path: Callable[[], Path], max_per_tenant: Callable[[], int]) -> None:
        self._path = path
        self._max = max_per_tenant  # past it, put() deletes the tenant's oldest
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            path = self._path()
            _private_file(path)
            db = sqlite3.connect(path, check_same_thread=False, timeout=5.0, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(_SCHEMA)
            db.execute(_INDEX)
            self._db = db
        return self._db

    def put(self, row: StoredResponse) -> None:
        """Store `row`; the tenant's oldest responses past its cap go."""
        with self._lock:
            db = self._conn()
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                       (row.id, row.tenant, row.created_at, row.response, row.input_items, row.context))
            db.execute("DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses WHERE tenant = ? "
                       "ORDER BY created_at DESC, rowid DESC LIMIT -1 OFFSET ?)", (row.tenant, self._max()))

    def get(self, tenant: str, rid: str) -> StoredResponse | None:
        with self._lock:
            cur = self._conn().execute("SELECT * FROM responses WHERE id = ? AND tenant = ?", (rid, tenant))
            found = cur.fetchone()
        return StoredResponse(*found) if found is not None else None

    def delete(self, tenant: str, rid: str) -> bool:
        with self._lock:
            cur = self._conn().execute("DELETE FROM responses WHERE id = ? AND tenant = ?", (rid, tenant))
        return cur.rowcount > 0

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _private_file(path: Path) -> None:
    """`path` exists, mode 0600, as do its -wal and -shm files if there are any; its missing
    directories are made 0700."""
    missing = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            os.chmod(f, 0o600)
        except FileNotFoundError:
            pass
