"""Raw clients `ucm bench` measures a driver next to: one module per driver, named after it,
with `raw_baseline(options, namespace)` returning an object with label, store(keys, bufs),
load(keys, outs, batch), delete(keys) and close() (or None where there is no baseline)."""
