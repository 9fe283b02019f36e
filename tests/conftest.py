from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio.testing

TESTS = Path(__file__).parent
# Directories whose tests share session fixtures (servers, engines) run whole on one xdist
# worker, the longest first, so the vLLM engine tests take one lane and the rest the other.
# The storage servers' directories share one group: their servers, namespaces and ports
# (NFS, Redis, the cluster's LAN) are one set per host.
_SERVERS = {"backends": "servers", "contract": "servers", "sglang": "servers"}
_LANES_FIRST = ("vllm", "servers")


def _group(item: pytest.Item) -> str | None:
    """The tests/ subdirectory an item lives in, its module for tests/test_*.py, or None
    outside tests/."""
    path = Path(str(item.path)).resolve()
    if TESTS.resolve() not in path.parents:
        return None
    relative = path.relative_to(TESTS.resolve())
    if len(relative.parts) == 1:
        return relative.as_posix()
    return _SERVERS.get(relative.parts[0], relative.parts[0])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups tests for `pytest -n 2 --dist loadgroup` (scripts/test.sh): a directory's or a
    module's tests share one worker, so their module and session fixtures start once."""
    groups = {item.nodeid: _group(item) for item in items}
    for item in items:
        if (name := groups[item.nodeid]) is not None:
            item.add_marker(pytest.mark.xdist_group(name))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Longest groups first: the scheduler hands groups out in collection order.
        rank = {name: i for i, name in enumerate(_LANES_FIRST)}
        items.sort(key=lambda item: rank.get(groups[item.nodeid] or "", len(rank)))


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)
