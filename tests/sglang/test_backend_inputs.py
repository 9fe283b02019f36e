"""SGLang never sees an exception from the backend, whatever it passes: keys that are not a
list (None, a number, a generator, an object without a length), keys that are not hex, host
indices or target locations that do not fit. Each call answers a miss of its own shape and is
counted as a failure. The backend is built as tests/sglang/test_backend.py builds it, without
SGLang."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_backend import KEYS, MEMORY, LayerFirstPool, backend, indices  # noqa: E402


class Unsized:
    """Iterable, with no length."""

    def __iter__(self):
        return iter(KEYS[:2])


class BadLen:
    def __len__(self):
        raise RuntimeError("no length for you")


ODD_KEYS = [None, 5, 3.5, Unsized(), (k for k in KEYS[:2]), BadLen(), object(),
            ["not hex"], [7, 8], {"a": 1}, b"\x00\x01"]
IDS = ["None", "int", "float", "unsized", "generator", "bad-len", "object", "not-hex",
       "ints", "dict", "bytes"]


@pytest.fixture(scope="module")
def store():
    b = backend(MEMORY, LayerFirstPool(seed=1))
    yield b
    b.close()


def _miss_len(keys) -> int:
    try:
        return len(keys)
    except Exception:
        return 0


@pytest.mark.parametrize("keys", ODD_KEYS, ids=IDS)
def test_no_keys_raise_into_sglang(store, keys):
    n = _miss_len(keys)
    before = store.statistics()
    assert store.batch_exists(keys) in (0, 2)  # an unsized iterable of good keys may answer
    assert store.batch_get_v1(keys, indices(0, 1)) in ([False] * n, [])
    assert store.batch_set_v1(keys, indices(0, 1)) in ([False] * n, [])
    assert store.batch_get(keys, [torch.zeros(4)]) in ([None] * n, [])
    assert store.batch_set(keys, [torch.zeros(4)]) is False
    after = store.statistics()
    failures = sum(after.get(f"{op}_failures", 0) - before.get(f"{op}_failures", 0)
                   for op in ("lookup", "load", "store"))
    # counted as failures, not raised (a falsy `keys` may be answered at once, uncounted)
    assert failures >= 3


def test_odd_locations_and_indices_are_misses(store):
    assert store.batch_get_v1(KEYS[:2], None) == [False, False]
    assert store.batch_set_v1(KEYS[:2], "nope") == [False, False]
    assert store.batch_get(KEYS[:2], [torch.zeros(4)]) == [None, None]  # one target for two
    assert store.batch_get(KEYS[:2], 17) == [None, None]
    assert store.batch_set(KEYS[:2], [1, 2]) is False
    assert store.get(None) is None and store.set(None, torch.zeros(4)) is False
    assert store.exists(None) is False


def test_odd_arguments_before_the_host_pool_are_misses():
    from test_backend import storage_config

    from ucm.sglang_hook import UCMStorageBase

    b = UCMStorageBase(storage_config(MEMORY), {})  # SGLang has not registered its pool
    assert b.batch_exists(None) == 0 and b.batch_get_v1(None, None) == []
    assert b.batch_set(5, None) is False and b.batch_get(BadLen()) == []
