"""`ucm bench codec --tier s3|nfs`: a private server started by the project's scripts, blocks
stored uncompressed, int8 and int4, loaded back right (rates are not checked)."""

from __future__ import annotations

import pytest

from ucm.bench.codec import SMOLLM2_AMX, _Server, _synthetic_blocks, run_tier
from ucm.block import Codec, encode_payload


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kind", "port"), [("s3", 8733), ("nfs", 8734)])
def test_slow_tier_rows(kind, port, tmp_path):
    blocks = _synthetic_blocks(SMOLLM2_AMX, 3)
    with _Server(kind, port, str(tmp_path / "server")) as server:
        rows = run_tier(server, SMOLLM2_AMX, blocks, ["none", "int8", "int4"], batch=2,
                        repeat=1)
    assert [r["codec"] for r in rows] == ["none", "int8", "int4"]
    assert all(r["delivered_right"] == 3 and r["load_mbps"] > 0 for r in rows)
    ratio = {r["codec"]: r["ratio"] for r in rows}
    assert ratio["int4"] < ratio["int8"] < 0.53 < ratio["none"] == 1.0
    assert rows[0]["vs_none"] == 1.0
    # the kernels held the layout: nothing in the process quantizes blocks by their size
    assert encode_payload(Codec.INT8, memoryview(blocks[0])).codec is Codec.SHUFFLE_ZSTD
