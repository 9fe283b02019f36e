"""Fixtures for the tests against real backends (SeaweedFS for s3, libpmem for pmem).

The session's SeaweedFS is started by scripts/backends/start_seaweedfs.sh on first use and
stopped by stop_seaweedfs.sh at the end; when it cannot start, the tests that need it fail
with the script's output and the log tail.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from ._redis import RedisServer, shared_redis
from ._support import SeaweedFS, scratch_prefix, shared_seaweedfs


@pytest.fixture(scope="session")
def seaweedfs():
    server = shared_seaweedfs()
    yield server
    server.stop()


@pytest.fixture
def s3_options(seaweedfs: SeaweedFS, tmp_path):
    """Options for an s3 driver on the session's server, under a prefix of this test."""
    return seaweedfs.options(scratch_prefix(tmp_path))


@pytest.fixture(scope="session")
def redis_server():
    server = shared_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_options(redis_server: RedisServer, tmp_path):
    """Options for a redis driver on the session's server, under a prefix of this test."""
    return redis_server.options(scratch_prefix(tmp_path))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts the Mooncake namespace suite's inner runs as soon as the session knows it will
    run that test (tests/backends/test_mooncake.py: their minute of waiting overlaps the
    tests before it)."""
    from ._mooncake_nfs import mooncake_contract_enabled

    if mooncake_contract_enabled() or session.config.option.collectonly:
        return
    from . import test_mooncake

    if any(item.nodeid == test_mooncake.INNER_TEST for item in session.items):
        out = Path(tempfile.mkdtemp(prefix="ucm-mooncake-inner-"))
        test_mooncake.AHEAD["runs"] = test_mooncake.InnerRuns(out)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Inner runs the test never collected (a stopped session) end with it."""
    from . import test_mooncake

    runs = test_mooncake.AHEAD.pop("runs", None)
    if runs is not None:
        runs.close()
