"""The one exception tree of ucm. Drivers translate their native errors into it.

    UCMError
    ├── ConfigError          (also ValueError)  a config key or value is wrong; names the key
    ├── InvalidRequest       (also ValueError)  an event is malformed (empty batch, bad buffer)
    ├── KernelError
    │   ├── KernelBusy       the inbox is full; treat the event as a cache miss
    │   └── KernelClosed     the kernel is stopping or stopped
    ├── DeadlineExceeded     (also TimeoutError) the event's deadline passed
    └── DriverError          a storage operation failed
        ├── StorageUnavailable   the backend cannot be reached or is detached
        ├── NoCapacity           no room, even after evicting every unpinned block
        └── BlockCorrupt         a stored block failed its checksum or header check

A corrupt block on load is reported per block as a miss plus a counted error, never as data;
`BlockCorrupt` is raised only where a caller asked for one block's bytes directly.
"""

from __future__ import annotations


class UCMError(Exception):
    """Base of every error ucm raises on purpose."""


class ConfigError(UCMError, ValueError):
    """A config key or value is invalid. The message names the key."""


class InvalidRequest(UCMError, ValueError):
    """An event or driver call is malformed: empty batch, wrong buffer size, oversize key."""


class KernelError(UCMError):
    """The kernel could not take or finish an event."""


class KernelBusy(KernelError):
    """The kernel's inbox is full. Callers treat this as a cache miss."""


class KernelClosed(KernelError):
    """The kernel is stopping or has stopped."""


class DeadlineExceeded(UCMError, TimeoutError):
    """An event did not finish before its deadline."""


class DriverError(UCMError):
    """A storage driver failed. `driver` names it when known."""

    def __init__(self, message: str, *, driver: str | None = None) -> None:
        super().__init__(f"{driver}: {message}" if driver else message)
        self.driver = driver


class StorageUnavailable(DriverError):
    """The backend cannot be reached, is stopped, or the driver was detached."""


class NoCapacity(DriverError):
    """No room for the block, even after evicting every unpinned block."""


class BlockCorrupt(DriverError):
    """A stored block failed its header or checksum check."""
