"""`ucm bench quality`'s bookkeeping: prompts cut from real documents, what a store holds by
codec, and the agreement and perplexity figures (the engine runs are the benchmark's own)."""

from __future__ import annotations

import math

import pytest

from ucm.bench import quality
from ucm.kernel import Kernel, Store


class WordTokenizer:
    """One token per word: enough to check where prompts are cut."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [hash(w) % 50000 for w in text.split()]}


def test_prompts_take_distinct_documents_and_hold_out_what_follows_each_prefix():
    samples = quality.build_samples(WordTokenizer(), 6, 16, lengths=(64, 128, 256))
    assert [len(s.prefix) for s in samples] == [64, 128, 256, 64, 128, 256]
    assert all(len(s.continuation) == 16 for s in samples)
    assert len({s.source for s in samples}) == 6
    tokenizer = WordTokenizer()
    from ucm.bench.texts import documents

    texts = dict(documents(min_chars=3000))
    for s in samples:
        ids = tokenizer(texts[s.source])["input_ids"]
        assert ids[:len(s.prefix) + 16] == s.prefix + s.continuation


def test_a_length_no_document_reaches_is_an_error_naming_it():
    with pytest.raises(RuntimeError, match="10000016 tokens"):
        quality.build_samples(WordTokenizer(), 1, 16, lengths=(10_000_000,))


def test_stored_blocks_counts_each_codec_from_the_headers(tmp_path):
    block = bytes(range(256)) * 64
    for codec, n in (("none", 3), ("shuffle_zstd", 2)):
        path = tmp_path / codec
        kernel = Kernel({"tiers": [{"driver": "posix", "path": str(path), "capacity": "64MiB",
                                    "codec": codec}]})
        try:
            keys = [f"{codec}-{i}".encode() for i in range(n)]
            kernel.submit(Store(keys, buffers=[block] * n)).result(timeout=30)
        finally:
            kernel.close()
        (path / "not-a-block").write_bytes(b"junk")
        blocks, size, kinds = quality.stored_blocks(str(path))
        assert blocks == n and kinds == {codec: n}
        assert size > 0 and (size < n * len(block) if codec != "none" else size > n * len(block))


def test_first_divergence_and_perplexity():
    assert quality.first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert quality.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert quality.first_divergence([], [4]) == 0
    assert quality.perplexity([[math.log(0.5)], [math.log(0.5), math.log(0.5)]]) == \
        pytest.approx(2.0)


def test_a_path_without_ucm_is_reported_against_the_uncompressed_load(tmp_path):
    """A `--paths` row stores nothing: no bytes per token, its agreement and perplexity
    against the uncompressed ucm load all the same."""
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4, '
                                          '"num_hidden_layers": 2, "num_key_value_heads": 2}')
    samples = [quality.Sample("a", [1] * 32, [2] * 4), quality.Sample("b", [3] * 64, [4] * 4)]
    base = {"tails": [[math.log(0.5)] * 3] * 2, "tokens": [[7, 8, 9], [7, 8, 9]], "loaded": 96}
    path = {"tails": [[math.log(0.25)] * 3] * 2, "tokens": [[7, 8, 9], [7, 5, 9]], "loaded": 0}
    report = quality._report(samples, {"none": (3, 3 * 32 * 1024, {"none": 3})},
                             {"none": base, "recompute": path}, 3, str(tmp_path))
    row = {r["run"]: r for r in report["rows"]}["recompute"]
    assert row["blocks"] == 0 and row["bytes_per_token"] == 0.0 and row["loaded_share"] == 0
    assert row["divergence"] == [3, 1] and row["exact"] == 0.5
    assert row["perplexity_change"] == pytest.approx(1.0)  # ppl 4 against 2


def test_unknown_paths_are_refused_before_any_engine_starts(capsys):
    with pytest.raises(SystemExit):
        quality.main(["--paths", "recompute,warp"])
    assert "unknown path(s) ['warp']" in capsys.readouterr().err
