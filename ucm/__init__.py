"""ucm: the Unified Cache Manager.

An event-driven async storage microkernel for the KV cache of LLM inference engines.
`import ucm` is light: it imports neither torch, CuPy nor vLLM, and starts nothing.
"""

from __future__ import annotations

from ucm._version import __version__
from ucm.errors import (
    BlockCorrupt,
    ConfigError,
    DeadlineExceeded,
    DriverError,
    InvalidRequest,
    KernelBusy,
    KernelClosed,
    KernelError,
    NoCapacity,
    StorageUnavailable,
    UCMError,
)

__all__ = [
    "BlockCorrupt",
    "ConfigError",
    "DeadlineExceeded",
    "DriverError",
    "InvalidRequest",
    "KernelBusy",
    "KernelClosed",
    "KernelError",
    "NoCapacity",
    "StorageUnavailable",
    "UCMError",
    "__version__",
]
