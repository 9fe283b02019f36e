"""The driver registry: built-in names, the `ucm.drivers` entry-point group, and
`register_driver`. Classes are imported lazily, on first use of their name."""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Mapping
from types import MappingProxyType

from ucm.drivers.contract import DriverFactory
from ucm.errors import ConfigError

# name -> ("module:Class", the extra to install when the import fails)
_BUILTIN: dict[str, tuple[str, str | None]] = {
    "memory": ("ucm.drivers.memory:MemoryDriver", None),
    "posix": ("ucm.drivers.posix:PosixDriver", None),
    "faulty": ("ucm.drivers.faulty:FaultyDriver", None),
    "mooncake": ("ucm.drivers.mooncake:MooncakeDriver", "mooncake"),
    "nfs": ("ucm.drivers.nfs:NfsDriver", "nfs"),
    "s3": ("ucm.drivers.s3:S3Driver", "s3"),
    "pmem": ("ucm.drivers.pmem:PmemDriver", "pmem"),
    "redis": ("ucm.drivers.redis:RedisDriver", "redis"),
}

_lock = threading.Lock()
_registered: dict[str, DriverFactory | str] = {}
_entry_points_loaded = False


def register_driver(name: str, factory: DriverFactory | str) -> None:
    """Registers a driver class (or a lazy "module:Class" path) under `name`."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"driver name {name!r} must be alphanumeric (with - or _)")
    with _lock:
        _registered[name] = factory


def unregister_driver(name: str) -> None:
    with _lock:
        _registered.pop(name, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    for ep in importlib.metadata.entry_points(group="ucm.drivers"):
        _registered.setdefault(ep.name, ep.value)
    _entry_points_loaded = True


def available_drivers() -> Mapping[str, str]:
    """A read-only view: driver name -> where its class comes from."""
    with _lock:
        _load_entry_points()
        table = {name: path for name, (path, _) in _BUILTIN.items()}
        for name, factory in _registered.items():
            table[name] = factory if isinstance(factory, str) else _qualname(factory)
    return MappingProxyType(table)


def _qualname(obj: object) -> str:
    return f"{obj.__module__}:{getattr(obj, '__qualname__', repr(obj))}"


def get_driver_class(name: str) -> DriverFactory:
    """The driver class for `name`; ConfigError naming the name or the missing extra."""
    with _lock:
        _load_entry_points()
        target = _registered.get(name)
    extra = None
    if target is None:
        if name not in _BUILTIN:
            known = ", ".join(sorted(available_drivers()))
            raise ConfigError(f"unknown driver {name!r}; known drivers: {known}")
        target, extra = _BUILTIN[name]
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f"; install it with: pip install 'ucm[{extra}]'" if extra else ""
        raise ConfigError(f"driver {name!r} cannot be imported ({exc}){hint}") from exc
    factory: DriverFactory = getattr(module, attr)
    return factory
