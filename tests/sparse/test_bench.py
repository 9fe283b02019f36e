"""The benchmark module runs end to end (its quick mode, one short section)."""

from __future__ import annotations

from ucm.bench import sparse as bench


def test_fetched_bytes_section_runs(capsys):
    bench.fetched_bytes(4096, steps=9)
    out = capsys.readouterr().out
    assert "loaded/step" in out and "quest" in out and "gsa" in out


def test_codec_table_times_the_store_paths_codecs(capsys):
    """`ucm bench sparse`'s codec section stores K and V blocks through ucm.block with the
    store path's codecs: lossless ones exact, int8/int4 at their stored share, every block
    quantized with the layout it was given."""
    rows = bench.codec_table(tokens=64)
    assert "the store path's KV codecs (ucm.codecs)" in capsys.readouterr().out
    assert [(r["tensor"], r["dtype"], r["codec"]) for r in rows] == [
        (t, d, c) for t in ("K", "V") for d in ("fp16", "bf16") for c in bench.CODECS]
    for r in rows:
        assert r["stored_as"] == r["codec"]
        if r["codec"] in ("zstd", "shuffle_zstd"):
            assert r["rel_error"] == 0.0 and r["max_error_in_steps"] is None
            assert r["stored"] < 1.0
        else:
            low, high = (0.5, 0.54) if r["codec"] == "int8" else (0.25, 0.29)
            assert low < r["stored"] < high and r["max_error_in_steps"] is not None
            assert 0 < r["rel_error"] < (0.01 if r["codec"] == "int8" else 0.15)
