"""Session hints on a real vLLM engine (tests/vllm/_session_engine.py runs the scenario in a
fresh process): a held session's next turn is served from the memory tier after a flood that
pushes an unheld one down to disk; `end` and expiry release it; over `sessions.max_pinned` the
oldest hold goes; `prefetch` brings a session back up; a malformed hint changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("vllm")

BLOCKS = 8  # full blocks of a first turn (_session_engine.TURN)
HERE = Path(__file__).resolve().parent


def _scenario(model: str, root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    log = root / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(HERE / "_session_engine.py"), model,
                               str(root / "store")], stdout=subprocess.PIPE, stderr=out,
                              text=True, env=env, timeout=600, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("UCM_SESSIONS ")]
    assert proc.returncode == 0 and lines, log.read_text()[-4000:]
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.fixture(scope="module")
def scenario(tiny_model, tmp_path_factory, engine_pool) -> dict:
    return engine_pool.submit(_scenario, tiny_model, tmp_path_factory.mktemp("sessions")
                              ).result()


def test_sessions_on_vllm(scenario) -> None:
    served = scenario["next"]
    # held through the flood: its next turn loads from memory
    assert served["held"] == {"memory": BLOCKS, "posix": 0}, served
    # the flood pushed the unheld session, and the one with a malformed hint, down to disk
    assert served["plain"] == {"memory": 0, "posix": BLOCKS}, served
    assert served["bad"] == served["plain"], served
    assert scenario["held_after_flood"] == 1
    # `end` released the hold: after the next flood its blocks come from disk
    assert scenario["after_end"] == {"memory": 0, "posix": BLOCKS}, scenario
    assert scenario["held_after_end"] == 0
    # prefetch: the blocks went back up to memory, and the next turn loads them from there
    assert scenario["prefetched"] == BLOCKS
    assert scenario["after_prefetch"] == {"memory": BLOCKS, "posix": 0}, scenario
    # expiry released "short"; over the cap the oldest of c0..c3 went, the others stayed
    assert scenario["expired"] == {"memory": 0, "posix": BLOCKS}, scenario
    assert scenario["capped"] == [{"memory": 0, "posix": BLOCKS}] + [
        {"memory": BLOCKS, "posix": 0}] * 3, scenario
    assert scenario["held_sessions"] == 3  # c1, c2, c3
    assert scenario["held_bytes"] == 3 * BLOCKS * scenario["block_bytes"]
    assert scenario["kernel"]["session_holds"] == 6
    assert scenario["kernel"]["session_releases.end"] == 1
    assert scenario["kernel"]["session_releases.expired"] == 1
    assert scenario["kernel"]["session_releases.cap"] == 1
    assert scenario["scheduler"] == {"session_hints.hold": 6, "session_hints.end": 1,
                                     "session_hints.prefetch": 1,
                                     "session_hints_malformed": 1}
    assert scenario["worker"] == {"session_ops": 8}
