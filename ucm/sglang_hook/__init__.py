"""ucm as SGLang's HiCache storage tier (SGLang 0.5.19's `HiCacheStorage` interface).

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "ucm", "module_path": "ucm.sglang_hook", "class_name": "UCMStorage",
          "interface_v1": 1, "ucm": {"tiers": [{"driver": "posix", "path": "/var/cache/ucm"}]}}'

`UCMStorage` is built on first access from SGLang's base class, so this module imports
without SGLang (and without torch); `ucm.sglang_hook.backend` holds the implementation.
"""

from __future__ import annotations

from typing import Any

from ucm.sglang_hook.backend import UCMStorageBase, page_namespace, storage_key

__all__ = ["UCMStorage", "UCMStorageBase", "page_namespace", "storage_key"]

_built: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name != "UCMStorage":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _built:
        try:
            from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
        except ImportError:  # no SGLang here: the class without SGLang's base, for tests
            _built[name] = UCMStorageBase
        else:
            _built[name] = type("UCMStorage", (UCMStorageBase, HiCacheStorage),
                                {"__module__": __name__, "__doc__": UCMStorageBase.__doc__})
    return _built[name]
