"""Which model a namespace names (its config and a fingerprint of its weights, or `model_id`),
pipeline parallelism refused, and which configs share an in-process kernel. The last test
runs two checkpoints with one config and different weights on real vLLM over one store."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import prompt

from ucm.config import load_config
from ucm.errors import ConfigError
from ucm.vllm_hook.keys import SAMPLE_BYTES, model_identity, weights_fingerprint
from ucm.vllm_hook.settings import ProcessKernels, kernels, settings_from_vllm, wait_running

MEMORY = {"tiers": [{"driver": "memory", "capacity": "64MiB"}]}
HF = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}
TENSOR_BYTES = 1 << 20  # well beyond the three samples: bytes between them are not read


def _safetensors(path, tensors: dict[str, bytes]) -> None:
    """A safetensors file written by hand: 8-byte header length, JSON header, tensor bytes."""
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "F32", "shape": [len(data) // 4],
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(tensors.values()))


def _checkpoint(path, seed: int, **extra_files: bytes) -> str:
    """A model directory: config.json, two weight tensors of seeded random bytes, and any
    other files (tokenizer files, stamps) given."""
    rng = random.Random(seed)
    os.makedirs(path, exist_ok=True)
    _safetensors(os.path.join(path, "model.safetensors"),
                 {"a": rng.randbytes(TENSOR_BYTES), "b": rng.randbytes(TENSOR_BYTES)})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(HF, f)
    for name, data in extra_files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return str(path)


def _vllm_config(model: str, *, hf: dict | None = None, extra: dict | None = None,
                 pp: int = 1, revision: object = None) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"ucm": MEMORY,
                                                                      **(extra or {})}),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(**(hf or HF)), model=model,
                                     revision=revision, dtype="torch.float32"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=pp),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048, async_scheduling=False))


def _namespace(model: str, **kw) -> str:
    return settings_from_vllm(_vllm_config(model, **kw)).namespace


def test_the_same_weights_in_other_directories_share_the_namespace(tmp_path):
    a = _checkpoint(tmp_path / "a", 1)
    b = _checkpoint(tmp_path / "elsewhere" / "b", 1, **{"tokenizer.json": b"{}"})
    os.utime(os.path.join(b, "model.safetensors"), (1, 1))  # another mtime, another inode
    assert weights_fingerprint(a) == weights_fingerprint(b)
    assert _namespace(a) == _namespace(b)


def test_other_weights_with_the_same_shapes_and_config_get_another_namespace(tmp_path):
    a = _checkpoint(tmp_path / "a", 1)
    b = _checkpoint(tmp_path / "b", 2)  # same header, same config.json, other tensor values
    with open(os.path.join(a, "model.safetensors"), "rb") as fa, \
            open(os.path.join(b, "model.safetensors"), "rb") as fb:
        head = int.from_bytes(fa.read(8), "little")
        fb.seek(8)
        assert fa.read(head) == fb.read(head)
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert _namespace(a) != _namespace(b)


def test_one_byte_in_the_middle_of_the_tensors_changes_the_fingerprint(tmp_path):
    a = _checkpoint(tmp_path / "a", 1)
    b = shutil.copytree(a, tmp_path / "b")
    path = os.path.join(b, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        middle = start + (size - start) // 2
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 1]))
    assert weights_fingerprint(a) != weights_fingerprint(b)


def test_only_a_bounded_sample_of_the_weights_is_read(tmp_path, monkeypatch):
    path = tmp_path / "big" / "model.safetensors"
    path.parent.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**28],
                               "data_offsets": [0, 2**30]}}).encode()
    with open(path, "wb") as f:  # a sparse 1 GiB file
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + 2**30)
    read = []
    real_pread = os.pread

    def pread(fd, n, offset):
        data = real_pread(fd, n, offset)
        read.append(len(data))
        return data

    monkeypatch.setattr(os, "pread", pread)
    weights_fingerprint(path.parent)
    assert sum(read) == 8 + len(header) + 3 * SAMPLE_BYTES


def test_the_fingerprint_is_the_same_in_another_process(tmp_path):
    a = _checkpoint(tmp_path / "a", 3)
    code = f"from ucm.vllm_hook.keys import weights_fingerprint; print(weights_fingerprint({a!r}))"
    outs = {subprocess.check_output([sys.executable, "-c", code],
                                    env={**os.environ, "PYTHONHASHSEED": seed}).decode().strip()
            for seed in ("0", "1")}
    assert outs == {weights_fingerprint(a)}


def test_weight_files_are_counted_by_name_and_size(tmp_path):
    a = _checkpoint(tmp_path / "a", 1)
    fingerprints = {weights_fingerprint(a)}
    b = _checkpoint(tmp_path / "b", 1, **{"extra.bin": b"\0" * 10})
    fingerprints.add(weights_fingerprint(b))
    os.rename(os.path.join(b, "extra.bin"), os.path.join(b, "other.bin"))
    fingerprints.add(weights_fingerprint(b))
    with open(os.path.join(b, "other.bin"), "ab") as f:
        f.write(b"\0")
    fingerprints.add(weights_fingerprint(b))
    c = _checkpoint(tmp_path / "c", 1, **{"notes.txt": b"not weights"})
    assert weights_fingerprint(c) == weights_fingerprint(a)
    assert len(fingerprints) == 4


def test_a_single_weight_file_is_fingerprinted(tmp_path):
    a = tmp_path / "a.gguf"
    a.write_bytes(random.Random(1).randbytes(300_000))
    b = tmp_path / "b.gguf"
    b.write_bytes(a.read_bytes())
    assert weights_fingerprint(a) == weights_fingerprint(b)
    assert _namespace(str(a)) == _namespace(str(b))
    b.write_bytes(random.Random(2).randbytes(300_000))
    assert weights_fingerprint(a) != weights_fingerprint(b)


@pytest.mark.parametrize("length", [0, 2**40, 10**6])
def test_an_absurd_safetensors_header_length_is_refused(tmp_path, length):
    path = tmp_path / "m" / "model.safetensors"
    path.parent.mkdir()
    path.write_bytes(length.to_bytes(8, "little") + b"{}" * 1000)
    with pytest.raises(ConfigError, match="not a safetensors file"):
        weights_fingerprint(path.parent)


def test_a_config_only_change_gets_another_namespace(tmp_path):
    a = _checkpoint(tmp_path / "a", 1)
    assert _namespace(a) != _namespace(a, hf={**HF, "rope_theta": 5e5})
    assert model_identity(HF, "w1") != model_identity(HF, "w2") != model_identity(HF)


def test_model_id_overrides_the_fingerprint(tmp_path):
    a = _checkpoint(tmp_path / "a", 1)
    b = _checkpoint(tmp_path / "b", 2)
    extra = {"model_id": "my-finetune"}
    assert _namespace(a, extra=extra) == _namespace(b, extra=extra)
    assert "my_finetune" in _namespace(a, extra=extra)
    assert _namespace(a, extra=extra) != _namespace(a)


def test_a_hub_name_is_named_with_its_revision_and_logged_once(tmp_path, caplog):
    name = f"org/never-local-{os.getpid()}"
    resolved = SimpleNamespace(resolved="abc123")  # as huggingface_hub's ResolvedRevision
    with caplog.at_level(logging.WARNING, logger="ucm.vllm_hook"):
        first = _namespace(name, revision=resolved)
        assert _namespace(name, revision=resolved) == first
        assert _namespace(name, revision="def456") != first
        assert _namespace(name + "-2", revision=resolved) != first
    warned = [r for r in caplog.records if "not fingerprinted" in r.getMessage()]
    assert len(warned) == 3  # once per model and revision, not per call
    assert "abc123" in warned[0].getMessage()


def test_pipeline_parallelism_is_refused(tmp_path):
    a = _checkpoint(tmp_path / "a", 1)
    with pytest.raises(ConfigError, match=r"pipeline parallelism \(pipeline_parallel_size=2\)"):
        settings_from_vllm(_vllm_config(a, pp=2))
    assert settings_from_vllm(_vllm_config(a, pp=1)).namespace


@pytest.mark.parametrize(("a", "b"), [
    ({"driver": "posix", "path": "/tmp/ucm-a"}, {"driver": "posix", "path": "/tmp/ucm-b"}),
    ({"driver": "posix", "path": "/x", "fsync": True}, {"driver": "posix", "path": "/x"}),
    ({"driver": "memory", "shared": True, "size": "64MiB"},
     {"driver": "memory", "shared": True, "size": "128MiB"}),
    ({"driver": "faulty", "inner": {"driver": "posix", "path": "/tmp/ucm-a"}},
     {"driver": "faulty", "inner": {"driver": "posix", "path": "/tmp/ucm-b"}}),
    ({"driver": "redis", "url": "redis://h", "password": "secret-one"},
     {"driver": "redis", "url": "redis://h", "password": "secret-two"}),
])
def test_configs_that_differ_only_in_driver_options_do_not_share_a_kernel(a, b):
    key_a = ProcessKernels._key(load_config({"tiers": [a]}))
    key_b = ProcessKernels._key(load_config({"tiers": [b]}))
    assert key_a != key_b
    assert key_a == ProcessKernels._key(load_config({"tiers": [a]}))
    assert "secret" not in repr(key_a) + repr(key_b)


def test_two_posix_paths_get_two_kernels(tmp_path):
    configs = [load_config({"tiers": [{"driver": "posix", "path": str(tmp_path / n)}]})
               for n in ("a", "b")]
    first = kernels.acquire(configs[0], None)
    try:
        assert kernels.find(configs[1]) is None
        second = kernels.acquire(configs[1], None)
        try:
            assert kernels.find(configs[0]) is first and kernels.find(configs[1]) is second
            assert first.kernel is not second.kernel
        finally:
            kernels.release(second)
            _close(second.kernel)
    finally:
        kernels.release(first)
        _close(first.kernel)


def _close(kernel) -> None:
    assert wait_running(kernel, 30)  # a kernel closed while it starts is not stopped
    kernel.close(timeout=30)


# -- real vLLM ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_fine_tune_with_the_same_config_gets_no_hits_from_the_other(tmp_path, engine_pool):
    """Two checkpoints, one config.json, other weights: the second model's engine, over the
    store the first one filled, hits nothing, and its output is its own without a store (that
    engine, on a store of its own, runs beside the first two: `engine_pool`)."""
    engines = pytest.importorskip("ucm.bench.engines")
    from ucm.bench.models import ModelSpec, build_model

    models = [str(build_model(tmp_path / f"m{seed}", ModelSpec(seed=seed))) for seed in (5, 6)]
    with open(os.path.join(models[0], "config.json")) as a, \
            open(os.path.join(models[1], "config.json")) as b:
        assert a.read() == b.read()
    store = str(tmp_path / "store")
    phases = [engines.Phase([prompt(300, 1)], max_tokens=8, name="single")]

    def run(model: str, store: str) -> dict:
        ucm = {"tiers": [{"driver": "posix", "path": store}]}
        spec = engines.EngineSpec(model=model, connector="ucm", ucm=ucm, max_model_len=2048,
                                  kv_cache_bytes=16 * 2**20)
        return engines.run_in_subprocess(spec, phases, log_path=str(tmp_path / "engines.log"))

    alone_run = engine_pool.submit(run, models[1], str(tmp_path / "empty"))
    first = run(models[0], store)
    assert first["stats"]["worker"]["saved_blocks"] == 9
    second = run(models[1], store)
    alone = alone_run.result()
    single = second["phases"][0]
    assert single["num_cached_tokens"] == [0]
    assert second["stats"]["scheduler"].get("hit_tokens", 0) == 0
    assert second["stats"]["worker"].get("loaded_blocks", 0) == 0
    assert single["tokens"] == alone["phases"][0]["tokens"]
    assert single["tokens"] != first["phases"][0]["tokens"]  # the weights do differ
    assert len(os.listdir(store)) == 2  # one namespace per model
