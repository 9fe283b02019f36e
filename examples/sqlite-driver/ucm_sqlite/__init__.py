"""The `sqlite` driver: every block in one SQLite database file, an example of a ucm driver
in a package of its own (docs/writing-a-driver.md walks through it).

    - driver: sqlite
      path: /var/cache/ucm/blocks.db    # created when absent

One table holds (namespace, key, block), a block being the self-describing ucm format
(`kit.frame_block`: a header with key, lengths and checksum, then the payload). A store batch
is one transaction, so a writer killed mid-batch leaves nothing half-visible; WAL lets loads
run while another connection, thread or process writes. A load checks the header and the
checksum (`kit.unframe_into`): a block damaged on disk is CORRUPT, never data.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from typing import Self

import trio
from pydantic import Field

from ucm.drivers import DriverOptions
from ucm.drivers.kit import (
    Backend,
    Codec,
    KVLayouts,
    LoadState,
    ThreadedDriver,
    Workers,
    frame_block,
    parse_codec,
    unframe_into,
)
from ucm.errors import DriverError, NoCapacity, StorageUnavailable

__all__ = ["SqliteDriver"]
__version__ = "0.1.0"

SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    namespace TEXT NOT NULL,
    key BLOB NOT NULL,
    block BLOB NOT NULL,
    PRIMARY KEY (namespace, key)
)
"""
BUSY_TIMEOUT_S = 30.0  # how long a writer waits for another connection's transaction


def _error(exc: sqlite3.Error, driver: str) -> DriverError:
    """A SQLite error that failed a whole batch, as the ucm exception tree."""
    if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return NoCapacity(str(exc), driver=driver)
    return StorageUnavailable(f"sqlite: {exc}", driver=driver)


class SqliteBlocks(Backend):
    """The synchronous half: batched calls the kit runs on worker threads. Each thread has a
    connection of its own (a sqlite3 connection is not to be shared between threads)."""

    def __init__(self, path: str, *, namespace: str, codec: Codec, name: str,
                 layouts: KVLayouts | None = None) -> None:
        self.path = path
        self.namespace = namespace
        self.codec = codec
        self.layouts = layouts  # what int8/int4 quantize with (none: stored losslessly)
        self.name = name
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        with self._db() as db:  # creates the file and the table
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(SCHEMA)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            # Autocommit (isolation_level=None): transactions are the explicit BEGINs below.
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                 check_same_thread=False)  # close() runs on another thread
            with self._lock:
                self._connections.append(db)
            self._local.db = db
        return db

    def lookup(self, keys: list[bytes]) -> list[bool]:
        db = self._db()
        try:
            return [db.execute("SELECT 1 FROM blocks WHERE namespace = ? AND key = ?",
                               (self.namespace, key)).fetchone() is not None for key in keys]
        except sqlite3.Error as exc:
            raise _error(exc, self.name) from exc

    def load(self, keys: list[bytes], views: list[memoryview]) -> list[LoadState]:
        db = self._db()
        states = []
        for key, view in zip(keys, views, strict=True):
            try:
                row = db.execute("SELECT block FROM blocks WHERE namespace = ? AND key = ?",
                                 (self.namespace, key)).fetchone()
            except sqlite3.Error:
                states.append(LoadState.FAILED)  # this key's read; the others may still work
                continue
            if row is None:
                states.append(LoadState.MISSING)
            else:  # header, size and checksum checked: a damaged block is CORRUPT
                states.append(unframe_into(key, memoryview(row[0]), view,
                                              namespace=self.namespace))
        return states

    def store(self, keys: list[bytes], views: list[memoryview]) -> list[int]:
        rows = []
        for key, view in zip(keys, views, strict=True):
            header, payload = frame_block(key, self.namespace, self.codec, view, self.layouts)
            rows.append((self.namespace, key, header + payload))
        db = self._db()
        try:
            # IMMEDIATE: take the write lock now (waiting up to the busy timeout), so the
            # batch is published whole or not at all.
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?)", rows)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise _error(exc, self.name) from exc
        return [len(block) for _, _, block in rows]

    def delete(self, keys: list[bytes]) -> None:
        try:
            self._db().executemany("DELETE FROM blocks WHERE namespace = ? AND key = ?",
                                   [(self.namespace, key) for key in keys])
        except sqlite3.Error as exc:
            raise _error(exc, self.name) from exc

    def list_units(self) -> list[None]:
        return [None]  # one query lists the namespace

    def list_unit(self, unit: None) -> list[tuple[bytes, int]]:
        try:
            return self._db().execute(
                "SELECT key, length(block) FROM blocks WHERE namespace = ?",
                (self.namespace,)).fetchall()
        except sqlite3.Error as exc:
            raise _error(exc, self.name) from exc

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for db in connections:
            db.close()


class SqliteDriver(ThreadedDriver):
    """Blocks in one SQLite database file (see the module docstring)."""

    persistent = True

    class Options(DriverOptions):
        path: str = Field(min_length=1)  # the database file

    def __init__(self, backend: SqliteBlocks, *, name: str,
                 workers: Workers | None = None) -> None:
        super().__init__(backend, name=name, workers=workers)
        self.backend = backend

    @classmethod
    async def open(cls, options: Options | dict, *, name: str = "sqlite", namespace: str,
                   codec: str = "none", layouts: KVLayouts | None = None,
                   workers: Workers | None = None) -> Self:
        if not isinstance(options, cls.Options):
            options = cls.Options.model_validate(options)
        path = os.path.abspath(options.path)
        codec_value = parse_codec(codec)

        def connect() -> SqliteBlocks:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return SqliteBlocks(path, namespace=namespace, codec=codec_value, name=name,
                                layouts=layouts)

        try:
            backend = await trio.to_thread.run_sync(connect)
        except OSError as exc:
            raise StorageUnavailable(f"{path}: {exc.strerror or exc}", driver=name) from exc
        except sqlite3.Error as exc:
            raise _error(exc, name) from exc
        return cls(backend, name=name, workers=workers)
