"""The `ucm` pytest plugin (entry point group pytest11): runs the contract suite against a
driver named on the command line. Without --ucm-driver it only adds its options: it defines
no fixtures and collects nothing (a project opts in with `ucm.testing.contract` instead)."""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ucm", "ucm driver contract suite")
    group.addoption("--ucm-driver", metavar="MODULE:CLASS",
                    help="run the ucm driver contract suite against this driver class (or "
                         "registered driver name)")
    group.addoption("--ucm-driver-options", metavar="JSON|FILE", default="{}",
                    help="the driver's options: a JSON object or a JSON file; \"{tmp}\" and "
                         "\"{shm}\" in strings become fresh directories per test")
    group.addoption("--ucm-driver-codec", default="none",
                    choices=["none", "zstd", "shuffle_zstd", "int8", "int4"],
                    help="the codec the driver is opened with")
    group.addoption("--ucm-driver-corrupt", metavar="MODULE:FUNCTION",
                    help="a hook (driver, key) that flips one payload byte of a stored block; "
                         "without it the corruption checks skip")
    group.addoption("--ucm-cross-process", action="store_true",
                    help="other processes opening the same storage see the driver's blocks "
                         "(runs the two-writer and killed-writer checks)")


def pytest_configure(config: pytest.Config) -> None:
    target = config.getoption("ucm_driver", None)
    if not target:
        return
    from ucm.testing import contract
    from ucm.testing._spec import DriverSpec, import_object, load_options

    hook = config.getoption("ucm_driver_corrupt")
    spec = DriverSpec(
        id=target.rpartition(":")[2] or target,
        driver=target,
        options=load_options(config.getoption("ucm_driver_options")),
        corrupt=import_object(hook) if hook else None,
        codec=config.getoption("ucm_driver_codec"),
        cross_process=config.getoption("ucm_cross_process"),
    )
    config.pluginmanager.register(_CommandLineDriver(spec), "ucm-command-line-driver")
    config.args.append(contract.__file__)


class _CommandLineDriver:
    """The `ucm_driver_spec` fixture for --ucm-driver (a project's own fixture overrides it)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    @pytest.fixture
    def ucm_driver_spec(self) -> Any:
        return self.spec
