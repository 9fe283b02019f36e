"""The driver kit: what a storage driver needs besides its own storage code. Public API.

    from ucm.drivers.kit import Backend, ThreadedDriver, check_batch, frame_block

Validation     check_keys, check_batch, size_mismatch: arguments checked as the contract says;
               wrong_size: a stored block of another size than the buffer (CORRUPT)
Framing        frame_block, unframe_into: a block in the self-describing `ucm.block` format
               (header with key, namespace, codec, lengths and checksum; payload after it);
               KVLayouts: what a quantizing tier's `open(..., layouts=)` gets, for frame_block
Errors         os_error: an OSError that failed a batch, as the ucm exception tree
Threaded base  Backend + ThreadedDriver: write a synchronous, batched Backend; ThreadedDriver
               validates each call, runs it on worker threads, counts and translates errors;
               ScatterLoading adds `load_scatter` for a backend that reads into a Scatter,
               ScatterStoring `store_scatter` for one whose store writes from a Scatter
               RemoteDriver: the same for servers that can stall (calls a deadline abandons)
Threads        Workers: the copy threads and idle-priority store threads a ThreadedDriver runs
               on; the kernel owns one and passes it to `open(..., workers=)`
Statistics     new_statistics, count_loads, count_stores (see `DriverStatistics`)
Naming         safe_dir_name: a directory name for a namespace; pid_alive: whether a writer
               sharing the store from another process of this host still runs

Modules by job: `_checks` (validation, errors, naming), `_framing` (block format, the gate of
abandonable calls), `_threaded` (Backend, ThreadedDriver), `_remote` (RemoteDriver); Workers
lives in `ucm.drivers._workers`, beneath both the kit and the contract, whose `open` names it.
docs/writing-a-driver.md walks through a complete driver built on it.
"""

from __future__ import annotations

from ucm.block import PAYLOAD_OFFSET, Codec, KVLayouts, Scatter, wrong_size
from ucm.drivers._workers import Workers
from ucm.drivers.contract import (
    STATISTICS,
    DriverStatistics,
    LoadState,
    new_statistics,
)
from ucm.drivers.kit._checks import (
    check_batch,
    check_keys,
    os_error,
    parse_codec,
    pid_alive,
    safe_dir_name,
    size_mismatch,
)
from ucm.drivers.kit._framing import frame_block, unframe_into
from ucm.drivers.kit._remote import RemoteDriver
from ucm.drivers.kit._threaded import (
    Backend,
    ScatterLoading,
    ScatterStoring,
    ThreadedDriver,
    count_loads,
    count_stores,
)

__all__ = [
    "PAYLOAD_OFFSET",
    "STATISTICS",
    "Backend",
    "Codec",
    "DriverStatistics",
    "KVLayouts",
    "LoadState",
    "RemoteDriver",
    "Scatter",
    "ScatterLoading",
    "ScatterStoring",
    "ThreadedDriver",
    "Workers",
    "check_batch",
    "check_keys",
    "count_loads",
    "count_stores",
    "frame_block",
    "new_statistics",
    "os_error",
    "parse_codec",
    "pid_alive",
    "safe_dir_name",
    "size_mismatch",
    "unframe_into",
    "wrong_size",
]
