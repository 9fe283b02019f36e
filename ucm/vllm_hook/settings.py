"""The connector's options, the namespace it derives from the vLLM config, and its kernels.

Runs in both the scheduler process and the worker processes. vLLM objects are read duck-typed
here (no vLLM import), so the option parsing is testable without an engine.

    kv_connector_extra_config = {
        "ucm": {...} | "ucm_config_file": "ucm.yaml",   # else the embedded default config
        "model_id": None,          # overrides the config fingerprint in the namespace
        "layerwise": False,        # each layer of a block stored on its own; a step's loads
                                   # go layer by layer, later ones while earlier ones compute
        "direct_loads": True,      # host-memory caches: read blocks straight into the cache
        "early_loads": True,       # scheduler and worker in one process: a step's loads
                                   # start when the scheduler plans them (not with async
                                   # scheduling or pipeline parallelism)
        "hugepages": False,        # host-memory caches: collapse (up to 4 GiB of) them into
                                   # huge pages at start (hugepages.py says when it pays)
        "lookup_wait": 0.002,      # s the scheduler waits inline before "ask again later"
        "lookup_timeout": 5.0,     # s after which an unanswered lookup counts as a miss
        "start_timeout": 30.0,     # s lookups wait for the kernel to open its tiers (it lists
                                   # what a persistent tier holds); then misses until it runs
        "index_wait": 2.0,         # s a worker waits at start, before it serves, for the
                                   # kernel to index (and map) the blocks storage already holds
        "load_timeout": 30.0,      # s a worker waits for a load before it recomputes instead
        "max_store_bytes": "1GiB", # snapshots waiting to be written; beyond, saves are dropped
        "save_generated": True,    # also save blocks of generated tokens (chat turns reuse them)
        "load_failure": "recompute",  # vLLM's kv_load_failure_policy; "fail" fails requests
    }
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ByteSize, TypeAdapter

from ucm.config import UCMConfig, load_config
from ucm.errors import ConfigError
from ucm.vllm_hook.keys import make_namespace, model_identity

log = logging.getLogger("ucm.vllm_hook")

_OPTION_KEYS = {"ucm", "ucm_config_file", "model_id", "layerwise", "direct_loads", "early_loads",
                "hugepages", "lookup_wait",
                "lookup_timeout", "start_timeout", "index_wait", "load_timeout", "max_store_bytes",
                "save_generated", "load_failure", "sparse"}


@dataclass(frozen=True)
class HookSettings:
    ucm_config: UCMConfig
    namespace: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    layerwise: bool = False
    direct_loads: bool = True
    early_loads: bool = True
    hugepages: bool = False
    lookup_wait: float = 0.002
    lookup_timeout: float = 5.0
    start_timeout: float = 30.0
    index_wait: float = 2.0
    load_timeout: float = 30.0
    max_store_bytes: int = 1 << 30
    step_tokens: int | None = None  # vLLM's max_num_batched_tokens: what one step can save
    save_generated: bool = True
    load_failure: str = "recompute"
    extra: dict[str, Any] = field(default_factory=dict)


def settings_from_vllm(vllm_config: Any) -> HookSettings:
    """Reads the connector options and derives the namespace from a VllmConfig."""
    kvt = vllm_config.kv_transfer_config
    extra = dict(getattr(kvt, "kv_connector_extra_config", None) or {})
    unknown = sorted(set(extra) - _OPTION_KEYS)
    if unknown:
        log.warning("ucm: ignoring unknown kv_connector_extra_config keys: %s", unknown)
    if "ucm" in extra and "ucm_config_file" in extra:
        raise ConfigError("give either 'ucm' or 'ucm_config_file', not both")
    source = extra.get("ucm") if "ucm" in extra else extra.get("ucm_config_file")
    base = load_config(source)
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    block_size = int(cache_config.block_size)
    hf = model_config.hf_config
    hf_dict = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    dtype = str(model_config.dtype)
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto"))
    if cache_dtype != "auto":
        dtype = f"{dtype}.{cache_dtype}"
    namespace = make_namespace(
        model_type=str(hf_dict.get("model_type", "model")),
        model_id=str(extra.get("model_id") or model_identity(hf_dict)),
        dtype=dtype, block_size=block_size, kv_layout=kv_layout_tag(vllm_config))
    parallel = vllm_config.parallel_config
    load_failure = str(extra.get("load_failure", "recompute"))
    if load_failure not in ("recompute", "fail"):
        raise ConfigError("load_failure must be 'recompute' or 'fail'")
    return HookSettings(
        ucm_config=base.model_copy(update={"namespace": namespace}),
        namespace=namespace,
        block_size=block_size,
        tp_rank=_tp_rank(),
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
        layerwise=bool(extra.get("layerwise", False)),
        direct_loads=bool(extra.get("direct_loads", True)),
        early_loads=bool(extra.get("early_loads", True)) and _steps_in_turn(vllm_config),
        hugepages=bool(extra.get("hugepages", False)),
        lookup_wait=float(extra.get("lookup_wait", 0.002)),
        lookup_timeout=float(extra.get("lookup_timeout", base.deadline or 5.0)),
        start_timeout=float(extra.get("start_timeout", 30.0)),
        index_wait=float(extra.get("index_wait", 2.0)),
        load_timeout=float(extra.get("load_timeout", base.deadline or 30.0)),
        max_store_bytes=int(TypeAdapter(ByteSize).validate_python(
            extra.get("max_store_bytes", 1 << 30))),
        step_tokens=int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0)
                        or 0) or None,
        save_generated=bool(extra.get("save_generated", True)),
        load_failure=load_failure,
        extra=extra,
    )


def _steps_in_turn(vllm_config: Any) -> bool:
    """Whether vLLM schedules a step only once the previous one has run: no async scheduling,
    no pipeline parallelism (batches in flight at once). Then the blocks a step's schedule
    hands a request are not in use by any forward pass until that step's."""
    sched = getattr(vllm_config, "scheduler_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    return (not getattr(sched, "async_scheduling", False)
            and int(getattr(parallel, "pipeline_parallel_size", 1) or 1) == 1)


