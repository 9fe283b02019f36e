"""The suite's fixtures: `spec` (from the `ucm_driver_spec` fixture a project or the plugin
defines), `scratch` (fresh places per test) and `driver` (one instance, closed after)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from ucm.testing._spec import DriverSpec, Scratch, open_driver


@pytest.fixture
def spec(ucm_driver_spec: DriverSpec) -> DriverSpec:
    if not ucm_driver_spec.available():
        pytest.skip(f"{ucm_driver_spec.id}: backend not available here")
    return ucm_driver_spec


@pytest.fixture
def scratch(tmp_path: Path):
    shm = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    yield Scratch(disk=tmp_path, shm=shm)
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
async def driver(spec: DriverSpec, scratch: Scratch):
    drv = await open_driver(spec, scratch)
    try:
        yield drv
    finally:
        await drv.aclose()
