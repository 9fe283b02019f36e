"""`ucm bench codec` runs every codec and dtype it is asked for (rates are not checked)."""

from __future__ import annotations

import json

from ucm.bench.codec import run
from ucm.cli import main


def test_bench_codec_rows():
    rows = run(["bf16", "fp32"], ["none", "int4", "shuffle_zstd"], layers=1, tokens=16,
               channels=64, repeat=1)
    assert [(r["dtype"], r["codec"]) for r in rows] == [
        (d, c) for d in ("bf16", "fp32") for c in ("memcpy", "none", "int4", "shuffle_zstd")]
    stored = {(r["dtype"], r["codec"]): r.get("stored_as") for r in rows}
    assert stored[("bf16", "int4")] == "int4"  # the bench registers its layout
    ratio = {(r["dtype"], r["codec"]): r["ratio"] for r in rows}
    assert ratio[("fp32", "int4")] < ratio[("bf16", "int4")] < 0.5 < ratio[("bf16", "none")]


def test_ucm_bench_codec_command(capsys):
    assert main(["bench", "codec", "--dtypes", "fp16", "--codecs", "int8", "--layers", "1",
                 "--repeat", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["codec"] for r in rows] == ["memcpy", "int8"]
