"""Storage drivers and their contract. See `ucm.drivers.contract` for what a driver implements
and `ucm.drivers.kit` for the supported helpers a driver is built with."""

from __future__ import annotations

from ucm.drivers._registry import (
    available_drivers,
    get_driver_class,
    register_driver,
    unregister_driver,
)
from ucm.drivers.contract import (
    STATISTICS,
    Driver,
    DriverFactory,
    DriverOptions,
    DriverStatistics,
    FreeSpace,
    InMemoryLoads,
    Listing,
    LoadState,
    MemoryLoad,
    ScatterLoads,
    ScatterStores,
)

__all__ = [
    "STATISTICS",
    "Driver",
    "DriverFactory",
    "DriverOptions",
    "DriverStatistics",
    "FreeSpace",
    "InMemoryLoads",
    "Listing",
    "LoadState",
    "MemoryLoad",
    "ScatterLoads",
    "ScatterStores",
    "available_drivers",
    "get_driver_class",
    "register_driver",
    "unregister_driver",
]
