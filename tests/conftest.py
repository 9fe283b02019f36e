from __future__ import annotations

import os

import pytest
import trio.testing

# Engine processes are forked from one process that imported vLLM once (ucm/bench/_warm.py):
# the suite starts dozens of engines, and vLLM's import is most of a small engine's start.
os.environ.setdefault("UCM_ENGINE_WARM_START", "1")


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)
