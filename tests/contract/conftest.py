"""The contract suite (shipped as `ucm.testing`) against every built-in driver: one
`ucm_driver_spec` fixture, parametrized over SPECS. To add a built-in driver, append one
DriverSpec (see `ucm.testing.DriverSpec`):

    DriverSpec(
        id="s3",                                   # the pytest id
        driver="s3",                               # the registry name
        options=lambda scratch: {"bucket": ...},   # options, given this test's Scratch dirs
        corrupt=flip_file_byte,                    # flips one payload byte in storage
        cross_process=True,                        # other processes see its blocks
        persistent=True,                           # a new instance finds the blocks again
        available=lambda: ...,                     # optional: False skips (server missing)
    )

Hooks get the driver as opened, so a wrapper (faulty) unwraps itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from ucm.testing import DriverSpec


def _unwrap(driver: Any) -> Any:
    while hasattr(driver, "inner"):
        driver = driver.inner
    return driver


def block_file(driver: Any) -> Callable[[bytes], str]:
    return _unwrap(driver).block_path


def flip_file_byte(driver: Any, key: bytes) -> None:
    """Flips the middle byte of the stored payload of a file-backed block."""
    path = block_file(driver)(key)
    size = os.path.getsize(path)
    offset = 4096 + (size - 4096) // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def truncate_file(driver: Any, key: bytes) -> None:
    path = block_file(driver)(key)
    os.truncate(path, 4096 + (os.path.getsize(path) - 4096) // 2)


def flip_arena_byte(driver: Any, key: bytes) -> None:
    """Flips the middle payload byte of a block in the shared memory driver's arena."""
    arena = _unwrap(driver).arena
    offset, length = arena.block_region(key)
    arena.view[offset + 4096 + (length - 4096) // 2] ^= 0x40


def flip_record_byte(driver: Any, key: bytes) -> None:
    """Flips a byte of the process-local memory driver's private copy."""
    payload = _unwrap(driver).backend.records[key].payload
    payload[len(payload) // 2] ^= 0x40


SPECS: list[DriverSpec] = [
    DriverSpec("memory", "memory", lambda s: {}, flip_record_byte),
    DriverSpec("memory-zstd", "memory", lambda s: {}, flip_record_byte, codec="zstd"),
    DriverSpec("memory-shared", "memory",
               lambda s: {"shared": True, "shm_dir": str(s.shm), "size": "1GiB"},
               flip_arena_byte, cross_process=True),
    DriverSpec("memory-shared-zstd", "memory",
               lambda s: {"shared": True, "shm_dir": str(s.shm), "size": "1GiB"},
               flip_arena_byte, codec="zstd", cross_process=True),
    DriverSpec("posix", "posix", lambda s: {"path": str(s.disk / "root")}, flip_file_byte,
               cross_process=True, persistent=True, truncate=truncate_file),
    DriverSpec("posix-zstd", "posix", lambda s: {"path": str(s.disk / "root")}, flip_file_byte,
               codec="zstd", cross_process=True, persistent=True, truncate=truncate_file),
    DriverSpec("posix-striped", "posix",
               lambda s: {"path": [str(s.disk / "a"), str(s.disk / "b")], "shard_depth": 1},
               flip_file_byte, cross_process=True, persistent=True, truncate=truncate_file),
    DriverSpec("posix-fsync", "posix", lambda s: {"path": str(s.disk / "root"), "fsync": True},
               flip_file_byte, cross_process=True, persistent=True, truncate=truncate_file),
    DriverSpec("posix-direct", "posix", lambda s: {"path": str(s.disk / "root"), "direct": True},
               flip_file_byte, cross_process=True, persistent=True, truncate=truncate_file),
    DriverSpec("posix-direct-writes", "posix",
               lambda s: {"path": str(s.disk / "root"), "direct_writes": True},
               flip_file_byte, cross_process=True, persistent=True, truncate=truncate_file),
    DriverSpec("faulty-memory", "faulty", lambda s: {"inner": {"driver": "memory"}},
               flip_record_byte),
    # Quantizing codecs store the suite's opaque blocks losslessly (the drivers are given no KV
    # layout): the version-2 headers and the shuffle_zstd payloads go through every check.
    DriverSpec("memory-int8", "memory", lambda s: {}, flip_record_byte, codec="int8"),
    DriverSpec("memory-shared-shuffle", "memory",
               lambda s: {"shared": True, "shm_dir": str(s.shm), "size": "1GiB"},
               flip_arena_byte, codec="shuffle_zstd", cross_process=True),
    DriverSpec("posix-int4", "posix", lambda s: {"path": str(s.disk / "root")}, flip_file_byte,
               codec="int4", cross_process=True, persistent=True, truncate=truncate_file),
]

# s3 on the session's SeaweedFS (tests/backends/_support.py starts it), one prefix per test.
from backends import _support as backends  # noqa: E402

SPECS += [
    DriverSpec("s3", "s3", lambda s: backends.shared_seaweedfs().options(
        backends.scratch_prefix(s.disk)), backends.flip_object_byte, cross_process=True,
        persistent=True, truncate=backends.truncate_object),
    DriverSpec("pmem", "pmem", lambda s: {"path": str(s.disk / "pmem"), "size": "64MiB"},
               backends.flip_pool_byte, persistent=True),
    DriverSpec("pmem-shm", "pmem", lambda s: {"path": str(s.shm), "size": "64MiB"},
               backends.flip_pool_byte, persistent=True),
    DriverSpec("pmem-shuffle", "pmem", lambda s: {"path": str(s.disk / "pmem"), "size": "64MiB"},
               backends.flip_pool_byte, codec="shuffle_zstd", persistent=True),
]


# nfs on the session's nfs-ganesha and mooncake on a Mooncake Store in a private network
# namespace (tests/backends/_mooncake_nfs.py). Mooncake clients listen on every interface, so
# its specs run only in the pytest that tests/backends/test_mooncake.py starts inside that
# namespace (UCM_MOONCAKE_MASTER set); elsewhere they skip and that test carries them.
from backends import _mooncake_nfs as mn  # noqa: E402

SPECS += [
    DriverSpec("nfs", "nfs", mn.nfs_options, mn.flip_nfs_byte, cross_process=True,
               persistent=True, truncate=mn.truncate_nfs_file, roots=mn.nfs_roots),
    DriverSpec("nfs-zstd", "nfs", mn.nfs_options, mn.flip_nfs_byte, codec="zstd",
               cross_process=True, persistent=True, truncate=mn.truncate_nfs_file,
               roots=mn.nfs_roots),
    DriverSpec("nfs-mount", "nfs", lambda s: {"mode": "mount", "path": str(s.disk / "mnt")},
               flip_file_byte, cross_process=True, persistent=True, truncate=truncate_file,
               roots=lambda s: [s.disk / "mnt" / "contract"]),
    DriverSpec("mooncake", "mooncake", lambda s: mn.mooncake_from_env(),
               mn.flip_mooncake_byte, cross_process=True, truncate=mn.truncate_mooncake_object,
               available=mn.mooncake_contract_enabled),
    DriverSpec("mooncake-zstd", "mooncake", lambda s: mn.mooncake_from_env(),
               mn.flip_mooncake_byte, codec="zstd", cross_process=True,
               available=mn.mooncake_contract_enabled),
]


# redis on the session's redis-server (tests/backends/_redis.py starts it), one prefix per test.
from backends import _redis  # noqa: E402

SPECS += [
    DriverSpec("redis", "redis", lambda s: _redis.shared_redis().options(
        backends.scratch_prefix(s.disk)), _redis.flip_redis_byte, cross_process=True,
        persistent=True, truncate=_redis.truncate_redis_value),
    DriverSpec("redis-zstd", "redis", lambda s: _redis.shared_redis().options(
        backends.scratch_prefix(s.disk)), _redis.flip_redis_byte, codec="zstd",
        cross_process=True, persistent=True, truncate=_redis.truncate_redis_value),
]


@pytest.fixture(params=SPECS, ids=[s.id for s in SPECS])
def ucm_driver_spec(request: pytest.FixtureRequest) -> DriverSpec:
    return request.param
