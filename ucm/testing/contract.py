"""The whole contract suite in one module: the driver's checks and the kernel's. A project
runs it against its driver with a test module of one line,

    from ucm.testing.contract import *  # noqa: F403

next to a conftest.py that defines the `ucm_driver_spec` fixture (see `ucm.testing`)."""

from __future__ import annotations

from ucm.testing import driver_contract, kernel_contract
from ucm.testing.driver_contract import *  # noqa: F403
from ucm.testing.kernel_contract import *  # noqa: F403

__all__ = sorted({*driver_contract.__all__, *kernel_contract.__all__})
