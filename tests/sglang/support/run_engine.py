"""Runs prompts through one SGLang engine (offline `sglang.Engine`, or the HTTP server) on the
CPU with HiCache, and prints one `RESULT {json}` line. Runs in .venv-sglang, never in .venv.

usage: run_engine.py SPEC_JSON
spec: model, dtype (float32), backend ("dynamic", "file" or null), extra (the backend's extra
      config), prompts, max_new_tokens, settle (seconds for the backup thread to write before
      exit), http (bool), port, watchdog (seconds before the process gives up, exit 3),
      max_total_tokens, watch_dir (offline only: after each prompt, wait until the page files
      under it have settled and report the new ones in that prompt's result, "new_pages"),
      flush_after (offline only: seconds to wait after each prompt but the last before
      emptying the device and host caches, so that the next prompt finds its pages in storage
      only)
env: UCM_TEST_SGLANG_MLA=absorbed runs an MLA model on the torch_native attention backend
     (absorbed_mla_on_torch_native)
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
PAGE_SIZE = 16


def absorbed_mla_on_torch_native() -> None:
    """SGLang 0.5.19 runs an MLA model's prefill without a cached prefix through its MHA path
    (`attn_mha` with the new tokens' K and V), which the torch_native attention backend cannot
    serve: it reads K and V from the pool, where MLA keeps the 576-wide latent ("Expected size
    for first two dimensions of batch2 tensor to be: [2, 192] but got: [2, 576]"). On the CPU
    DeepSeek's own backend is intel_amx (sgl_kernel's compiled CPU kernels, which this test
    venv lacks). So every torch_native forward of an MLA model takes the absorbed path (the
    latent from the pool; what SGLang already does for decodes and for prefills past a cached
    prefix). Runs in every process of the engine: spawned processes import this module too."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    AttentionBackendRegistry.register("torch_native", lambda attn, batch: AttnForwardMethod.MLA)
    # The MLA host pool imports its transfers from sgl_kernel only on CUDA and ROCm (the MHA
    # one is patched at setup): the stand-in's `direct` copy, as for MHA.
    from sgl_kernel.kvcacheio import transfer_kv_direct
    from sglang.srt.mem_cache.pool_host import mla

    mla.transfer_kv_direct = transfer_kv_direct


if os.environ.get("UCM_TEST_SGLANG_MLA") == "absorbed":
    absorbed_mla_on_torch_native()


def rendezvous_port() -> int:
    """A free port below the kernel's ephemeral range for torch.distributed's rendezvous.
    SGLang's own choice is an ephemeral port that it binds a minute later, under load: by then
    another test's server or an outgoing connection can hold it (EADDRINUSE at start)."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    low = int(ephemeral[0])
    rng = random.Random()  # seeded by the OS: concurrent runners pick different ports
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range for the rendezvous")


def engine_args(spec: dict) -> dict:
    args = dict(model_path=spec["model"], device="cpu", attention_backend="torch_native",
                nccl_port=rendezvous_port(),
                dtype=spec.get("dtype", "float32"),
                disable_cuda_graph=True, max_total_tokens=spec.get("max_total_tokens", 8192),
                max_running_requests=4, random_seed=0, page_size=PAGE_SIZE, log_level="warning",
                enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_io_backend="direct",
                hicache_mem_layout="layer_first", hicache_write_policy="write_through",
                hicache_storage_prefetch_policy="wait_complete", enable_cache_report=True)
    if spec.get("backend"):
        args["hicache_storage_backend"] = spec["backend"]
    if spec.get("extra") is not None:
        args["hicache_storage_backend_extra_config"] = json.dumps(spec["extra"])
    return args


def summary(out: dict, seconds: float) -> dict:
    meta = out["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return {"text": out["text"], "output_ids": out.get("output_ids"),
            "prompt_tokens": meta.get("prompt_tokens"),
            "cached_tokens": meta.get("cached_tokens"), "details": details,
            "storage_tokens": int(details.get("storage", 0) or 0), "seconds": seconds}


def page_files(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root)
            for f in files if f.endswith(".blk")}


def new_pages(root: str, before: set[str], at_least: int) -> list[str]:
    """The page files written under `root` since `before`, once there are `at_least` of them
    and none has come for a second (the backup thread writes them after the request)."""
    seen, quiet_since = page_files(root), time.monotonic()
    while len(seen - before) < at_least or time.monotonic() - quiet_since < 1.0:
        time.sleep(0.2)
        now = page_files(root)
        if now != seen:
            seen, quiet_since = now, time.monotonic()
    return sorted(seen - before)


def run_offline(spec: dict) -> list[dict]:
    import sglang

    engine = sglang.Engine(**engine_args(spec))
    results = []
    sampling = {"temperature": 0, "max_new_tokens": spec.get("max_new_tokens", 8)}
    watch = spec.get("watch_dir")
    before = page_files(watch) if watch else set()
    for i, prompt in enumerate(spec["prompts"]):
        start = time.perf_counter()
        out = engine.generate(prompt, sampling)
        results.append(summary(out, time.perf_counter() - start))
        if watch:  # every full page of the prompt, and what the backup adds after
            pages = new_pages(watch, before, results[-1]["prompt_tokens"] // PAGE_SIZE)
            results[-1]["new_pages"] = pages
            before |= set(pages)
        if spec.get("flush_after") is not None and i + 1 < len(spec["prompts"]):
            time.sleep(spec["flush_after"])  # the backup thread writes the pages meanwhile
            if not getattr(engine.flush_cache(), "success", False):
                raise RuntimeError("SGLang did not flush its caches")
    time.sleep(spec.get("settle", 0))
    engine.shutdown()
    return results


def run_http(spec: dict) -> list[dict]:
    port = int(spec["port"])
    cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port",
           str(port)]
    for name, value in engine_args(spec).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False:
            cmd += [flag, str(value)]
    server = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} at start")
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        results = []
        for prompt in spec["prompts"]:
            body = json.dumps({"text": prompt, "sampling_params": {
                "temperature": 0, "max_new_tokens": spec.get("max_new_tokens", 8)}}).encode()
            request = urllib.request.Request(url + "/generate", data=body,
                                             headers={"Content-Type": "application/json"})
            start = time.perf_counter()
            with urllib.request.urlopen(request, timeout=spec.get("watchdog", 300)) as reply:
                out = json.load(reply)
            results.append(summary(out, time.perf_counter() - start))
        time.sleep(spec.get("settle", 0))
        return results
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    spec = json.loads(sys.argv[1])

    def give_up() -> None:
        print("WATCHDOG: no result in time", flush=True)
        os._exit(3)

    timer = threading.Timer(spec.get("watchdog", 300), give_up)
    timer.daemon = True
    timer.start()
    try:
        results = run_http(spec) if spec.get("http") else run_offline(spec)
    except Exception as exc:
        print("ERROR " + json.dumps({"type": type(exc).__name__, "message": str(exc)}),
              flush=True)
        os._exit(2)
    print("RESULT " + json.dumps(results), flush=True)
    os._exit(0)  # SGLang's threads can outlive shutdown(); the answer is printed


if __name__ == "__main__":
    main()
