"""The shipped driver contract (`ucm.testing.driver_contract`) against every spec in SPECS."""

from ucm.testing.driver_contract import *  # noqa: F403
