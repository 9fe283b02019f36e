"""Runs a vLLM engine (with or without a KV connector) over token-id prompts, in this process
or in a fresh one, and reports what happened: the shared runner of `ucm demo`,
`ucm bench vllm` and the vLLM tests.

    result = run_in_subprocess(EngineSpec(model=path, connector="ucm"), phases)

A fresh process per engine is what "a second engine" means: nothing but storage is shared.
Inside it vLLM runs in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni"), which
starts much faster on a small CPU machine (figures: docs/performance.md, Engine environment).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

from ucm.bench._warm import WarmChild, WarmEnded, warm_starts

# The engine environment is the product's (`ucm serve` uses it too); re-exported here.
from ucm.vllm_hook.environment import (  # noqa: F401
    _ALLOCATORS,
    OPENMP_SPIN,
    TCMALLOC_PATHS,
    engine_env,
    find_tcmalloc,
)

# x86 flags (/proc/cpuinfo) of instructions that compute bf16 products in hardware.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (the first `flags` line of `cpuinfo`); empty where unreadable."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


def native_dtype(flags: set[str] | None = None) -> tuple[str, str]:
    """The dtype vLLM's CPU engine computes fastest here, and why, in a line: "bfloat16" where
    the CPU has bf16 instructions (avx512_bf16 or amx_bf16), else "float32", since without them
    every bf16 matmul is converted in software (~30x slower than fp32 on an AVX2 CPU)."""
    flags = cpu_flags() if flags is None else flags
    have = [f for f in BF16_FLAGS if f in flags]
    if have:
        return "bfloat16", f"the CPU computes bf16 natively ({', '.join(have)})"
    if not flags:
        return "float32", "the CPU's flags are unknown (no /proc/cpuinfo): fp32 is safe"
    return "float32", ("the CPU has no bf16 instructions (no avx512_bf16 or amx_bf16): bf16 "
                       "would run ~30x slower")


@dataclass
class EngineSpec:
    model: str
    dtype: str = "float32"
    block_size: int = 32
    max_model_len: int = 4096
    kv_cache_bytes: int = 256 * 2**20
    connector: str | None = None  # None, "ucm", "example", "null" or "lmcache"
    ucm: dict | None = None  # the ucm config; None is the embedded default
    extra: dict = field(default_factory=dict)  # more kv_connector_extra_config keys
    prefix_caching: bool = False
    chunked_prefill_tokens: int | None = None  # max_num_batched_tokens
    max_num_seqs: int = 64
    tensor_parallel_size: int = 1
    multiprocess: bool = False  # vLLM's own process layout (EngineCore + worker processes)
    load_format: str = "auto"  # vLLM's; "dummy": random weights of the config's shapes
    kv_events: str | None = None  # a ZMQ endpoint vLLM publishes its KV events on ("tcp://*:N")


@dataclass
class Phase:
    """A batch of prompts (token ids) generated together, greedy."""

    prompts: list[list[int]]
    max_tokens: int = 8
    name: str = ""
    repeat: int = 1  # run the batch this many times; results of the last run are kept
    stepwise: bool = False  # step the engine to time each request's first token
    reset_prefix_cache: bool = False  # empty vLLM's own prefix cache first (not a connector's)
    # Return the logprobs of each prompt's last `logprob_tail` tokens given the ones before
    # (a held-out continuation's perplexity after a loaded prefix). Only tokens the engine
    # computes have them: vLLM leaves the rows of cached and loaded tokens uninitialised.
    logprob_tail: int = 0
    ignore_eos: bool = True  # False: a request ends at its end-of-sequence token (real models)
    # Wait for the ucm worker's stores (and session hints' prefetches) before answering, so
    # that the next phase's lookups see them (requests replayed one at a time in a
    # simulator's order).
    wait_stores: bool = False
    # Each prompt's `kv_transfer_params` (None: none), e.g. a ucm session hint.
    hints: list[Any] | None = None
    # Also return each ucm tier's blocks loaded in the phase (`tier_loads`, the kernel's
    # `load_hits.<tier>` read around it; with wait_stores, so no store is still in flight).
    tier_loads: bool = False


def kv_transfer_config(spec: EngineSpec) -> Any:
    from vllm.config import KVTransferConfig

    if spec.connector is None:
        return None
    if spec.connector == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config=dict(spec.extra))
    if spec.connector == "null":  # the connector path with no connector work (baseline)
        return KVTransferConfig(kv_connector="NullConnector",
                                kv_connector_module_path="ucm.bench.null_connector",
                                kv_role="kv_both")
    if spec.connector == "ucm":
        extra = dict(spec.extra)
        if spec.ucm is not None:
            extra["ucm"] = spec.ucm
        return KVTransferConfig(kv_connector="UCMConnector",
                                kv_connector_module_path="ucm.vllm_hook", kv_role="kv_both",
                                kv_connector_extra_config=extra)
    if spec.connector == "lmcache":  # LMCache's multi-process mode: ucm.bench.lmcache_server
        return KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                                kv_connector_extra_config=dict(spec.extra))
    raise ValueError(f"unknown connector {spec.connector!r}")


def make_engine(spec: EngineSpec) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not spec.multiprocess:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if spec.chunked_prefill_tokens:
        kwargs["max_num_batched_tokens"] = spec.chunked_prefill_tokens
        kwargs["enable_chunked_prefill"] = True
    else:
        kwargs["max_num_batched_tokens"] = max(spec.max_model_len, 2048)
    if spec.connector == "lmcache":
        # Said explicitly, vLLM does not import the connector (lmcache, numba, llvmlite) while
        # it builds its config, before the CPU worker's Triton override scan, which fails on
        # llvmlite's module objects in vLLM 0.32.0.
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if spec.kv_events:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True,
                                                    publisher="zmq", endpoint=spec.kv_events)
    return LLM(model=spec.model, dtype=spec.dtype, max_model_len=spec.max_model_len,
               enforce_eager=True, block_size=spec.block_size, seed=0,
               kv_cache_memory_bytes=spec.kv_cache_bytes,
               enable_prefix_caching=spec.prefix_caching,
               kv_transfer_config=kv_transfer_config(spec),
               max_num_seqs=spec.max_num_seqs,
               tensor_parallel_size=spec.tensor_parallel_size,
               distributed_executor_backend=None if spec.multiprocess else "uni",
               load_format=spec.load_format,
               disable_log_stats=False, **kwargs)


def run_phase(llm: Any, phase: Phase) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra: dict[str, Any] = {}
    if phase.logprob_tail:  # vLLM skips every cache for such requests unless told not to,
        # and detokenizes every row, the uninitialised ones of loaded tokens included.
        extra = {"prompt_logprobs": 0, "skip_reading_prefix_cache": False, "detokenize": False}
    params: Any = SamplingParams(temperature=0.0, max_tokens=phase.max_tokens,
                                 ignore_eos=phase.ignore_eos, **extra)
    if phase.hints is not None:
        if phase.stepwise or len(phase.hints) != len(phase.prompts):
            raise ValueError(f"phase {phase.name}: hints need one per prompt, not stepwise")
        params = [SamplingParams(temperature=0.0, max_tokens=phase.max_tokens,
                                 ignore_eos=phase.ignore_eos, **extra,
                                 extra_args=None if h is None else {"kv_transfer_params": h})
                  for h in phase.hints]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in phase.prompts]
    walls, ttft = [], []
    steps: list[dict[str, Any]] = []
    outs: list[Any] = []
    if phase.reset_prefix_cache and not _reset_prefix_cache(llm):
        raise RuntimeError(f"phase {phase.name}: vLLM did not reset its prefix cache")
    before = _worker_counters()
    loads_before = _tier_loads() if phase.tier_loads else {}
    for _ in range(phase.repeat):
        t0 = time.perf_counter()
        if phase.stepwise:
            outs, ttft, steps = _stepwise(llm, prompts, params)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
    if phase.wait_stores and not _wait_stores():
        raise RuntimeError(f"phase {phase.name}: the ucm worker's stores did not finish")
    result = {
        "name": phase.name,
        "wall_s": walls,
        "ttft_s": ttft,
        "steps": steps,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
        "prompt_tokens": [len(p) for p in phase.prompts],
        "worker_delta": {k: v - before.get(k, 0) for k, v in _worker_counters().items()},
    }
    if phase.tier_loads:
        result["tier_loads"] = {k: v - loads_before.get(k, 0) for k, v in _tier_loads().items()}
    if phase.logprob_tail:
        result["tail_logprobs"] = [_tail_logprobs(p, o, phase.logprob_tail)
                                   for p, o in zip(phase.prompts, outs, strict=True)]
    return result


def _reset_prefix_cache(llm: Any, timeout: float = 60.0) -> bool:
    """Empties vLLM's prefix cache. vLLM refuses while a connector still holds the blocks of
    finished requests (LMCache's stores in flight), and frees them only in engine steps, which
    run with no request in the engine while such requests wait: so it steps until then."""
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()
        time.sleep(0.005)
    return True


def _tail_logprobs(prompt: list[int], out: Any, tail: int) -> list[float]:
    """The logprob of each of the prompt's last `tail` tokens given the ones before it."""
    entries = out.prompt_logprobs  # one per prompt token; the first is None
    if entries is None or len(entries) != len(prompt) or tail >= len(prompt):
        raise RuntimeError(f"vLLM returned {len(entries or [])} prompt logprobs for a "
                           f"{len(prompt)}-token prompt")
    found = []
    for pos in range(len(prompt) - tail, len(prompt)):
        entry = entries[pos]
        if entry is None or prompt[pos] not in entry:
            raise RuntimeError(f"no logprob for prompt token {pos}")
        found.append(float(entry[prompt[pos]].logprob))
    return found


def _wait_stores(timeout: float = 120.0) -> bool:
    """Waits for the stores the ucm worker posted, then for its session ops' kernel work (a
    prefetch hint's copies); False if they did not finish in time."""
    try:
        from ucm.vllm_hook.connector import live_connectors
    except ImportError:
        return True
    return all(conn.worker.wait_for_stores(timeout) and conn.worker.wait_for_sessions(timeout)
               for conn in live_connectors() if conn.worker is not None)


def _worker_counters() -> dict[str, int]:
    """The ucm worker's own counters (no kernel snapshot: cheap, and safe mid-run)."""
    try:
        from ucm.vllm_hook.connector import live_connectors
    except ImportError:
        return {}
    for conn in live_connectors():
        if conn.worker is not None:
            return dict(conn.worker.stats)
    return {}


def _tier_loads() -> dict[str, int]:
    """The ucm worker's kernel's blocks loaded from each tier so far, by tier name."""
    from ucm.vllm_hook.connector import live_connectors

    for conn in live_connectors():
        if conn.worker is not None:
            stats = conn.worker.kernel.statistics()
            return {k[len("load_hits."):]: int(v) for k, v in stats.items()
                    if k.startswith("load_hits.")}
    return {}


def _scheduler_counters() -> dict[str, int]:
    """The ucm scheduler side's own counters (where it runs in this process)."""
    try:
        from ucm.vllm_hook.connector import live_connectors
    except ImportError:
        return {}
    for conn in live_connectors():
        if conn.scheduler is not None:
            return {k: v for k, v in conn.scheduler.stats.items() if isinstance(v, int)}
    return {}


def _stepwise(llm: Any, prompts: list[Any], params: Any,
              ) -> tuple[list[Any], list[float], list[dict[str, Any]]]:
    """Submits every prompt at once and records when each one's first token appears, and
    what each engine step did (`_StepLog`): where a request's time to first token went."""
    engine = llm.llm_engine
    steps = _StepLog(llm)
    t0 = time.perf_counter()
    ids = []
    for i, prompt in enumerate(prompts):
        rid = f"r{time.monotonic_ns()}-{i}"
        steps.name(engine.add_request(rid, prompt, params), i)
        ids.append(rid)
    first: dict[str, float] = {}
    done: dict[str, Any] = {}
    try:
        while len(done) < len(ids):
            steps.begin(time.perf_counter() - t0)
            outs = engine.step()
            steps.end(time.perf_counter() - t0)
            for out in outs:
                if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                    first[out.request_id] = time.perf_counter() - t0
                if out.finished:
                    done[out.request_id] = out
    finally:
        steps.close()
    return [done[r] for r in ids], [first.get(r, 0.0) for r in ids], steps.records


class _StepLog:
    """Per engine step: when it began and ended (s from the phase's submission), the prompt
    tokens it scheduled per request (by index in the phase), the tokens each newly scheduled
    request already had (vLLM's own cache plus a connector's hit), and the ucm worker's load
    and save times and the ucm scheduler's time (lookups, the step's plan) and deferred
    lookups over the step. Reads vLLM's scheduler output where the scheduler runs in this
    process (the engine runner's default); records times only otherwise."""

    _LOADS = ("load_wait_ns", "load_ns", "loaded_blocks", "save_ns")
    _SCHEDULER = ("schedule_ns", "lookup_deferred")

    def __init__(self, llm: Any) -> None:
        self.records: list[dict[str, Any]] = []
        self._index: dict[str, int] = {}
        self._planned: list[Any] = []
        self._before: dict[str, int] = {}
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)
        self._scheduler = getattr(core, "scheduler", None)
        if self._scheduler is not None:
            inner = self._scheduler.schedule

            def schedule(*args: Any, **kwargs: Any) -> Any:
                out = inner(*args, **kwargs)
                self._planned.append(out)
                return out

            self._scheduler.schedule = schedule

    def name(self, internal_id: str, index: int) -> None:
        self._index[internal_id] = index

    def begin(self, t: float) -> None:
        self._planned.clear()
        self._t = t
        self._before = self._counters()

    def _counters(self) -> dict[str, int]:
        worker, scheduler = _worker_counters(), _scheduler_counters()
        return {**{k: worker.get(k, 0) for k in self._LOADS},
                **{k: scheduler.get(k, 0) for k in self._SCHEDULER}}

    def end(self, t: float) -> None:
        counters = self._counters()
        rec: dict[str, Any] = {"t0": self._t, "t1": t, "tokens": {}, "had": {}}
        rec.update({k: counters[k] - self._before[k] for k in counters})
        for out in self._planned:
            for rid, n in out.num_scheduled_tokens.items():
                if rid in self._index:
                    rec["tokens"][self._index[rid]] = int(n)
            for new in out.scheduled_new_reqs:
                if new.req_id in self._index:
                    rec["had"][self._index[new.req_id]] = int(new.num_computed_tokens)
        self.records.append(rec)

    def close(self) -> None:
        if self._scheduler is not None:
            del self._scheduler.schedule  # back to the class's method


