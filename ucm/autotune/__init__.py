"""Trace-driven cache simulation and configuration tuning.

    from ucm.autotune import AutoTuner
    tuner = AutoTuner(workload="chat", constraints={"max_latency_ms": 100, "max_memory_gb": 16})
    optimal_config = tuner.tune(model="llama-2-7b", sample_requests=sample_data)
"""

from __future__ import annotations

from ucm.autotune._simulate import (
    Retention,
    SimResult,
    SimTier,
    belady,
    next_uses,
    simulate,
)
from ucm.autotune._traces import (
    Request,
    from_token_lists,
    load_requests,
    read_jsonl,
    read_ucm_trace,
)
from ucm.autotune._tuner import MODELS, AutoTuner, Prediction, kv_bytes_per_token

__all__ = [
    "MODELS",
    "AutoTuner",
    "Prediction",
    "Request",
    "Retention",
    "SimResult",
    "SimTier",
    "belady",
    "from_token_lists",
    "kv_bytes_per_token",
    "load_requests",
    "next_uses",
    "read_jsonl",
    "read_ucm_trace",
    "simulate",
]
