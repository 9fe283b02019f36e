"""The live curve's front and miniatures in C (`ucm._mrcsim.Curve`, native/mrcsim.c) against
the Python code they replace (`_PyFront` over `PolicyMiniatures`): the same references give
the same hits, sampled counts, hot-key counts, keys held and weights, count for count,
through sampling, resizes, hot keys and the fixed-memory lowering."""

from __future__ import annotations

import random

import pytest

from ucm.kernel._mrc import SPACE, MissRatioCurve, _PyFront, make_front, uniform_key

native = pytest.importorskip("ucm._mrcsim", reason="ucm._mrcsim not built (no C compiler)")


def _key(i: int, rank: int = 0) -> bytes:
    # a digest-like key: the first four bytes decide the sample; a rank suffix as the kernel's
    return uniform_key(i.to_bytes(8, "little")) + bytes([rank])


def _zipf(seed: int, n: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 0.9 for i in range(blocks)]
    return rng.choices(range(blocks), weights, k=n)


def _chat(seed: int, n: int) -> list[int]:
    """Sessions that return with a longer prefix: heads reused, new blocks reused soon. The
    sessions' shared first block changes every n / 3 references (a system prompt replaced),
    so hot keys come, and go cold and leave."""
    rng = random.Random(seed)
    sessions: list[list[int]] = []
    out: list[int] = []
    fresh = 10_000
    while len(out) < n:
        head = 3 * len(out) // n
        sessions = [s for s in sessions if s[0] == head]
        if sessions and rng.random() < 0.6:
            s = rng.choice(sessions)
        else:
            s = [head]  # every session of this third shares its first block
            sessions.append(s)
        grow = rng.randint(1, 6)
        s.extend(range(fresh, fresh + grow))
        fresh += grow
        out.extend(s)
    return out[:n]


