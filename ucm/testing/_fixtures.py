"""The suite's fixtures: `spec` (from the `ucm_driver_spec` fixture a project or the plugin
defines), `scratch` (fresh places per test), `driver` (one instance, closed after), and
`requires`, the capability a check needs of its spec."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ucm.drivers import Driver
from ucm.testing._spec import DriverSpec, Scratch, open_driver

PROCESS_LOCAL = "process-local driver (the spec does not set cross_process)"
# capability -> (whether a spec has it, the skip reason when it has not)
CAPABILITIES: dict[str, tuple[Callable[[DriverSpec], bool], str]] = {
    "corrupt": (lambda s: s.corrupt is not None, "no corrupt hook in the spec"),
    "truncate": (lambda s: s.truncate is not None, "no truncate hook in the spec"),
    "cross_process": (lambda s: s.cross_process, PROCESS_LOCAL),
    "outlives_instance": (lambda s: s.cross_process or s.is_persistent(),
                          "blocks do not outlive the driver instance (not persistent, and "
                          "the spec does not set cross_process)"),
}


def requires(capability: str) -> Callable[[Any], Any]:
    """Marks a check as needing a capability of the spec; without it the check skips."""
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown capability {capability!r}; known: {sorted(CAPABILITIES)}")

    def mark(test: Any) -> Any:
        test.ucm_requires = capability
        return test

    return mark


@pytest.fixture(autouse=True)
def _capability(request: pytest.FixtureRequest) -> None:
    # A sync fixture: a skip from inside a trio test loses its reason (pytest-trio 0.8).
    capability = getattr(request.function, "ucm_requires", None)
    if capability is not None:
        has, reason = CAPABILITIES[capability]
        if not has(request.getfixturevalue("spec")):
            pytest.skip(reason)


@pytest.fixture
def spec(ucm_driver_spec: DriverSpec) -> DriverSpec:
    if not ucm_driver_spec.available():
        pytest.skip(f"{ucm_driver_spec.id}: backend not available here")
    return ucm_driver_spec


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Scratch]:
    shm = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    yield Scratch(disk=tmp_path, shm=shm)
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
async def driver(spec: DriverSpec, scratch: Scratch) -> AsyncIterator[Driver]:
    drv = await open_driver(spec, scratch)
    try:
        yield drv
    finally:
        await drv.aclose()
