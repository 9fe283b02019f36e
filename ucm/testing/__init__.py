"""The driver contract suite, shipped: run it against any driver, in any package.

From the command line (the `ucm` pytest plugin, installed with ucm):

    pytest --ucm-driver mypkg.module:MyDriver --ucm-driver-options '{"path": "{tmp}/db"}'

"{tmp}" and "{shm}" in option strings become fresh places per test (the same ones for a
test's restart and its second clients). Or, in a project's tests, a conftest.py with

    from ucm.testing import DriverSpec

    @pytest.fixture
    def ucm_driver_spec():
        return DriverSpec("mine", "mypkg.module:MyDriver", {"path": "{tmp}/db"},
                          corrupt=flip_a_payload_byte)

and a test module `from ucm.testing.contract import *  # noqa: F403`. Parametrize the fixture
to run the suite against several configurations. docs/writing-a-driver.md has the details.

Importing this package is light; the suite itself (pytest, trio) loads on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DriverSpec", "Scratch", "call_hook", "open_driver"]


def __getattr__(name: str) -> Any:
    if name in __all__:  # lazily: the pytest plugin imports this package in every pytest run
        from ucm.testing import _spec

        return getattr(_spec, name)
    raise AttributeError(f"module 'ucm.testing' has no attribute {name!r}")
