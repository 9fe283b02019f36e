"""ucm as SGLang's HiCache storage tier, on real SGLang (in .venv-sglang, one process per run):
a fresh engine loads a stored prefix and answers as the cold one did; the loaded pages are
really used (noise changes the answer); corrupt pages are recomputed; storage that hangs
is a miss; a bad config stops the engine at start. Offline (`sglang.Engine`) and over HTTP.

The first three checks share one cold engine and one warm engine: three prompts that share no
page, over one store in which the second prompt's pages hold noise and the third's are corrupt.

The module's runs start ahead, at its start (`runs`), two at a time: most of a run is one
core's imports and the tiny model's steps, so on two cores two runs take about the time of one.
Each run stays an SGLang process of its own (a config of its own, or a store as it was when it
started); the tests read their results.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sglang_support import (
    PAGE_SIZE,
    SGLangFailed,
    long_prompt,
    needs_sglang,
    posix,
    run_sglang,
    selected,
    ucm_extra,
)

from ucm.bench.models import ModelSpec
from ucm.kernel import Delete, Kernel, Store

pytestmark = [needs_sglang, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = long_prompt()
NOISY, CORRUPT = long_prompt(2), long_prompt(3)  # their pages: noise, and a flipped byte each


def full_hit(result: dict[str, Any]) -> bool:
    """Storage served at least 90 % of the prompt."""
    return result["storage_tokens"] >= 0.9 * result["prompt_tokens"]


BAD_CONFIGS = {
    "unknown-driver": ({"tiers": [{"driver": "no-such-driver"}]}, {}, "no-such-driver"),
    "bad-timeout": ({"tiers": [{"driver": "memory"}]}, {"timeout": -1}, "timeout"),
    "unknown-key": ({"tiers": [{"driver": "memory"}]}, {"tiemout": 3}, "tiemout"),
}


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, sglang_model: str,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    """The SGLang runs that this session's tests of the module read, started ahead, two at a
    time: the cold run and then the warm one (which waits for it) in one slot, the HTTP pair in
    the other meanwhile; then the hanging-storage run and the bad configs."""
    tests = selected(request)
    model = sglang_model
    pool = ThreadPoolExecutor(max_workers=max(1, min(2, len(os.sched_getaffinity(0)))))
    submit = pool.submit
    out: dict[str, Future[Any]] = {}
    uses_store = {"test_a_fresh_engine_loads_the_stored_prefix_with_the_same_output",
                  "test_noise_over_the_stored_pages_changes_the_output",
                  "test_corrupt_pages_are_recomputed_with_the_same_output",
                  "test_storage_that_hangs_is_a_miss_not_a_hang"}
    if tests & uses_store:
        out["stored"] = submit(_stored, model, tmp_path_factory.mktemp("sglang-store"))
    if "test_the_http_server_stores_and_a_restarted_one_loads" in tests:
        out["http"] = submit(_http_pair, model, tmp_path_factory.mktemp("sglang-http"))
    if tests & (uses_store - {"test_storage_that_hangs_is_a_miss_not_a_hang"}):
        out["warm"] = submit(_after, out["stored"], _warm, model,
                             tmp_path_factory.mktemp("sglang-warm"))
    if "test_storage_that_hangs_is_a_miss_not_a_hang" in tests:
        out["hangs"] = submit(_hangs, model, tmp_path_factory.mktemp("sglang-hangs"))
    if "test_a_bad_config_stops_the_engine_at_start_with_a_clear_error" in tests:
        for name, (ucm, extra, _) in BAD_CONFIGS.items():
            out[name] = submit(run_sglang, {"model": model, "backend": "dynamic",
                                            "extra": ucm_extra(ucm, **extra),
                                            "prompts": [PROMPT]}, watchdog=180)
    yield out
    pool.shutdown(cancel_futures=True)  # runs no test is left to read


def _after(first: Future[Any], run: Callable[..., Any], *args: Any) -> Any:
    """`run(first's result, *args)` once `first` is done; its failure fails this run too."""
    return run(first.result(), *args)


@pytest.fixture(scope="module")
def stored(runs: dict[str, Future[Any]]) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    return runs["stored"].result()


def _stored(sglang_model: str, root: Path) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    """A cold run that computed PROMPT, NOISY and CORRUPT and stored their pages: (store root,
    PROMPT's result, NOISY's and CORRUPT's); each result's "new_pages" are the page files (paths
    under the root) that its prompt added."""
    cold = run_sglang({"model": sglang_model, "backend": "dynamic",
                       "extra": ucm_extra(posix(root)), "prompts": [PROMPT, NOISY, CORRUPT],
                       "watch_dir": str(root)})
    assert [r["storage_tokens"] for r in cold] == [0, 0, 0]
    pages = [set(r["new_pages"]) for r in cold]
    assert not (pages[0] & pages[1] or pages[0] & pages[2] or pages[1] & pages[2])
    return root, cold[0], cold[1:]


def copy_store(root: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    return copy


def stored_pages(root: Path) -> tuple[str, list[Path]]:
    """The namespace directory's name and its page files."""
    [ns_dir] = [p for p in root.iterdir() if p.is_dir()]
    return ns_dir.name, sorted(ns_dir.rglob("*.blk"))


def page_bytes() -> int:
    """One fp32 page of the layer_first host pool: K and V of every layer."""
    spec = ModelSpec()
    return 2 * spec.layers * PAGE_SIZE * spec.kv_heads * (spec.hidden // spec.heads) * 4


@pytest.fixture(scope="module")
def warm(runs: dict[str, Future[Any]]) -> dict[str, dict[str, Any]]:
    return runs["warm"].result()


def _warm(stored: tuple[Path, dict[str, Any], list[dict[str, Any]]], sglang_model: str,
          tmp_path: Path) -> dict[str, dict[str, Any]]:
    """One fresh engine over a copy of the store with NOISY's pages overwritten by noise (valid
    blocks) and a byte flipped in each of CORRUPT's; it runs PROMPT first (a fresh engine's
    first request), then NOISY and CORRUPT. The prompts share no page (`stored` checks), so
    each request meets only its own pages. Its results by prompt."""
    root, _, (noisy, corrupt) = stored
    root = copy_store(root, tmp_path)
    namespace, _ = stored_pages(root)
    noise_pages = [root / p for p in noisy["new_pages"]]
    keys = [bytes.fromhex(p.stem) for p in noise_pages]
    rng = np.random.default_rng(0)
    noise = [rng.standard_normal(page_bytes() // 4).astype(np.float32) for _ in keys]
    with Kernel({**posix(root), "namespace": namespace}) as kernel:
        kernel.submit(Delete(keys)).result(30)
        assert kernel.submit(Store(keys, buffers=noise)).result(30).ok
    for page in (root / p for p in corrupt["new_pages"]):  # the payload's checksum fails
        data = bytearray(page.read_bytes())
        data[-100] ^= 0xFF
        page.write_bytes(bytes(data))
    results = run_sglang({"model": sglang_model, "backend": "dynamic",
                          "extra": ucm_extra(posix(root)), "prompts": [PROMPT, NOISY, CORRUPT]})
    return dict(zip(("fresh", "noise", "corrupt"), results, strict=True))


def test_a_fresh_engine_loads_the_stored_prefix_with_the_same_output(stored, warm):
    root, cold, _ = stored
    namespace, pages = stored_pages(root)
    assert "sglang.layer_first.mha" in namespace and "float32" in namespace
    # PROMPT's pages, and the generated tokens' pages
    assert len(cold["new_pages"]) >= cold["prompt_tokens"] // PAGE_SIZE
    assert {str(p.relative_to(root)) for p in pages} >= set(cold["new_pages"])
    result = warm["fresh"]
    assert full_hit(result), result
    assert result["details"].get("storage_backend") == "UCMStorage"
    assert result["text"] == cold["text"]


def test_noise_over_the_stored_pages_changes_the_output(stored, warm):
    [noisy, _] = stored[2]
    assert len(noisy["new_pages"]) >= noisy["prompt_tokens"] // PAGE_SIZE
    result = warm["noise"]
    assert full_hit(result), result  # the noise was loaded as if it were the prefix ...
    assert result["text"] != noisy["text"]  # ... and used


def test_corrupt_pages_are_recomputed_with_the_same_output(stored, warm):
    [_, corrupt] = stored[2]
    assert len(corrupt["new_pages"]) >= corrupt["prompt_tokens"] // PAGE_SIZE
    result = warm["corrupt"]
    assert not full_hit(result), result
    assert result["text"] == corrupt["text"]


def _hangs(sglang_model: str, tmp_path: Path) -> list[dict[str, Any]]:
    hanging = {"tiers": [{"driver": "faulty", "inner": {"driver": "posix",
                                                         "path": str(tmp_path)},
                          "hang": True}], "deadline": 1.0}
    return run_sglang({"model": sglang_model, "backend": "dynamic",
                       "extra": ucm_extra(hanging, timeout=1.0), "prompts": [PROMPT]},
                      watchdog=180)


def test_storage_that_hangs_is_a_miss_not_a_hang(runs, stored):
    [result] = runs["hangs"].result()
    assert result["storage_tokens"] == 0
    assert result["text"] == stored[1]["text"]


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_a_bad_config_stops_the_engine_at_start_with_a_clear_error(runs, name):
    message = BAD_CONFIGS[name][2]
    with pytest.raises(SGLangFailed, match=message):
        runs[name].result()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_pair(sglang_model: str, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A cold HTTP server that stores PROMPT, then a restarted one on the same store."""
    spec = {"model": sglang_model, "backend": "dynamic", "http": True,
            "extra": ucm_extra(posix(tmp_path)), "prompts": [PROMPT]}
    [cold] = run_sglang({**spec, "port": free_port(), "settle": 5})
    [again] = run_sglang({**spec, "port": free_port()})
    return cold, again


def test_the_http_server_stores_and_a_restarted_one_loads(runs):
    cold, again = runs["http"].result()
    assert cold["storage_tokens"] == 0
    assert full_hit(again), again
    assert again["text"] == cold["text"]
