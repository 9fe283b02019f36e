"""What the scheduler side sends the worker side each step: plain dataclasses, pickled across
processes in vLLM's multiprocess layout. Digests are rank-independent; each worker derives its
own shard's keys from them (`keys.rank_key`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ucm.vllm_hook.sessions import SessionOp


@dataclass(slots=True)
class BlockTransfer:
    """Blocks of one request to load or to save: `block_ids[i]` holds `digests[i]`, in KV
    cache group `group` (0 but with vLLM's hybrid KV cache manager)."""

    req_id: str
    block_ids: list[int]
    digests: list[bytes]
    group: int = 0


@dataclass(slots=True)
class SparseFree:
    """A sparse request whose offloaded blocks the scheduler gave back to vLLM's free pool
    (`ucm.vllm_hook.sparse_blocks`): logical blocks `freed[i]` (stored in ucm as
    `digests[i]`) are no longer in its cache; `slots` are the physical blocks it kept to
    load selected ones into (their contents are not any block's until loaded).

    `window`: a later free of blocks the moving local window left (after the request's first
    free): the worker adds them to the ones freed before, and its new `slots` to its slots;
    `holding[i]` is the logical block slot `slots[i]` already holds (its own block, kept as a
    slot; None: nothing), empty where no slot holds any."""

    req_id: str
    freed: list[int]
    digests: list[bytes]
    slots: list[int]
    window: bool = False
    holding: list[int | None] = field(default_factory=list)


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    sessions: list[SessionOp] = field(default_factory=list)  # finished requests' hints
    sparse: list[SparseFree] = field(default_factory=list)  # requests whose blocks were freed
    # sparse attention: the physical block each sparse request of the step writes its first
    # token of the step into (never shared, never freed) -> its id, so that the worker's
    # attention backend tells requests apart; and the sparse requests that ended
    sparse_rows: dict[int, str] = field(default_factory=dict)
    sparse_ended: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.loads or self.saves or self.sessions or self.sparse
                    or self.sparse_rows or self.sparse_ended)