def kv_layer_count(kv_cache_config: Any) -> int | None:
    """The number of KV cache layers vLLM gives the connector (`KVCacheConfig`'s groups), the
    same on the scheduler and the workers; None when vLLM passed no config."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return None
    names = {name for group in groups for name in getattr(group, "layer_names", ())}
    return len(names) or None


def _tp_rank() -> int:
    """This worker's TP rank (0 in the scheduler process and when TP is not set up)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # the scheduler process has no TP group
        return 0


def kv_layout_tag(vllm_config: Any) -> str:
    """Names the byte layout inside a block. On CPU it depends on the ISA the attention kernel
    picks (bf16 on AMX uses VNNI pairs); on CUDA on vLLM's KV cache layout (NHD, HND)."""
    try:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
    except Exception:
        device = "unknown"
    if device == "cpu":
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            mc = vllm_config.model_config
            isa = _get_attn_isa(mc.dtype, vllm_config.cache_config.block_size,
                                mc.get_head_size(), vllm_config.cache_config.cache_dtype)
            return f"cpu.{isa}"
        except Exception:
            return "cpu"
    layout = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    return f"{device}.{layout or 'NHD'}"


def scheduler_config(config: UCMConfig) -> UCMConfig:
    """The scheduler only looks blocks up: it never promotes, drops process-local memory
    tiers (they can only hold what this process stored, and it stores nothing) unless nothing
    else is left, and maps no posix blocks (mappings serve loads)."""
    shared = [t for t in config.tiers
              if not (t.driver == "memory" and not getattr(t.options, "shared", False))]
    tiers = [_lookup_only(t) for t in shared or config.tiers]
    return config.model_copy(update={"promote": False, "tiers": tiers})


def _lookup_only(tier: Any) -> Any:
    if tier.driver == "posix" and tier.options.map_bytes:
        options = tier.options.model_copy(update={"map_bytes": 0})
        return tier.model_copy(update={"options": options})
    return tier


# -- kernels shared inside one process --------------------------------------------------------
# vLLM in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni") builds the scheduler
# side and the worker side in the same process; they then share the worker's kernel, so the
# scheduler also sees the worker's process-local memory tier. Keyed by pid and config, so a
# forked child never reuses its parent's kernel.
_lock = threading.Lock()
_kernels: dict[tuple[int, str], Any] = {}


def _config_key(config: UCMConfig) -> str:
    return json.dumps(config.model_dump(mode="json"), sort_keys=True)


def acquire_kernel(config: UCMConfig, *, register: bool) -> Any:
    """A Kernel for `config`, starting in the background: opening a tier can be slow or hang
    (an unreachable backend), and vLLM's start-up must not wait for it. Until `kernel.running`
    the hook treats every block as a miss. `register` makes it findable by `find_kernel`."""
    from ucm.kernel import Kernel

    kernel = Kernel(config)
    if register:
        with _lock:
            _kernels[(os.getpid(), _config_key(config))] = kernel

    def start() -> None:
        try:
            kernel.start()
        except Exception as exc:  # the hook runs on as if storage were empty
            log.warning("ucm: the kernel did not start (%s); every lookup is a miss", exc)

    threading.Thread(target=start, name="ucm-kernel-start", daemon=True).start()
    return kernel


def find_kernel(config: UCMConfig) -> Any | None:
    """The registered kernel of this process with `config` (it may still be starting)."""
    with _lock:
        return _kernels.get((os.getpid(), _config_key(config)))


def wait_running(kernel: Any, timeout: float) -> bool:
    """Waits up to `timeout` s for a kernel started by `acquire_kernel` to run."""
    end = time.monotonic() + timeout
    while not kernel.running:
        if time.monotonic() >= end:
            return False
        time.sleep(0.002)
    return True


def release_kernel(kernel: Any) -> None:
    with _lock:
        for k, v in list(_kernels.items()):
            if v is kernel:
                del _kernels[k]
        _workers.pop(id(kernel), None)


# The worker side that owns a registered kernel: in one process, the scheduler side starts a
# step's loads through it as soon as it has planned them (`WorkerSide.load_early`).
_workers: dict[int, Any] = {}


def register_worker(kernel: Any, worker: Any) -> None:
    with _lock:
        _workers[id(kernel)] = worker


def find_worker(kernel: Any) -> Any | None:
    """The worker side in this process that owns `kernel`, if any."""
    with _lock:
        worker = _workers.get(id(kernel))
    return worker if worker is not None and worker.kernel is kernel else None
