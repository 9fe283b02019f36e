"""The shipped kernel contract (`ucm.testing.kernel_contract`) against every spec in SPECS."""

from ucm.testing.kernel_contract import *  # noqa: F403
