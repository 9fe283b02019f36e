"""The benchmark module runs end to end (its quick mode, one short section)."""

from __future__ import annotations

from ucm.bench import sparse as bench


def test_fetched_bytes_section_runs(capsys):
    bench.fetched_bytes(4096, steps=9)
    out = capsys.readouterr().out
    assert "loaded/step" in out and "quest" in out and "gsa" in out