def connector_stats(wait: float = 120.0) -> dict[str, Any]:
    """Waits for the ucm worker's stores, then returns both sides' counters."""
    try:
        from ucm.vllm_hook.connector import live_connectors
    except ImportError:
        return {}
    stats: dict[str, Any] = {}
    for conn in live_connectors():
        if conn.worker is not None:
            conn.worker.wait_for_stores(wait)
            stats["worker"] = conn.statistics()
        else:
            stats["scheduler"] = conn.statistics()
    return stats


def run(spec: EngineSpec, phases: list[Phase]) -> dict[str, Any]:
    """Runs the phases on a new engine in this process."""
    engine = _Engine(spec)
    results = [engine.run(p) for p in phases]
    return {**engine.finish(), "phases": results}


class _Engine:
    """An engine in this process that runs phases as they come, then reports its counters."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        t0 = time.perf_counter()
        _progress("starting the engine")
        self.llm = make_engine(spec)
        self.start_s = time.perf_counter() - t0
        _progress(f"engine started in {self.start_s:.1f} s")

    def run(self, phase: Phase) -> dict[str, Any]:
        result = run_phase(self.llm, phase)
        _progress(f"{phase.name or 'phase'}: {len(phase.prompts)} requests in "
                  f"{result['wall_s'][-1]:.2f} s")
        return result

    def finish(self) -> dict[str, Any]:
        out = {"engine_start_s": self.start_s, "stats": connector_stats(),
               "preemptions": _preemptions(self.llm), "allocator": engine_allocator()}
        if self.spec.multiprocess:  # connectors live in the worker processes: their shutdown
            self.llm.llm_engine.engine_core.shutdown()  # waits for the stores in flight
        return out


def _preemptions(llm: Any) -> int | None:
    try:
        for metric in llm.get_metrics():
            if metric.name == "vllm:num_preemptions":
                return int(metric.value)
    except Exception:
        return None
    return None


def engine_allocator() -> str:
    """The allocator this process runs on, from the libraries mapped into it."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return next((name for name in _ALLOCATORS if f"lib{name}" in maps), "glibc")


