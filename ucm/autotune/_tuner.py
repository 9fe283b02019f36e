"""The AutoTuner: a ucm config chosen by replaying sample requests through the simulator.

The search covers the fast tier's size (memory), whether a disk tier sits under it and its
size, and the eviction policy. Each candidate is replayed with prefix semantics; its load
latency comes from the machine's own driver bandwidths (`ucm bench --json FILE` records),
never from constants. A candidate fits when its memory is within `max_memory_gb`, its disk
within `max_disk_gb` and its mean per-request load time within `max_latency_ms`; the best
fitting one has the highest hit ratio (then the least load time, then the least memory), and
its sizes are then bisected toward the next larger ones that did not fit.

Without `bench_json` the bandwidths come from a short probe of this machine's drivers, cached
per machine under the ucm cache directory (`ucm.autotune._probe`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ucm.autotune._simulate import SimTier, simulate
from ucm.autotune._traces import Request, load_requests
from ucm.kernel._policy import POLICIES

GB = 1 << 30
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8": 1, "fp8": 1}
# name -> (layers, KV heads, head size, dtype)
MODELS: dict[str, tuple[int, int, int, str]] = {
    "llama-2-7b": (32, 32, 128, "float16"),
    "llama-2-13b": (40, 40, 128, "float16"),
    "llama-3-8b": (32, 8, 128, "bfloat16"),
    "llama-3-70b": (80, 8, 128, "bfloat16"),
    "mistral-7b": (32, 8, 128, "bfloat16"),
    "qwen2-7b": (28, 4, 128, "bfloat16"),
}
# workload -> tokens per block a token-id trace is keyed with, and its default sample source
WORKLOADS = {"chat": 16, "rag": 16, "code": 16}


def kv_bytes_per_token(model: str, *, tp: int = 1) -> int:
    """Bytes of K and V per token on one rank: a known name or a Hugging Face config.json."""
    if model in MODELS:
        layers, kv_heads, head, dtype = MODELS[model]
    elif os.path.exists(model):
        cfg = json.loads(Path(model).read_text())
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        dtype = str(cfg.get("torch_dtype") or "float16")
    else:
        raise ValueError(f"unknown model {model!r}: name one of {', '.join(MODELS)} or give "
                         "the path of its config.json")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return 2 * layers * max(1, kv_heads // tp) * head * _DTYPE_BYTES[dtype]


def load_bandwidths(path: str | os.PathLike[str]) -> dict[str, float]:
    """Each driver's best measured load bandwidth (bytes/s) in a `ucm bench --json` file."""
    best: dict[str, float] = {}
    for record in json.loads(Path(path).read_text()):
        if record.get("op") == "load" and record.get("gbps"):
            bps = float(record["gbps"]) * 1e9
            best[record["driver"]] = max(best.get(record["driver"], 0.0), bps)
    if not best:
        raise ValueError(f"{path}: no load records (write one with `ucm bench --json FILE`)")
    return best


@dataclass(frozen=True)
class Candidate:
    memory_bytes: int
    disk_bytes: int  # 0: no disk tier
    eviction: str


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    hit_ratio: float
    bytes_loaded_per_request: float
    load_ms_per_request: float
    memory_gb: float
    disk_gb: float

    def fits(self, constraints: dict[str, float]) -> bool:
        return (self.memory_gb <= constraints.get("max_memory_gb", float("inf")) + 1e-9
                and self.disk_gb <= constraints.get("max_disk_gb", float("inf")) + 1e-9
                and self.load_ms_per_request <= constraints.get("max_latency_ms", float("inf")))


def best_of(predictions: Sequence[Prediction]) -> Prediction:
    """The highest hit ratio, then the least load time a request, then the least memory, then
    the least disk. Load time before memory: once a disk holds every reused block, any memory
    size hits as often, and the least of it would serve those hits from disk."""
    return max(predictions, key=lambda p: (round(p.hit_ratio, 9),
                                           -round(p.load_ms_per_request, 6),
                                           -p.memory_gb, -p.disk_gb))


