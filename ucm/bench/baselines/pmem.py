"""The `ucm bench` baseline of the `pmem` driver: its client library called directly."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from ucm.block import PAYLOAD_OFFSET, buffer_address
from ucm.drivers._pmem_pool import PMEM_FILE_CREATE, _round_up, libpmem
from ucm.drivers.kit import safe_dir_name
from ucm.drivers.pmem import PmemDriver


class RawPmem:
    """libpmem called directly on a pool file of its own: memcpy + persist (msync off pmem)
    into page-aligned slots, memmove out. No index, no checksums: the floor for the driver.

    It persists each block as libpmem's own examples do (pmem_memcpy_persist, or memcpy +
    pmem_msync), and takes slots round the pool file as the driver's next-fit allocator
    does. (A variant that rewrote each key in place measured 30-40% slower on ext4 here at
    2 and 4 threads: rewriting a region of the file just written back is the slow part.)"""

    label = "raw libpmem memcpy"

    def __init__(self, options: dict[str, Any], namespace: str) -> None:
        opts = PmemDriver.Options.model_validate(options)
        self.path = os.path.join(os.path.abspath(os.path.expanduser(opts.path)),
                                 f"raw-{safe_dir_name(namespace)}.pmem")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.lib = libpmem()
        mapped, is_pmem = ctypes.c_size_t(), ctypes.c_int()
        self.addr = self.lib.pmem_map_file(self.path.encode(), int(opts.size), PMEM_FILE_CREATE,
                                           0o600, ctypes.byref(mapped), ctypes.byref(is_pmem))
        if not self.addr:
            raise OSError(ctypes.get_errno(), "pmem_map_file failed", self.path)
        self.size = mapped.value
        self.is_pmem = bool(is_pmem.value)
        self.slots: dict[bytes, int] = {}
        self.next = 0
        self.lock = threading.Lock()

    def store(self, keys: list[bytes], bufs: list[memoryview]) -> None:
        for key, buf in zip(keys, bufs, strict=True):
            length = PAYLOAD_OFFSET + buf.nbytes
            with self.lock:
                if self.next + _round_up(length) > self.size:
                    self.next = 0
                at = self.slots[key] = self.next
                self.next += _round_up(length)
            dst = self.addr + at + PAYLOAD_OFFSET
            if self.is_pmem:
                self.lib.pmem_memcpy_persist(dst, buffer_address(buf), buf.nbytes)
            else:
                ctypes.memmove(dst, buffer_address(buf), buf.nbytes)
                self.lib.pmem_msync(self.addr + at, length)

    def load(self, keys: list[bytes], outs: list[memoryview], batch: int) -> None:
        for key, dst in zip(keys, outs, strict=True):
            ctypes.memmove(buffer_address(dst), self.addr + self.slots[key] + PAYLOAD_OFFSET,
                           dst.nbytes)

    def delete(self, keys: list[bytes]) -> None:
        with self.lock:
            for key in keys:
                self.slots.pop(key, None)

    def close(self) -> None:
        self.lib.pmem_unmap(self.addr, self.size)
        os.unlink(self.path)


def raw_baseline(options: dict[str, Any], namespace: str) -> RawPmem:
    """For `ucm bench`: the raw libpmem client next to which the driver is measured."""
    return RawPmem(options, namespace)
