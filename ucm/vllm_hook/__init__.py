"""The vLLM KV connector of ucm, loaded by vLLM out of tree:

    KVTransferConfig(kv_connector="UCMConnector", kv_connector_module_path="ucm.vllm_hook",
                     kv_role="kv_both",
                     kv_connector_extra_config={"ucm": {...ucm config...}})

Modules and the process each runs in:

    keys.py        both: block keys from token ids (pure Python, no vLLM)
    settings.py    both: the connector's options and the kernel config it derives
    metadata.py    crosses processes: the plain dataclasses the scheduler sends each step
    scheduler.py   the scheduler process (EngineCore): lookups, hit accounting, plans
    layout.py      the worker process: block byte ranges and staging copies (torch)
    worker.py      the worker process: loads, saves, load-error reporting
    layerwise.py   the worker process: the layerwise mode's loads, layer by layer
    hugepages.py   the worker process: a host-memory KV cache collapsed into huge pages
    sparse.py      the worker process: sparse decode attention (kv_connector_extra_config
                   "sparse"); wraps vLLM 0.32.0's CPUAttentionBackendImpl.forward
    stats.py       both: ucm's counters through vLLM's connector-stats hooks (/metrics)
    connector.py   both: the KVConnectorBase_V1 facade that builds one side by role
    serve.py       the `ucm serve` command: vLLM's OpenAI server with the connector
    environment.py the engine's environment on the CPU (OpenMP spin, tcmalloc; stdlib only)

`UCMConnector` is imported lazily so that `ucm.vllm_hook.keys` works without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UCMConnector"]


def __getattr__(name: str) -> Any:
    if name == "UCMConnector":
        from ucm.vllm_hook.connector import UCMConnector

        return UCMConnector
    raise AttributeError(f"module 'ucm.vllm_hook' has no attribute {name!r}")
