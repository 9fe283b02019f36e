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