def _scan(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    hot = _zipf(seed, n, 3000)
    return [b if rng.random() < 0.75 else 100_000 + i for i, b in enumerate(hot)]


WORKLOADS = {"zipf": lambda s: _zipf(s, 40_000, 6000), "chat": lambda s: _chat(s, 40_000),
             "scan": lambda s: _scan(s, 40_000)}


def _pair(policy: str, capacities: list[int], **kwargs: float) -> tuple[MissRatioCurve, ...]:
    return tuple(MissRatioCurve(policy, capacities, native=flag, **kwargs)  # type: ignore[arg-type]
                 for flag in (True, False))


def _same(a: MissRatioCurve, b: MissRatioCurve) -> None:
    assert a.hits == b.hits
    assert a.sampled == b.sampled
    assert (a.accesses, a.hot_refs, a.hot_hits, a.top_sampled, a.sampled_bytes) == (
        b.accesses, b.hot_refs, b.hot_hits, b.top_sampled, b.sampled_bytes)
    assert a.front.hot_count == b.front.hot_count
    assert a.front.held == b.front.held
    assert a.front.lengths() == b.front.lengths()
    assert a.front.weights() == b.front.weights()
    assert a.curve() == b.curve()
    assert a.lowered == b.lowered


@pytest.mark.parametrize("policy", ["lru", "shadow"])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("rate,min_blocks", [(0.01, 0), (0.05, 1000), (1.0, 0)])
def test_the_c_miniatures_count_as_the_python_policies(policy, workload, rate, min_blocks):
    """Miniatures of every regime: under SAMPLE_BLOCKS blocks (`shadow`'s part-time weight
    choice, restarts from the miniature's state), over it (sampled weight miniatures), and
    rate 1 (exact); heads mark batches, so hot keys come and go."""
    caps = [250, 500, 1000, 2000, 3000, 4000, 6000, 8000, 16000]
    fast, ref = _pair(policy, caps, rate=rate, min_blocks=min_blocks, max_keys=1 << 20)
    assert type(fast.front).__module__ == "ucm._mrcsim"
    assert isinstance(ref.front, _PyFront)
    stream = [_key(block) for block in WORKLOADS[workload](7)]
    for n in range(0, len(stream), 12):  # batches of 12: access_many, or access with first
        batch = stream[n:n + 12]
        if n % 24:
            fast.access_many(batch, 1)
            ref.access_many(batch, 1)
        else:
            for i, key in enumerate(batch):
                fast.access(key, 1, i == 0)
                ref.access(key, 1, i == 0)
        if n % 6000 == 0:
            _same(fast, ref)
    _same(fast, ref)
    assert sum(fast.hits) > 0
    if workload == "chat":
        assert fast.hot_hits > 0  # the shared first blocks became hot
        assert fast.front.hot_count < 3  # and those replaced went cold and left
    if policy == "shadow" and rate < 1 and workload != "chat":
        assert set(fast.front.weights()) != {1.0}  # the weight choice ran and moved


@pytest.mark.parametrize("policy", ["lru", "shadow"])
def test_the_fixed_memory_lowering_and_byte_sizes_match(policy):
    """Blocks of three sizes (byte-weighted capacities) and a key budget the miniatures
    outgrow several times: each lowering removes the same keys and shrinks alike."""
    fast, ref = _pair(policy, [300, 1200, 4800], rate=0.5, min_blocks=200, max_keys=600)
    rng = random.Random(3)
    for n, block in enumerate(_zipf(11, 30_000, 20_000)):
        key, size = _key(block, rng.randrange(2)), 1 + block % 3
        fast.access(key, size, n % 7 == 0)
        ref.access(key, size, n % 7 == 0)
    _same(fast, ref)
    assert fast.lowered > 0 and fast.front.held <= 600


def _fronts(policy: str, capacities: list[int]) -> tuple:
    events: list[tuple[int, int]] = []
    return tuple(make_front(policy, capacities, 1 << 20, lambda c, n: events.append((c, n)),
                            native=flag) for flag in (True, False))


def test_configure_directly():
    """New thresholds and capacities mid-stream: the keys above a threshold leave, the
    miniatures shrink and `shadow`'s weight miniatures start again, alike."""
    keys = [_key(i) for i in range(3000)]
    fast, ref = _fronts("shadow", [100, 400])
    rng = random.Random(5)
    for step in range(20_000):
        key = keys[min(int(rng.expovariate(1 / 300)), 2999)]
        fast.access(key, 1)
        ref.access(key, 1)
        if step % 4001 == 4000:
            bound = SPACE // (2 + step // 4001)
            assert (fast.configure([bound, SPACE], [80, 300])
                    == ref.configure([bound, SPACE], [80, 300]))
    assert (fast.hits, fast.sampled, fast.held, fast.lengths(), fast.weights()) == (
        ref.hits, ref.sampled, ref.held, ref.lengths(), ref.weights())


def test_keys_that_differ_after_the_sample_bytes_are_distinct():
    """A block's rank keys share its first bytes (its digest); each is its own entry."""
    mini, _ = _fronts("lru", [8])
    for rank in range(4):
        mini.access(b"\x00\x00\x00\x01" + b"d" * 28 + bytes([rank]), 1)
    assert mini.lengths() == [4] and mini.hits == [0]
    mini.access(b"\x00\x00\x00\x01" + b"d" * 28 + bytes([2]), 1)
    assert mini.hits == [1]


def test_crc_is_zlibs():
    """`shadow` samples its weight miniatures by CRC-32: the C one must be zlib's, or the
    counts above would differ; checked here on keys of every length up to 40 bytes too."""
    fast, ref = _fronts("shadow", [1024])  # its weight miniatures sample 1 key in 4
    rng = random.Random(9)
    keys = [rng.randbytes(rng.randrange(4, 41)) for _ in range(4000)]
    assert len(set(keys)) == len(keys)
    for _ in range(60_000):
        key = keys[min(int(rng.expovariate(1 / 900)), 3999)]
        fast.access(key, 1)
        ref.access(key, 1)
    assert fast.hits == ref.hits and fast.weights() == ref.weights()
    assert fast.lengths() == [1024]


def test_bad_arguments_are_named():
    def nothing(code: int, size: int) -> None:
        pass

    with pytest.raises(ValueError, match="lru or shadow"):
        native.Curve("s3fifo", [10], 100, nothing)
    curve = native.Curve("lru", [10], 100, nothing)
    with pytest.raises(TypeError, match="bytes"):
        curve.access("key", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected 1"):
        curve.configure([1, 2], [10])
    with pytest.raises(ValueError, match="no native miniatures for 's3fifo'"):
        make_front("s3fifo", [10], 100, nothing, native=True)
    assert isinstance(make_front("s3fifo", [10], 100, nothing), _PyFront)


def test_the_front_asks_the_curve_to_size_lower_and_make_room():
    """The C front calls back where the Python one does: sizing at the first sampled
    reference, lowering over max_keys, room when the hot keys change."""
    calls: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    fronts = {flag: make_front("lru", [50, 500], 64, lambda c, n, f=flag: calls[f].append((c, n)),
                               native=flag) for flag in (True, False)}
    for n, block in enumerate(_chat(3, 20_000)):
        for front in fronts.values():
            front.access(_key(block), 7, n % 9 == 0)
    assert calls[True] == calls[False]
    assert {c for c, _ in calls[True]} == {0, 1, 2} and calls[True][0] == (0, 7)
