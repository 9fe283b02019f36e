"""The `faulty` driver: wraps another driver and injects faults, for tests of everything above
the drivers (kernel deadlines, retries, corrupt-miss handling, detach).

    - driver: faulty
      inner: {driver: memory}        # a tier-like dict: the wrapped driver and its options
      latency: 0.05                  # seconds before each affected op (trio.sleep: cancellable)
      error_rate: 0.1                # chance an affected op raises StorageUnavailable
      corrupt_rate: 0.0              # chance a loaded block is reported CORRUPT instead of OK
      hang: false                    # every affected op sleeps until cancelled
      seed: 0
      ops: [lookup, load, store, delete, list_blocks]   # the ops affected (default all)

`driver.faults` holds the live settings; a test changes them while the driver runs
(`driver.faults.hang = True`). Faults draw from one seeded random generator, so a run repeats.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Self

import trio
from pydantic import Field, field_validator

from ucm.block import Scatter
from ucm.drivers._registry import get_driver_class
from ucm.drivers.contract import Driver, DriverOptions, Listing, LoadState, ScatterLoads
from ucm.drivers.kit import DriverStatistics, KVLayouts, Workers, check_batch, check_keys
from ucm.drivers.kit._threaded import with_counters
from ucm.errors import StorageUnavailable

Op = Literal["lookup", "load", "store", "delete", "list_blocks"]
ALL_OPS: tuple[Op, ...] = ("lookup", "load", "store", "delete", "list_blocks")


def _split_inner(inner: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """(driver name, codec or None, the driver's own options) from a tier-like dict."""
    rest = dict(inner)
    if isinstance(rest.get("options"), DriverOptions):  # validated: see Options._inner_options
        options = rest["options"]
        return rest["driver"], rest.get("codec"), options.model_dump()
    driver = rest.pop("driver", None)
    if not isinstance(driver, str):
        raise ValueError("inner needs a 'driver' key naming the wrapped driver")
    codec = rest.pop("codec", None)
    for common in ("name", "capacity", "concurrency"):
        rest.pop(common, None)
    rest.update(rest.pop("options", None) or {})
    return driver, codec, rest


@dataclass
class Faults:
    """The live fault settings of one FaultyDriver."""

    latency: float = 0.0
    error_rate: float = 0.0
    corrupt_rate: float = 0.0
    hang: bool = False
    ops: set[str] = field(default_factory=lambda: set(ALL_OPS))


class FaultyDriver:
    """A driver that delegates to `inner` after injecting the configured faults."""

    class Options(DriverOptions):
        inner: dict[str, Any]
        latency: float = Field(default=0.0, ge=0)
        error_rate: float = Field(default=0.0, ge=0, le=1)
        corrupt_rate: float = Field(default=0.0, ge=0, le=1)
        hang: bool = False
        seed: int = 0
        ops: list[Op] = Field(default_factory=lambda: list(ALL_OPS))

        @field_validator("inner")
        @classmethod
        def _inner_options(cls, inner: dict[str, Any]) -> dict[str, Any]:
            driver, codec, own = _split_inner(inner)
            # Bad inner options fail at config time; kept as the driver's model, whose repr
            # hides its secrets (a password in an inner redis url).
            options = get_driver_class(driver).Options(**own)
            return {"driver": driver, "options": options,
                    **({"codec": codec} if codec is not None else {})}

    def __init__(self, inner: Driver, options: Options, *, name: str) -> None:
        self.inner = inner
        self.name = name
        self.persistent = inner.persistent
        self.faults = Faults(options.latency, options.error_rate, options.corrupt_rate,
                             options.hang, set(options.ops))
        self._random = random.Random(options.seed)
        self._injected = {"injected_errors": 0, "injected_corrupt": 0, "injected_delays": 0}
        if isinstance(inner, Listing):
            # An instance attribute, so isinstance(self, Listing) holds only when the inner
            # driver can list.
            self.list_blocks = self._list_blocks
        if isinstance(inner, ScatterLoads):  # likewise for ScatterLoads
            self.load_scatter = self._load_scatter

    @classmethod
    async def open(cls, options: Options | dict[str, Any], *, name: str = "faulty",
                   namespace: str, codec: str = "none", layouts: KVLayouts | None = None,
                   workers: Workers | None = None) -> Self:
        if not isinstance(options, cls.Options):
            options = cls.Options.model_validate(options)
        driver, inner_codec, _ = _split_inner(options.inner)
        factory = get_driver_class(driver)
        extra = {"layouts": layouts} if layouts is not None else {}  # as the kernel gives them
        inner = await factory.open(options.inner["options"], name=f"{name}.{driver}",
                                   namespace=namespace, codec=inner_codec or codec,
                                   workers=workers, **extra)
        return cls(inner, options, name=name)

    async def _inject(self, op: str) -> None:
        faults = self.faults
        if op not in faults.ops:
            return
        if faults.hang:
            await trio.sleep_forever()
        if faults.latency:
            self._injected["injected_delays"] += 1
            await trio.sleep(faults.latency)
        if faults.error_rate and self._random.random() < faults.error_rate:
            self._injected["injected_errors"] += 1
            raise StorageUnavailable(f"injected {op} failure", driver=self.name)

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys)
        await self._inject("lookup")
        return await self.inner.lookup(keys)

    async def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[LoadState]:
        return await self._load(keys, buffers, self.inner.load)

    async def _load(self, keys: Sequence[bytes], buffers: Sequence[Any],
                    load: Callable[..., Awaitable[list[LoadState]]]) -> list[LoadState]:
        check_batch(keys, buffers, writable=True)
        await self._inject("load")
        states = await load(keys, buffers)
        rate = self.faults.corrupt_rate if "load" in self.faults.ops else 0.0
        if rate:
            for i, state in enumerate(states):
                if state is LoadState.OK and self._random.random() < rate:
                    states[i] = LoadState.CORRUPT
                    self._injected["injected_corrupt"] += 1
        return states

    async def _load_scatter(self, keys: Sequence[bytes],
                            buffers: Sequence[memoryview | Scatter]) -> list[LoadState]:
        return await self._load(keys, buffers, self.inner.load_scatter)  # type: ignore[attr-defined]

    async def store(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        check_batch(keys, buffers, writable=False)
        await self._inject("store")
        return await self.inner.store(keys, buffers)

    async def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        await self._inject("delete")
        await self.inner.delete(keys)

    async def _list_blocks(self) -> AsyncIterator[tuple[bytes, int]]:
        await self._inject("list_blocks")
        async for item in self.inner.list_blocks():  # type: ignore[attr-defined]
            yield item

    async def aclose(self) -> None:
        await self.inner.aclose()

    def statistics(self) -> DriverStatistics:
        stats = with_counters(self.inner.statistics(), self._injected)
        # Injected corrupt blocks count as corrupt, as the caller saw them.
        stats["corrupt"] = stats.get("corrupt", 0) + self._injected["injected_corrupt"]
        return stats
