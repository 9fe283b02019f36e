"""The HiCache storage backend: SGLang's pages in and out of a ucm kernel.

SGLang names a page by its own chain of SHA-256 digests over the token ids (each page's
digest covers every earlier page), so the chain is already content addressed; the storage key
is that digest hashed with this model's namespace seed (`ucm.engine.keys.foreign_key`), then
turned into this TP/PP rank's shard key. SGLang never sees a ucm error: every method answers
with a miss (False, None, 0) instead, counted in `get_stats()`, since an exception in its
prefetch thread hangs the request.

Zero copy (`interface_v1`): `host_pool.get_page_buffer_meta` gives each page's pieces in the
host pool (2 x layers of them in the layer_first layout); a load reads straight into them
through a `Scatter`. A store passes a page as it lies: one view when its pieces are one span,
else a `Scatter` of its spans (MHA page_first: K and V in separate pools), which the posix and
memory tiers write from as it is (the kernel joins the pieces only for a driver that cannot).
Either way a page's bytes are in SGLang's flat-page order (`get_data_page`), so the plain
`batch_get`/`batch_set` interface and the zero-copy one read each other's pages.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ucm.block import Scatter
from ucm.codecs import KVLayout
from ucm.config import UCMConfig, format_errors, load_config
from ucm.engine.keys import (
    chain_seed,
    foreign_key,
    make_namespace,
    model_identity,
    rank_key,
    weights_fingerprint,
)
from ucm.engine.pages import FAILURES, PageIO
from ucm.errors import ConfigError, UCMError
from ucm.kernel import Kernel

log = logging.getLogger("ucm.sglang_hook")

DEFAULT_TIMEOUT = 10.0
T = TypeVar("T")
_OPTIONS = "hicache_storage_backend_extra_config"


class StorageOptions(BaseModel):
    """Every key of SGLang's `hicache_storage_backend_extra_config` the backend accepts."""

    # Errors name the key, never echo its value: a ucm config may hold a secret.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    ucm: UCMConfig = Field(
        description="the ucm config: a mapping (tiers, deadline, ...), or the path of a YAML "
        "or JSON file holding one")
    model_id: str | None = Field(
        default=None, min_length=1, description="names the model in the namespace instead "
        "of the fingerprint of its checkpoint: whoever sets it vouches that every engine "
        "given the same id runs the same weights")
    model_path: str | None = Field(
        default=None, min_length=1, description="the local checkpoint to fingerprint when "
        "SGLang's served model name is not one")
    timeout: float = Field(
        default=DEFAULT_TIMEOUT, gt=0, strict=True, description="seconds each call may take "
        "(its kernel deadline); a call past it is a miss")
    interface_v1: bool = Field(
        default=False, description="SGLang's zero-copy interface: pages go straight between "
        "its host pool and the drivers (read by SGLang)")
    backend_name: str | None = Field(default=None, description="SGLang's name for the "
                                     "backend (read by SGLang)")
    module_path: str | None = Field(default=None, description="the module SGLang loads the "
                                    "backend from, ucm.sglang_hook (read by SGLang)")
    class_name: str | None = Field(default=None, description="the backend's class, "
                                   "UCMStorage (read by SGLang)")

    @field_validator("ucm", mode="before")
    @classmethod
    def _config_file(cls, value: Any) -> Any:
        """A path names a YAML or JSON file holding the ucm config."""
        if isinstance(value, str | os.PathLike):
            return load_config(Path(value))
        return value

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> StorageOptions:
        """The options in an extra config; ConfigError names a bad or missing key."""
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            raise ConfigError(format_errors(exc, root=_OPTIONS)) from None


def page_namespace(*, model_id: str, model_type: str, dtype: str, page_size: int, layout: str,
                   is_mla: bool) -> str:
    """The namespace of SGLang's pages: its host-pool layout is part of it, so pages are
    shared only with engines whose pages have the same bytes (none but SGLang: see
    docs/sglang.md)."""
    kv_layout = f"sglang.{layout}.{'mla' if is_mla else 'mha'}"
    return make_namespace(model_type=model_type, model_id=model_id, dtype=dtype,
                          block_size=page_size, kv_layout=kv_layout)


_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}


