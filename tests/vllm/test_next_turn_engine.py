"""The live next-turn prefetch on a real vLLM engine (tests/vllm/_next_turn_engine.py runs the
scenario in a fresh process): with `sessions.predict_next_turn` a conversation's third turn,
arriving after its predicted time, loads its blocks from memory after a flood that pushed
them to disk, counted as prefetch hits; without it (the default) the same turn loads them from
disk and nothing is prefetched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent


def _scenario(model: str, root: Path, predict: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    log = root / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(HERE / "_next_turn_engine.py"), model,
                               str(root / "store"), "on" if predict else "off"],
                              stdout=subprocess.PIPE, stderr=out, text=True, env=env,
                              timeout=600, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("UCM_NEXT_TURN ")]
    assert proc.returncode == 0 and lines, log.read_text()[-4000:]
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.mark.parametrize("predict", [True, False], ids=["on", "off"])
def test_next_turn_prefetch_on_vllm(tiny_model, tmp_path, engine_pool, predict) -> None:
    got = engine_pool.submit(_scenario, tiny_model, tmp_path, predict).result()
    blocks = got["blocks"]
    assert blocks == 12 and got["after_flood"] < blocks, got  # the flood pushed them down
    if predict:
        # one prefetch, at the predicted time, of turn 2's 12 blocks; all loaded from memory
        assert got["scheduler"] == {"next_turn.prefetches": 1, "next_turn.blocks": blocks}, got
        assert got["before_turn3"] == blocks, got
        assert got["turn3"] == {"memory": blocks, "posix": 0}, got
        promoted = got["kernel"]["prefetched"]
        assert promoted == blocks - got["after_flood"], got
        assert got["kernel"]["tier.memory.prefetch_hits"] == promoted, got
        assert got["kernel"]["tier.memory.prefetch_evicted"] == 0, got
    else:
        assert got["fed"] is None and got["scheduler"] == {}, got
        assert got["turn3"]["posix"] > 0 and got["turn3"]["memory"] == got["after_flood"], got
        assert got["kernel"].get("prefetched", 0) == 0, got
        assert got["kernel"]["tier.memory.prefetch_hits"] == 0, got