class AutoTuner:
    """Searches a ucm config for a model and a workload under constraints."""

    def __init__(self, workload: str = "chat", constraints: dict[str, Any] | None = None, *,
                 bench_json: str | os.PathLike[str] | None = None, tp: int = 1,
                 block_tokens: int | None = None, disk_path: str = "/var/cache/ucm",
                 progress: bool = True, cache_dir: str | os.PathLike[str] | None = None,
                 probe_block_bytes: int = 1 << 20, probe_blocks: int = 64) -> None:
        if workload not in WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}; choose {', '.join(WORKLOADS)}")
        self.workload = workload
        self.constraints = dict(constraints or {})
        self.tiers = list(self.constraints.pop("tiers", ["memory", "posix"]))
        self.bench_json = bench_json
        self.tp = tp
        self.block_tokens = block_tokens
        self.disk_path = disk_path
        self.progress = progress
        self.cache_dir = cache_dir  # None: the ucm cache directory
        self.probe_block_bytes = probe_block_bytes
        self.probe_blocks = probe_blocks
        self.bandwidth_source = ""  # where the last tune's bandwidths came from
        self.predictions: list[Prediction] = []
        self.best: Prediction | None = None
        self.requests: list[Request] = []  # the last tune()'s sample, and its block size
        self.block_bytes = 0

    def _bandwidths(self) -> dict[str, float]:
        """`bench_json`'s figures, or without it this machine's: measured by a short probe
        the first time, then read from the ucm cache directory (`ucm.autotune._probe`)."""
        if self.bench_json is None:
            from ucm.autotune._probe import machine_bandwidths
            from ucm.config import default_cache_dir

            cache = Path(self.cache_dir) if self.cache_dir is not None else default_cache_dir()
            bandwidths, self.bandwidth_source = machine_bandwidths(
                self.tiers, cache, block_bytes=self.probe_block_bytes,
                blocks=self.probe_blocks, progress=self.progress)
            if self.progress:
                print(f"ucm tune: {self.bandwidth_source}", file=sys.stderr, flush=True)
            return bandwidths
        self.bandwidth_source = f"load bandwidths from {self.bench_json}"
        bandwidths = load_bandwidths(self.bench_json)
        missing = [t for t in self.tiers if t not in bandwidths]
        if missing:
            raise ValueError(f"{self.bench_json}: no load bandwidth for {', '.join(missing)}")
        return bandwidths

    def candidates(self, block_bytes: int, blocks_seen: int) -> list[Candidate]:
        """Memory sizes from a few blocks up to the constraint (or what the sample touches),
        with and without a disk tier, for every policy."""
        limit = self.constraints.get("max_memory_gb")
        top = int(limit * GB) if limit is not None else blocks_seen * block_bytes
        sizes = sorted({max(block_bytes, int(top * f) // block_bytes * block_bytes)
                        for f in (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 0.9, 1)})
        disks = [0]
        if "posix" in self.tiers:
            disk_limit = self.constraints.get("max_disk_gb")
            disk_top = int(disk_limit * GB) if disk_limit is not None else (
                blocks_seen * block_bytes)
            disks += [max(block_bytes, int(disk_top * f) // block_bytes * block_bytes)
                      for f in (1 / 4, 1 / 2, 1)]
        return [Candidate(m, d, e) for m in sizes for d in sorted(set(disks))
                for e in POLICIES if "memory" in self.tiers]

    def evaluate(self, requests: Sequence[Request], candidate: Candidate, block_bytes: int,
                 bandwidths: dict[str, float]) -> Prediction:
        tiers = [SimTier(candidate.eviction, candidate.memory_bytes // block_bytes, "memory")]
        if candidate.disk_bytes:
            tiers.append(SimTier(candidate.eviction, candidate.disk_bytes // block_bytes,
                                 "posix"))
        result = simulate(requests, tiers)
        n = max(1, result.requests)
        seconds = sum(result.hits_by_tier[i] * block_bytes / bandwidths[t.name]
                      for i, t in enumerate(tiers))
        return Prediction(candidate, result.hit_ratio, result.hits * block_bytes / n,
                          1000 * seconds / n, candidate.memory_bytes / GB,
                          candidate.disk_bytes / GB)

    def tune(self, model: str, sample_requests: str | os.PathLike[str] | Sequence[Sequence[int]],
             ) -> dict[str, Any]:
        """The best config found (a dict that `ucm.config.load_config` accepts); its
        predictions are `self.best` (`report()` as plain data)."""
        bandwidths = self._bandwidths()
        block_tokens = self.block_tokens or WORKLOADS[self.workload]
        if isinstance(sample_requests, (str, os.PathLike)) and str(
                sample_requests).endswith(".jsonl") and self.block_tokens is None:
            block_tokens = 512  # hash_ids traces (Mooncake's) key 512-token blocks
        requests = load_requests(sample_requests, block_size=block_tokens)
        block_bytes = kv_bytes_per_token(model, tp=self.tp) * block_tokens
        self.requests, self.block_bytes = requests, block_bytes
        seen = len({key for r in requests for key in r.blocks})
        candidates = self.candidates(block_bytes, seen)
        self.predictions = []
        if self.progress:
            from rich.progress import track

            steps: Any = track(candidates, description="replaying candidates")
        else:
            steps = candidates
        for candidate in steps:
            self.predictions.append(self.evaluate(requests, candidate, block_bytes, bandwidths))
        fitting = [p for p in self.predictions if p.fits(self.constraints)]
        if not fitting:
            raise ValueError("no candidate meets the constraints "
                             f"{self.constraints}; relax them")
        self.best = self._refine(best_of(fitting), requests, block_bytes, bandwidths)
        return self.config_of(self.best)

    def _refine(self, best: Prediction, requests: Sequence[Request], block_bytes: int,
                bandwidths: dict[str, float], steps: int = 3) -> Prediction:
        """Bisects each size of `best` toward the next larger candidate size that did not fit
        (a latency bound falls between grid points: the larger tier hits more but loads more
        from disk), keeping what fits and is better; a few replays more."""
        tried = {p.candidate: p for p in self.predictions}
        for field in ("disk_bytes", "memory_bytes"):
            c = best.candidate
            size = getattr(c, field)
            if field == "disk_bytes" and not size:
                continue
            larger = sorted(getattr(p.candidate, field) for p in self.predictions
                            if getattr(p.candidate, field) > size
                            and replace(p.candidate, **{field: size}) == c
                            and not p.fits(self.constraints))
            if not larger:
                continue
            lo, hi = size, larger[0]
            for _ in range(steps):
                mid = (lo + hi) // 2 // block_bytes * block_bytes
                if mid <= lo or mid >= hi:
                    break
                candidate = replace(best.candidate, **{field: mid})
                if candidate not in tried:
                    tried[candidate] = self.evaluate(requests, candidate, block_bytes,
                                                     bandwidths)
                    self.predictions.append(tried[candidate])
                if tried[candidate].fits(self.constraints):
                    lo = mid
                    best = best_of([best, tried[candidate]])
                else:
                    hi = mid
        return best

    def config_of(self, prediction: Prediction) -> dict[str, Any]:
        c = prediction.candidate
        tiers: list[dict[str, Any]] = [{"driver": "memory", "capacity": c.memory_bytes}]
        if c.disk_bytes:
            tiers.append({"driver": "posix", "path": self.disk_path,
                          "capacity": c.disk_bytes})
        return {"tiers": tiers, "eviction": c.eviction}

    def report(self) -> dict[str, Any]:
        """The best prediction as plain data."""
        if self.best is None:
            raise ValueError("tune() first")
        out = asdict(self.best)
        out.update(out.pop("candidate"))
        return out

    def plot_pareto(self, path: str) -> None:
        """Memory against hit ratio and against load time, the Pareto front marked."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        preds = self.predictions
        front = [p for p in preds if not any(
            q.memory_gb <= p.memory_gb and q.hit_ratio > p.hit_ratio for q in preds)]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.scatter([p.memory_gb for p in preds], [p.hit_ratio for p in preds], s=8, alpha=0.4)
        front.sort(key=lambda p: p.memory_gb)
        a.plot([p.memory_gb for p in front], [p.hit_ratio for p in front], "r-o", ms=3)
        a.set_xlabel("memory tier (GiB)")
        a.set_ylabel("block hit ratio")
        b.scatter([p.memory_gb for p in preds], [p.load_ms_per_request for p in preds], s=8)
        b.set_xlabel("memory tier (GiB)")
        b.set_ylabel("KV load per request (ms)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