def page_layouts(mem_pool_host: Any, *, layout: str, is_mla: bool) -> list[KVLayout]:
    """The KV layout of SGLang's pages, for the quantizing tiers of the backend's kernel: an
    MHA `layer_first` page is [K, V] x layers x page_size x heads x head_dim in its flat-page
    order (K of every layer, then V; SGLang's get_flat_data_page), so per layer a key part and,
    after all of them, a value part of page_size tokens by heads x head_dim channels. [] for
    any other page (MLA's latent, other layouts, other dtypes): quantizing tiers store those
    losslessly."""
    dtype = _DTYPES.get(str(getattr(mem_pool_host, "dtype", "")))
    try:
        layers = int(mem_pool_host.layer_num)
        tokens = int(mem_pool_host.page_size)
        channels = int(mem_pool_host.head_num) * int(mem_pool_host.head_dim)
    except (AttributeError, TypeError, ValueError):
        return []
    if is_mla or layout != "layer_first" or dtype is None or min(layers, tokens, channels) < 1:
        return []
    found = KVLayout(dtype, (("k", tokens, channels),) * layers + (("v", tokens, channels),)
                     * layers)
    page_bytes = int(mem_pool_host.get_dummy_flat_data_page().nbytes)
    return [found] if found.raw_bytes == page_bytes else []


# SGLang's names (its PoolName values) for the host pools beside the KV one that a hybrid
# model's HybridCacheController backs up through the v2 interface, which ucm does not implement.
SIDECAR_POOLS = {
    "swa": "sliding-window attention KV (SWA layers beside full ones)",
    "mamba": "Mamba / linear-attention state",
    "indexer": "the sparse-attention (DSA) indexer's keys",
    "draft": "a speculative draft model's KV",
    "draft_indexer": "a speculative draft model's DSA indexer keys",
    "draft_swa": "a speculative draft model's sliding-window KV",
}


def refuse_sidecar_pool(name: str) -> ConfigError:
    """The error that stops SGLang at start when it registers a host pool ucm cannot store."""
    what = SIDECAR_POOLS.get(name) or ("compressed KV or state of DeepSeek V4" if
                                       name.startswith("deepseek_v4") else "an extra host pool")
    return ConfigError(
        f"ucm's HiCache storage backend cannot serve this model: SGLang registered its host "
        f"pool {name!r} ({what}) beside the KV pool; SGLang reads and writes such pools only "
        f"through the backend's v2 interface (batch_exists_v2 / batch_get_v2 / batch_set_v2, "
        f"one PoolTransfer per pool), and ucm stores the KV pool alone (dense and MLA models). "
        f"Run this model without --hicache-storage-backend, or with a backend that implements "
        f"v2" + ("; or with --disable-hybrid-swa-memory, which keeps full KV for every layer "
                 "in the one KV pool" if name == "swa" else ""))


def storage_key(seed: bytes, sglang_key: str, *, rank: int, size: int) -> bytes:
    """The ucm key of one rank's shard of the page SGLang names `sglang_key`."""
    return rank_key(foreign_key(seed, bytes.fromhex(sglang_key)), rank, size)


def _identity(model: str, model_id: str | None) -> tuple[str, str]:
    """(model_type, model identity) of a local checkpoint, or of a name vouched for."""
    config_path = os.path.join(model, "config.json")
    hf: dict[str, Any] = {}
    if os.path.isfile(config_path):
        with open(config_path) as f:
            hf = json.load(f)
    model_type = str(hf.get("model_type", "model"))
    if model_id:
        return model_type, model_id
    if hf and os.path.isdir(model):
        return model_type, model_identity(hf, "weights:" + weights_fingerprint(model))
    log.warning("ucm: model %r is not a local checkpoint; its pages are named by its name "
                "(set model_id in the extra config to vouch for its identity)", model)
    return model_type, model_identity({}, f"name:{model}")


