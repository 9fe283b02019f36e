"""Fixtures for the tests against real backends (SeaweedFS for s3, libpmem for pmem).

The session's SeaweedFS is started by scripts/backends/start_seaweedfs.sh on first use and
stopped by stop_seaweedfs.sh at the end; when it cannot start, the tests that need it fail
with the script's output and the log tail.
"""

from __future__ import annotations

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
