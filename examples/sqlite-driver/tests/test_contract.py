"""The whole ucm driver contract suite, against the specs of conftest.py."""

from ucm.testing.contract import *  # noqa: F403
