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


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    sessions: list[SessionOp] = field(default_factory=list)  # finished requests' hints

    @property
    def empty(self) -> bool:
        return not (self.loads or self.saves or self.sessions)