class UCMStorageBase:
    """ucm as a HiCache storage backend; SGLang builds it as `cls(storage_config, kwargs)`.

    The extra config's keys are `StorageOptions`: `ucm` holds a ucm config (a mapping, or the
    path of a YAML or JSON file); `model_path` or `model_id` names the model when the served
    name is not its checkpoint, `timeout` bounds each call (seconds). An unknown key, a bad
    value or a missing `ucm` raises ConfigError naming the key here, at start.
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        options = StorageOptions.parse(getattr(storage_config, "extra_config", None))
        self.ucm_config: UCMConfig = options.ucm
        self.timeout = options.timeout
        model = str(options.model_path or getattr(storage_config, "model_name", "") or "")
        self.model_type, self.model_id = _identity(model, options.model_id)
        tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
        pp_rank = int(getattr(storage_config, "pp_rank", 0) or 0)
        pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        # MLA pages are the same on every TP rank: one shard, any rank reads it.
        self.rank = pp_rank * (1 if self.is_mla else tp_size) + (0 if self.is_mla else tp_rank)
        self.size = pp_size * (1 if self.is_mla else tp_size)
        self.kernel: Kernel | None = None
        self.io: PageIO | None = None
        self.seed = b""
        self.namespace = ""
        self.k_then_v = False  # layer_first MHA: pieces come K0 V0 K1 V1 ..., pages K... V...
        self.page_bytes = 0
        self.kv_layouts: list[KVLayout] = []  # given to the kernel's quantizing tiers
        # (pages, GB/s) of each load and store since SGLang last asked: its storage metrics.
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {"prefetch_pgs": [], "prefetch_bandwidth": [],
                                                 "backup_pgs": [], "backup_bandwidth": []}

    # -- set up ----------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Called once by SGLang with the host pool: its dtype, page size and layout complete
        the namespace, and the kernel starts. A config the drivers refuse raises (at start);
        storage that is down only makes every call a miss."""
        self.mem_pool_host = mem_pool_host
        layout = str(getattr(mem_pool_host, "layout", "layer_first"))
        self.page_size = int(mem_pool_host.page_size)
        self.namespace = page_namespace(
            model_id=self.model_id, model_type=self.model_type,
            dtype=str(mem_pool_host.dtype), page_size=self.page_size, layout=layout,
            is_mla=self.is_mla)
        self.seed = chain_seed(self.namespace)
        self.k_then_v = layout == "layer_first" and not self.is_mla
        self.page_bytes = int(mem_pool_host.get_dummy_flat_data_page().nbytes)
        config = self.ucm_config.model_copy(update={"namespace": self.namespace})
        # where keys and values sit in a page, for tiers that quantize (ucm.codecs)
        self.kv_layouts = page_layouts(mem_pool_host, layout=layout, is_mla=self.is_mla)
        # No call waits longer than `timeout`, so neither does closing for what is in flight.
        self.kernel = Kernel(config, drain_timeout=self.timeout, layouts=self.kv_layouts)
        self.io = PageIO(self.kernel, timeout=self.timeout)
        try:
            self.kernel.start()
        except ConfigError:
            raise
        except UCMError as exc:  # down now: misses until it answers (each submit retries)
            log.warning("ucm: storage did not start (%s); HiCache storage calls miss", exc)
        log.info("ucm: SGLang HiCache storage, namespace %s, rank %d of %d", self.namespace,
                 self.rank, self.size)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's HybridCacheController (every model's, in 0.5.19) registers each of its
        host pools here when it attaches the backend, at start: the KV pool ("kv"), and for a
        hybrid model its sidecars ("swa", "mamba", "indexer", "draft", ...). A sidecar is
        refused here by name (ConfigError, the engine does not start): SGLang would back it up
        and look it up through the v2 calls, whose NotImplementedError in its storage threads
        leaves requests waiting for ever."""
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name != "kv":
            raise refuse_sidecar_pool(name)
        pools: dict[Any, Any] | None = getattr(self, "registered_pools", None)
        if not isinstance(pools, dict):
            pools = {}
            self.registered_pools = pools  # what SGLang's own register_mem_host_pool_v2 keeps
        pools[host_pool_name] = host_pool

    # -- the v2 interface: never used with the KV pool alone; a miss, never an exception --------
    def batch_exists_v2(self, keys: Any, pool_transfers: Any = None,
                        extra_info: Any = None) -> Any:
        """With no sidecar pool (refused at start) SGLang calls `batch_exists`; with one it
        would come here: the KV prefix then, and no page of any other pool, so the
        prefix is computed rather than served without its sidecar."""
        try:
            from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
        except ImportError:  # no SGLang: tests
            from types import SimpleNamespace

            return SimpleNamespace(kv_hit_pages=0, extra_pool_hit_pages={})
        if pool_transfers:
            self._count("v2_refused_calls")
            return PoolTransferResult(kv_hit_pages=0, extra_pool_hit_pages={})
        return PoolTransferResult(kv_hit_pages=self.batch_exists(keys, extra_info),
                                  extra_pool_hit_pages={})

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        return self._v2_misses(transfers)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        return self._v2_misses(transfers)

    def _v2_misses(self, transfers: Any) -> dict[str, list[bool]]:
        """Every page of every pool a miss (False), in the shape SGLang reads."""
        self._count("v2_refused_calls")
        out: dict[str, list[bool]] = {}
        try:
            for t in transfers or ():
                name = str(getattr(t.name, "value", t.name))
                keys = getattr(t, "keys", None)
                n = _count(keys) if keys is not None else 0
                if not n and getattr(t, "host_indices", None) is not None:
                    n = _count(t.host_indices) // max(1, getattr(self, "page_size", 1))
                out[name] = [False] * n
        except Exception:  # odd transfers: what was built so far
            pass
        return out

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return [storage_key(self.seed, k, rank=self.rank, size=self.size) for k in keys]

    @staticmethod
    def _trace_id(keys: Sequence[str], extra_info: Any) -> str:
        """A request id for the trace: SGLang passes none, so the prefix's first page names it
        (a prefix's lookups, loads and stores then share it)."""
        prefix = getattr(extra_info, "prefix_keys", None)
        return "sglang:" + str((prefix or keys)[0])[:16]

    def _count(self, name: str, n: int = 1) -> None:
        if self.io is not None:
            self.io.counters.add(name, n)

    # -- lookups ---------------------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The number of leading pages stored."""
        try:
            if self.io is None or not keys:
                return 0
            return self.io.stored_prefix(self._keys(keys),
                                         request_id=self._trace_id(keys, extra_info))
        except Exception as exc:  # never into SGLang
            return self._failed("lookup", exc, _count(keys), 0)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero copy -------------------------------------------------------------------------------
    def _pages(self, host_indices: Any, n: int) -> list[list[tuple[int, int]]]:
        """(address, bytes) of each page's pieces in the host pool, in flat-page order."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // n
        if per * n != len(ptrs):
            raise ValueError(f"{len(ptrs)} pieces for {n} pages")
        pages = []
        for i in range(n):
            pieces = list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per],
                              strict=True))
            if self.k_then_v:
                pieces = pieces[0::2] + pieces[1::2]
            pages.append(pieces)
        return pages

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None,
                     ) -> list[bool]:
        try:
            if self.io is None or not keys:
                return [False] * len(keys)
            buffers = [Scatter.of_views(tuple(_view(p, s) for p, s in page))
                       for page in self._pages(host_indices, len(keys))]
            return self._timed("prefetch", self.io.load, self._keys(keys), buffers,
                               self._trace_id(keys, extra_info))
        except Exception as exc:
            return self._failed("load", exc, _count(keys), [False] * _count(keys))

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None,
                     ) -> list[bool]:
        try:
            if self.io is None or not keys:
                return [False] * len(keys)
            buffers = [_one_span(page) for page in self._pages(host_indices, len(keys))]
            return self._timed("backup", self.io.store, self._keys(keys), buffers,
                               self._trace_id(keys, extra_info))
        except Exception as exc:
            return self._failed("store", exc, _count(keys), [False] * _count(keys))

    # -- the plain interface (flat page tensors) ------------------------------------------------
    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        try:
            if self.io is None or not keys or target_locations is None:
                return [None] * len(keys)
            views = [_tensor_bytes(t) for t in target_locations]
            ok = self._timed("prefetch", self.io.load, self._keys(keys), views,
                             self._trace_id(keys, None))
            return [t if good else None for t, good in zip(target_locations, ok, strict=True)]
        except Exception as exc:
            return self._failed("load", exc, _count(keys), [None] * _count(keys))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        try:
            if self.io is None or not keys or values is None:
                return False
            views = [_tensor_bytes(v.contiguous()) for v in values]
            return all(self._timed("backup", self.io.store, self._keys(keys), views,
                                   self._trace_id(keys, None)))
        except Exception as exc:
            return bool(self._failed("store", exc, _count(keys), False))

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    # -- the rest --------------------------------------------------------------------------------
    def _failed(self, op: str, exc: BaseException, pages: int, answer: T) -> T:
        """An unexpected error (a bug, an odd host pool, arguments of the wrong type): a miss,
        counted and logged once. Nothing here raises: the answer goes back to SGLang."""
        try:
            if self.io is not None:
                self.io.counters.failure(op, exc, pages, None)
            if not getattr(self, "_warned", False):
                self._warned = True
                log.warning("ucm: HiCache storage %s failed (%s: %s); answered as a miss", op,
                            type(exc).__name__, exc)
        except Exception:  # an exception whose str() raises, say: the miss still goes back
            pass
        return answer

    def _timed(self, kind: str, call: Callable[..., list[bool]], keys: list[bytes],
               buffers: Sequence[Any], request_id: str) -> list[bool]:
        start = time.perf_counter()
        ok = call(keys, buffers, request_id=request_id)
        seconds = time.perf_counter() - start
        done = sum(ok)
        if done:
            with self._metrics_lock:
                self._metrics[f"{kind}_pgs"].append(done)
                self._metrics[f"{kind}_bandwidth"].append(
                    done * self.page_bytes / 1e9 / max(seconds, 1e-9))
        return ok

    def get_stats(self) -> Any:
        """The pages and bandwidth of each load (prefetch) and store (backup) since the last
        call, as SGLang's StorageMetrics (its `--enable-storage-metrics` histograms); ucm's
        own counters are in `statistics()`."""
        with self._metrics_lock:
            drained = {k: list(v) for k, v in self._metrics.items()}
            for v in self._metrics.values():
                v.clear()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(int(v) for v in drained["prefetch_pgs"])
        metrics.backup_pgs.extend(int(v) for v in drained["backup_pgs"])
        metrics.prefetch_bandwidth.extend(drained["prefetch_bandwidth"])
        metrics.backup_bandwidth.extend(drained["backup_bandwidth"])
        return metrics

    def statistics(self) -> dict[str, Any]:
        """This backend's page counters and the kernel's own."""
        out: dict[str, Any] = dict(self.io.statistics()) if self.io is not None else {}
        if self.kernel is not None:
            try:
                out["kernel"] = self.kernel.statistics()
            except FAILURES as exc:
                out["kernel_error"] = str(exc)
        return out

    def clear(self) -> None:
        """SGLang's /clear_hicache_storage_backend: ucm keeps its pages (they are shared with
        other processes and evicted by the tiers' own policy)."""

    def close(self) -> None:
        if self.kernel is not None:
            try:
                self.kernel.close()
            except Exception as exc:
                log.warning("ucm: closing the kernel failed: %s", exc)


def _count(keys: Any) -> int:
    """How many pages a call named, for the size of its miss answer: 0 when `keys` has no
    length (SGLang passes lists; anything else must still get an answer, not an error)."""
    try:
        n = len(keys)
    except Exception:
        return 0
    return n if type(n) is int and 0 <= n <= 1 << 24 else 0


def _view(address: int, nbytes: int) -> memoryview:
    """A writable byte view of `nbytes` at `address` (memory SGLang's host pool owns)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _one_span(pieces: list[tuple[int, int]]) -> memoryview | Scatter:
    """A page's bytes for a store, where they lie: a view when its pieces lie end to end,
    else a Scatter of its spans (pieces end to end merged: fewer iovecs), never a copy."""
    spans: list[list[int]] = []
    for address, nbytes in pieces:
        if spans and spans[-1][0] + spans[-1][1] == address:
            spans[-1][1] += nbytes
        else:
            spans.append([address, nbytes])
    if len(spans) == 1:
        return _view(*spans[0])
    return Scatter.of_views(tuple(_view(address, nbytes) for address, nbytes in spans))


def _tensor_bytes(tensor: Any) -> memoryview:
    """A CPU tensor's bytes as a writable view (SGLang's flat pages are contiguous)."""
    return memoryview(tensor.view(-1).view(_uint8(tensor)).numpy()).cast("B")


def _uint8(tensor: Any) -> Any:
    import torch  # the caller is SGLang: torch is loaded already

    return torch.uint8
