"""Benchmarks, the demo, the vLLM engine runner and the tiny models they build: everything
`ucm bench` and `ucm demo` need, kept out of the product packages (tests/test_layering.py).

    ucm bench [storage]     the drivers through the kernel, next to a baseline (storage)
    ucm bench policy        eviction policies' hit ratios on seeded workloads (policy)
    ucm bench vllm          time to first token on vLLM (vllm, engines, null_connector, models)
    ucm bench sparse        sparse selection and KV codecs on the CPU (sparse, sparse_eval)
    ucm bench trace         what tracing costs (trace)
    ucm demo                stored KV reused by a second vLLM engine (demo)

`command` sends `ucm bench NAME ...` to its module.

This module imports nothing: scripts/setup.sh imports `ucm.bench.engines` before ucm's
dependencies are installed.
"""
