"""`NullConnector`: a KV connector that matches nothing, loads nothing and saves nothing.

A benchmark baseline only (`ucm bench vllm`): vLLM takes its connector code path (per-layer
hooks, connector metadata each step) with none of a connector's own work, so the all-miss cost
splits into what vLLM's connector path costs and what ucm adds on top.

    kv_connector="NullConnector", kv_connector_module_path="ucm.bench.null_connector"
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NullConnector(KVConnectorBase_V1):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int,
                                 ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