def run_in_subprocess(spec: EngineSpec, phases: list[Phase], *, timeout: float = 900,
                      env: dict[str, str] | None = None, log_path: str | None = None,
                      progress: Callable[[str], None] | None = None,
                      python: str | None = None) -> dict[str, Any]:
    """Runs `run(spec, phases)` in a fresh Python process and returns its result. `progress`
    gets the child's progress lines as they come; `python`, another venv's interpreter (one
    with ucm installed), runs it instead of this one."""
    with EngineProcess(spec, timeout=timeout, env=env, log_path=log_path,
                       progress=progress, python=python) as engine:
        results = [engine.run(p) for p in phases]
        return {**engine.finish(), "phases": results}


class EngineProcess:
    """An engine in a fresh Python process that takes phases one at a time, so what a phase
    asks can depend on what the last one answered (a chat's next turn carries the answers):

        with EngineProcess(spec, log_path=log) as engine:
            first = engine.run(Phase(prompts))     # run_phase's result
            ...
            stats = engine.finish()                # engine_start_s, stats, preemptions, ...

    `timeout` bounds the process's whole life; `progress` gets its progress lines; `wrap`
    prefixes its command line (`["ip", "netns", "exec", NS]`: an engine on another "host");
    `python` is the interpreter (default: this one)."""

    def __init__(self, spec: EngineSpec, *, timeout: float = 900,
                 env: dict[str, str] | None = None, log_path: str | None = None,
                 progress: Callable[[str], None] | None = None,
                 wrap: list[str] | None = None, python: str | None = None) -> None:
        self.spec = spec
        self._wrap = list(wrap or [])
        self._python = python or sys.executable
        self._timeout = timeout
        self._env = {**engine_env(os.environ, tcmalloc=find_tcmalloc()), **(env or {})}
        self._log_path = log_path
        self._progress = progress
        self._proc: subprocess.Popen | WarmChild | None = None
        self._timer: threading.Timer | None = None

    def __enter__(self) -> EngineProcess:
        self._log = open(self._log_path, "a") if self._log_path else open(os.devnull, "w")
        warm = None if self._python != sys.executable else warm_starts(self._env, self._wrap)
        if warm is not None:
            try:
                self._proc = warm.spawn(self._env, self._log.fileno())
            except WarmEnded:  # its namespace went, say: a fresh process, and a new one next
                warm = None
        if warm is None:
            # Its own session: vLLM's multiprocess mode leaves EngineCore and worker processes
            # that keep our pipe open, so once the result is in, the whole group is killed.
            self._proc = subprocess.Popen([*self._wrap, self._python, "-m", "ucm.bench.engines"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._log, text=True, env=self._env,
                                          start_new_session=True)
        self._timer = threading.Timer(self._timeout, _kill_group, (self._proc,))
        self._timer.start()
        self._send({"spec": asdict(self.spec)})
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._proc is not None and self._timer is not None
        self._timer.cancel()
        _kill_group(self._proc)
        with self._log:
            self._proc.__exit__(*exc)

    def run(self, phase: Phase) -> dict[str, Any]:
        self._send({"phase": asdict(phase)})
        return self._answer("UCM_PHASE ")

    def finish(self) -> dict[str, Any]:
        """Ends the engine (its stores waited for) and returns its counters."""
        self._send({"finish": True})
        out = self._answer("UCM_RESULT ")
        assert self._proc is not None
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        return out

    def kill(self) -> None:
        """SIGKILLs the engine and whatever vLLM started under it, as a host's crash would."""
        assert self._proc is not None
        _kill_group(self._proc)
        self._proc.wait()

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._failed()

    def _answer(self, tag: str) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(tag):
                return dict(json.loads(line[len(tag):]))
            if line.startswith("UCM_PROGRESS "):
                if self._progress is not None:
                    self._progress(line[len("UCM_PROGRESS "):].rstrip())
            else:
                self._log.write(line)
        self._failed()

    def _failed(self) -> NoReturn:
        assert self._proc is not None
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.flush()
        tail = ""
        if self._log_path:
            with open(self._log_path) as f:
                tail = f.read()[-4000:]
        raise RuntimeError(f"engine process failed (rc={self._proc.returncode}):\n{tail}")


def _kill_group(proc: subprocess.Popen | WarmChild) -> None:
    """Kills the engine process and whatever vLLM started under it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _progress(message: str) -> None:
    sys.stdout.write(f"UCM_PROGRESS {message}\n")
    sys.stdout.flush()


def _reply(tag: str, body: dict[str, Any]) -> None:
    sys.stdout.write(f"{tag} " + json.dumps(body, default=str) + "\n")
    sys.stdout.flush()


def _main() -> None:
    """The engine process: a spec line, then phase lines, each answered, then a finish line."""
    engine = _Engine(EngineSpec(**json.loads(sys.stdin.readline())["spec"]))
    for line in sys.stdin:
        message = json.loads(line)
        if "phase" in message:
            _reply("UCM_PHASE", engine.run(Phase(**message["phase"])))
        elif message.get("finish"):
            _reply("UCM_RESULT", engine.finish())
            break
    os._exit(0)  # skip interpreter teardown of vLLM's threads; stores were waited for


if __name__ == "__main__":
    _main()
