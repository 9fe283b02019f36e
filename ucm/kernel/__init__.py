"""The storage microkernel: events in, tiers and drivers underneath.

    from ucm.kernel import Kernel, Load, Lookup, Store

    kernel = Kernel({"tiers": [{"driver": "memory", "capacity": "1GiB"}]})
    kernel.submit(Store([key], buffers=[data])).result()
    hits = kernel.submit(Lookup([key], prefix=True)).result().prefix_len
"""

from __future__ import annotations

from ucm.kernel._completion import Completion
from ucm.kernel._core import KernelCore
from ucm.kernel._events import (
    Delete,
    DoneResult,
    Load,
    LoadResult,
    Lookup,
    LookupResult,
    Prefetch,
    PrefetchResult,
    Priority,
    Store,
    StoreResult,
    Unpin,
)
from ucm.kernel._kernel import Kernel
from ucm.kernel._limiter import PriorityLimiter
from ucm.kernel._policy import LRUPolicy, Policy, S3FIFOPolicy, make_policy

__all__ = [
    "Completion",
    "Delete",
    "DoneResult",
    "Kernel",
    "KernelCore",
    "LRUPolicy",
    "Load",
    "LoadResult",
    "Lookup",
    "LookupResult",
    "Policy",
    "Prefetch",
    "PrefetchResult",
    "Priority",
    "PriorityLimiter",
    "S3FIFOPolicy",
    "Store",
    "StoreResult",
    "Unpin",
    "make_policy",
]
