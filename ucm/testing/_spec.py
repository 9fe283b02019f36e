"""What the contract suite runs against: a DriverSpec, the per-test Scratch places, and how a
spec's driver is found and opened (in this process and in the suite's worker processes)."""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm.drivers import Driver, DriverFactory, get_driver_class, register_driver

Hook = Callable[[Any, bytes], Awaitable[None] | None]


@dataclass(frozen=True)
class Scratch:
    """Fresh per-test places: `disk` on the test's tmp_path, `shm` on /dev/shm (made by the
    driver when it wants it). Two opens on the same Scratch share storage (a "restart")."""

    disk: Path
    shm: Path


@dataclass(frozen=True)
class DriverSpec:
    """One driver configuration the suite runs against.

    id          the pytest id
    driver      a registered driver name ("posix") or a class path ("mypkg.module:MyDriver")
    options     the driver's options: a dict, where "{tmp}" and "{shm}" in strings become this
                test's Scratch places, or a callable given the Scratch
    corrupt     flips one payload byte of a stored block (driver as opened, key); None skips
                the corruption checks
    truncate    cuts a stored block short; None skips that check
    persistent  a new instance on the same storage finds the blocks again (None: the driver
                class's `persistent`)
    cross_process  other processes opening the same storage see the blocks
    available   False skips the spec (a server missing here)
    roots       local directories a file-backed driver keeps a namespace's blocks in, when they
                are not under its `path` option (checked for temp files left by a killed writer)
    """

    id: str
    driver: str
    options: Mapping[str, Any] | Callable[[Scratch], dict[str, Any]] = field(
        default_factory=dict)
    corrupt: Hook | None = None
    codec: str = "none"
    cross_process: bool = False
    persistent: bool | None = None
    truncate: Hook | None = None
    available: Callable[[], bool] = field(default=lambda: True)
    roots: Callable[[Scratch], list[Path]] | None = None

    def options_for(self, scratch: Scratch) -> dict[str, Any]:
        """The driver's options for this test's Scratch."""
        if callable(self.options):
            return self.options(scratch)
        return {k: substitute(v, scratch) for k, v in self.options.items()}

    def is_persistent(self) -> bool:
        if self.persistent is not None:
            return self.persistent
        return bool(getattr(driver_class(self.driver), "persistent", False))

    def registered_name(self) -> str:
        """A registry name for the driver, as kernel tier configs need: a class path is
        registered under a name of its own."""
        if ":" not in self.driver:
            return self.driver
        name = "contract-" + re.sub(r"[^A-Za-z0-9_-]", "-", self.id)
        register_driver(name, self.driver)
        return name


def substitute(value: Any, scratch: Scratch) -> Any:
    """`value` with "{tmp}" and "{shm}" in its strings replaced by the Scratch places."""
    if isinstance(value, str):
        return value.replace("{tmp}", str(scratch.disk)).replace("{shm}", str(scratch.shm))
    if isinstance(value, list):
        return [substitute(v, scratch) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, scratch) for k, v in value.items()}
    return value


def load_options(text: str) -> dict[str, Any]:
    """--ucm-driver-options: inline JSON, or the path of a JSON file."""
    if not text.lstrip().startswith("{"):
        text = Path(text).read_text()
    options = json.loads(text)
    if not isinstance(options, dict):
        raise ValueError("driver options must be a JSON object")
    return options


def import_object(path: str) -> Any:
    """The object at "module:attr" (attr may be dotted)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not attr:
        raise ValueError(f"{path!r} is not of the form module:attribute")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def driver_class(driver: str) -> DriverFactory:
    """The class of a registered name or a "module:Class" path."""
    return import_object(driver) if ":" in driver else get_driver_class(driver)


async def open_driver(spec: DriverSpec, scratch: Scratch, *, namespace: str = "contract",
                      name: str | None = None) -> Driver:
    """Opens one instance; a second call on the same Scratch is a restart or another client."""
    factory = driver_class(spec.driver)
    options = factory.Options(**spec.options_for(scratch))
    return await factory.open(options, name=name or spec.id, namespace=namespace,
                              codec=spec.codec)


async def call_hook(hook: Hook, driver: Driver, key: bytes) -> None:
    result = hook(driver, key)
    if isinstance(result, Awaitable):
        await result
