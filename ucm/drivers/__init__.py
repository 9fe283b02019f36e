"""Storage drivers and their contract. See `_protocol` for what a driver implements."""

from __future__ import annotations

from ucm.drivers._protocol import Driver, DriverFactory, DriverOptions, Listing, LoadState
from ucm.drivers._registry import (
    available_drivers,
    get_driver_class,
    register_driver,
    unregister_driver,
)

__all__ = [
    "Driver",
    "DriverFactory",
    "DriverOptions",
    "Listing",
    "LoadState",
    "available_drivers",
    "get_driver_class",
    "register_driver",
    "unregister_driver",
]
