"""`ucm demo`: the KV cache of a chat service, stored by one vLLM engine and reused by the next.

It replays a chat workload through vLLM on the CPU with the ucm connector on the embedded
default config (a memory tier over ~/.cache/ucm): sessions that each discuss one of a few shared
real English documents (license texts and READMEs of installed packages), several turns each,
every turn's prompt carrying the conversation so far, built with the model's chat template.
The model is SmolLM2-135M-Instruct (`ucm.bench.smollm2`, built once and cached), or a small
random Llama with `--model random` (faster; its answers are noise). The engines compute in
the dtype this CPU computes natively (`ucm.bench.engines.native_dtype`: bf16 with avx512_bf16
or AMX, fp32 otherwise); `--dtype` overrides it.

    round 1  cold: a fresh engine process, empty store; the model answers each turn, the
             turns compute and store their KV
    round 2  warm: another fresh engine process replays the same conversation (the cold
             round's answers are part of the later turns' prompts); its KV loads from ucm

Per turn it prints prefill tokens computed vs loaded, the hit rate, TTFT p50/p90 and bytes
moved; where a warm turn's time to first token goes (queueing behind the batch's other
requests, waiting for ucm's loads, computing the unhit tail); the same turn served by vLLM's own
prefix cache in the warm engine (the floor a connector can reach); and one answer from each
engine. vLLM's own prefix cache stays on (as in production); its hits are shown apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from ucm.bench.models import ModelSpec, build_model

RANDOM_SPEC = ModelSpec(layers=8, hidden=512, heads=8, kv_heads=4, vocab=2048,
                        max_positions=8192)
DTYPES = ("bfloat16", "float16", "float32")
BLOCK = 32
SYSTEM = ("You are a helpful assistant. Answer the user's questions about the document below "
          "in one or two sentences.\n\nDocument:\n")
# Sessions on one document ask different questions at each turn (columns: turns).
QUESTIONS = (
    "What is this document about?",
    "Who is this document written for?",
    "What does it allow a reader to do?",
    "Which conditions or limits does it state?",
    "Name one thing the document asks the reader to keep or include.",
    "Summarize the document for a newcomer in one sentence.",
    "What would you ask its authors?",
    "Is anything in it surprising?",
)


def _say(msg: str) -> None:
    print(f"[ucm demo] {msg}", flush=True)


# -- the workload ----------------------------------------------------------------------------------
@dataclass
class Conversation:
    """One chat session: its document, its questions, and the answers so far."""

    doc: int
    system: str
    questions: list[str]
    answers: list[str] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict[str, str]]:
        """The chat up to turn `turn`'s question (0-based), answers of the earlier turns."""
        out = [{"role": "system", "content": self.system}]
        for t in range(turn + 1):
            out.append({"role": "user", "content": self.questions[t]})
            if t < turn:
                out.append({"role": "assistant", "content": self.answers[t]})
        return out


def pick_documents(tokenizer: Any, n: int, tokens: int) -> list[tuple[str, str]]:
    """`n` distinct real documents (licenses first: plain prose), each cut at a line end to
    about `tokens` tokens of `tokenizer`."""
    from ucm.bench.texts import documents

    found = documents(min_chars=4 * tokens)
    # The same license ships with many packages; one copy each (by its opening words).
    ordered = sorted(found, key=lambda d: "LICEN" not in d[0].upper())
    out: list[tuple[str, str]] = []
    openings: set[str] = set()
    for label, text in ordered:
        opening = " ".join(text.split()[:6]).lower()
        if opening in openings:
            continue
        openings.add(opening)
        # (a token is rarely over 8 characters: no need to tokenize the whole text)
        ids = tokenizer(text[:8 * tokens], add_special_tokens=False)["input_ids"][:tokens]
        cut = tokenizer.decode(ids)
        cut = cut[:cut.rfind("\n")].rstrip() if "\n" in cut else cut
        out.append((label, cut))
        if len(out) == n:
            return out
    raise RuntimeError(f"found {len(out)} documents of {4 * tokens}+ characters among the "
                       f"installed packages; the demo needs {n} (fewer --docs or --doc-tokens)")


def conversations(docs: list[tuple[str, str]], *, sessions: int, turns: int,
                  ) -> list[Conversation]:
    """`sessions` chats over `docs` (session s discusses document s mod len(docs))."""
    if turns > len(QUESTIONS):
        raise ValueError(f"at most {len(QUESTIONS)} turns (one question each)")
    out = []
    per_doc = -(-sessions // len(docs))
    for s in range(sessions):
        d, k = s % len(docs), s // len(docs)
        questions = [QUESTIONS[(k + t * per_doc) % len(QUESTIONS)] for t in range(turns)]
        out.append(Conversation(d, SYSTEM + docs[d][1], questions))
    return out


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat up to the assistant's turn, in the model's own chat template (a
    plain 'Role: text' layout for a tokenizer without one, as the random model's)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
        text += "Assistant:"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# -- what a turn's steps say about its time to first token -----------------------------------------
def ttft_parts(phase: dict[str, Any]) -> list[dict[str, float]]:
    """Per request of a stepwise phase, its TTFT split over the engine steps up to its first
    token: `queued` (steps that did not schedule it: the batch's other prefills, vLLM's),
    `lookup` (steps that did not schedule it while ucm answered "ask again later" to a
    lookup: a request whose lookup was not in yet waits for the next step), `load` (the ucm
    load wait of the steps that did schedule it), `ucm` (the rest of ucm's time in those
    steps: the scheduler's lookups and plan, the worker's save snapshots and store
    submission) and `compute` (what is left of those steps: vLLM's input preparation, forward
    pass and sampling over every request scheduled with it), plus `steps`. The parts add up
    to the TTFT up to the time spent submitting."""
    out = []
    steps = phase["steps"]
    for i, ttft in enumerate(phase["ttft_s"]):
        parts = {"ttft": ttft, "queued": 0.0, "lookup": 0.0, "load": 0.0, "ucm": 0.0,
                 "compute": 0.0, "steps": 0, "start": steps[0]["t0"] if steps else 0.0}
        for step in steps:
            if step["t1"] > ttft + 1e-6:
                break
            wall = step["t1"] - step["t0"]
            parts["steps"] += 1
            if str(i) in step["tokens"]:
                load = min(wall, step["load_wait_ns"] / 1e9)
                ucm = min(wall - load, (step.get("save_ns", 0) + step.get("schedule_ns", 0))
                          / 1e9)
                parts["load"] += load
                parts["ucm"] += ucm
                parts["compute"] += wall - load - ucm
            elif step.get("lookup_deferred", 0):
                parts["lookup"] += wall
            else:
                parts["queued"] += wall
        out.append(parts)
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def turn_rows(result: dict[str, Any], bytes_per_token: int) -> list[dict[str, Any]]:
    """Per stepwise phase of an engine: token counts, TTFTs, bytes and the TTFT parts."""
    rows = []
    for phase in result["phases"]:
        if not phase["steps"]:
            continue
        delta = phase["worker_delta"]
        prompt = sum(phase["prompt_tokens"])
        loaded = delta.get("loaded_blocks", 0) * BLOCK
        cached = sum(phase["num_cached_tokens"])
        rows.append({
            "name": phase["name"], "requests": len(phase["prompt_tokens"]), "prompt": prompt,
            "lengths": phase["prompt_tokens"],
            "computed": prompt - cached, "loaded": loaded, "local": max(0, cached - loaded),
            "hit": cached / prompt if prompt else 0.0, "ttft": phase["ttft_s"],
            "moved": (delta.get("loaded_bytes", 0)
                      + delta.get("save_blocks", 0) * BLOCK * bytes_per_token),
            "load_s": delta.get("load_ns", 0) / 1e9,
            "load_wait_s": delta.get("load_wait_ns", 0) / 1e9,
            "parts": ttft_parts(phase), "tokens": phase["tokens"],
            "steps": len(phase["steps"]),
        })
    return rows


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    header = (f"{'turn':>5} {'reqs':>5} {'prompt tok':>11} {'computed':>9} {'ucm loaded':>11} "
              f"{'vLLM local':>11} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
              f"{'bytes moved':>12}")
    print(f"\n{title}\n{header}")
    for r in rows:
        print(f"{r['name']:>5} {r['requests']:>5} {r['prompt']:>11,} {r['computed']:>9,} "
              f"{r['loaded']:>11,} {r['local']:>11,} {r['hit']:>8.0%} "
              f"{_pct(r['ttft'], .5) * 1e3:>7.0f}ms {_pct(r['ttft'], .9) * 1e3:>7.0f}ms "
              f"{r['moved'] / 2**20:>9.1f} MiB")


def print_breakdown(cold: list[dict[str, Any]], warm: list[dict[str, Any]],
                    floor: list[dict[str, Any]]) -> None:
    """Where each warm turn's TTFT goes, next to the cold turn and vLLM's own hit: ucm's side
    (lookup steps, load wait, the rest of ucm's time in the request's steps) and vLLM's
    (queueing, compute), and the compute of vLLM's own hit beside the warm one's."""
    print("\nwhere a warm turn's time to first token goes (medians over the turn's requests; "
          "the turn's requests are submitted together, as the cold ones)")
    print(f"{'turn':>5} {'cold TTFT':>10} {'warm TTFT':>10} {'ratio':>6} {'queued':>7} "
          f"{'lookup':>7} {'ucm load':>9} {'ucm other':>10} {'compute':>8} {'steps':>6} "
          f"{'computed tok':>13} {'vLLM hit':>9} {'its compute':>12} {'ucm over it':>12}")
    keys = ("queued", "lookup", "load", "ucm", "compute", "steps")
    for c, w, f in zip(cold, warm, floor, strict=True):
        c50, w50, f50 = (statistics.median(r["ttft"]) for r in (c, w, f))
        med = {k: statistics.median(p[k] for p in w["parts"]) for k in keys}
        fcompute = statistics.median(p["compute"] for p in f["parts"])
        print(f"{w['name']:>5} {c50 * 1e3:>8.0f}ms {w50 * 1e3:>8.0f}ms {c50 / w50:>5.1f}x "
              f"{med['queued'] * 1e3:>5.0f}ms {med['lookup'] * 1e3:>5.0f}ms "
              f"{med['load'] * 1e3:>7.0f}ms {med['ucm'] * 1e3:>8.0f}ms "
              f"{med['compute'] * 1e3:>6.0f}ms {med['steps']:>6.0f} {w['computed']:>13,} "
              f"{f50 * 1e3:>7.0f}ms {fcompute * 1e3:>10.0f}ms {(w50 - f50) * 1e3:>+10.0f}ms")
    print("  queued: engine steps that ran before the request was scheduled (other requests' "
          "prefill, or decode steps of the batch: vLLM's scheduling, not ucm's)\n"
          "  lookup: steps that ran before it was scheduled while ucm's lookup was not in "
          "(ucm answered 'ask again later')\n"
          "  ucm load: the scheduled step's wait for its blocks (ucm; the load itself starts "
          "when the scheduler plans the step)\n"
          "  ucm other: ucm's other time in the request's steps (lookups and the step's plan "
          "in the scheduler, save snapshots and store submission in the worker)\n"
          "  compute: the rest of the request's steps: the forward pass over every request "
          "scheduled with it (vLLM's); steps: engine steps up to its first token\n"
          "  vLLM hit: the same turn again in the warm engine, served by vLLM's own prefix "
          "cache (same tokens computed, nothing loaded): the floor a connector can reach; "
          "its compute: that run's compute, beside the warm one's")


def print_samples(tokenizer: Any, convs: list[Conversation], cold: list[dict[str, Any]],
                  warm: list[dict[str, Any]], floor: list[dict[str, Any]], turn: int) -> None:
    """One session's answer at one turn from each engine, and whether they agree."""
    conv = convs[0]
    say = {name: tokenizer.decode(rows[turn]["tokens"][0], skip_special_tokens=True).strip()
           for name, rows in (("cold", cold), ("warm", warm), ("vllm", floor))}
    print(f"\nsession 1, turn {turn + 1}: \"{conv.questions[turn]}\"")
    print(f"  cold engine (computed):                {say['cold']!r}")
    print(f"  warm engine (prefix loaded from ucm):  {say['warm']!r}")
    print(f"  warm engine (vLLM's own prefix cache): {say['vllm']!r}")
    if say["cold"] == say["warm"]:
        print("  cold and warm answers are identical.")
        return
    same_as_vllm = "and so does" if say["warm"] == say["vllm"] else "as can"
    print(f"  the warm answer differs from the cold one, {same_as_vllm} vLLM's own prefix "
          "cache: with a cached prefix the new tokens attend over stored keys and values "
          "in a separate pass, a different order of floating-point sums than one prefill of "
          "the whole prompt, and greedy decoding follows the first token whose logits come "
          "out the other way. The stored bytes are the ones the cold engine computed.")


# -- the run -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ucm demo", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2",
                    help="smollm2 (SmolLM2-135M-Instruct), random (a random 8-layer Llama, "
                    "faster), or a checkpoint directory")
    ap.add_argument("--dtype", choices=DTYPES, default=None,
                    help="the engines' dtype (default: bfloat16 where the CPU has avx512_bf16 "
                    "or amx_bf16, else float32)")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--docs", type=int, default=2, help="shared documents")
    ap.add_argument("--doc-tokens", type=int, default=1500, help="tokens per document")
    ap.add_argument("--answer-tokens", type=int, default=40,
                    help="longest answer (a real model stops at its end of turn)")
    ap.add_argument("--config", default=None,
                    help="a ucm config file (YAML or JSON) instead of the embedded default")
    ap.add_argument("--workdir", default=None, help="where a random model is built (tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the stored blocks afterwards")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    out = run(args)
    cold_rows, warm_rows, floor_rows = out["cold"], out["warm"], out["floor"]
    print_table("== cold round ==", cold_rows)
    print_table("== warm round ==", warm_rows)
    print_breakdown(cold_rows, warm_rows, floor_rows)
    print_samples(out["tokenizer"], out["conversations"], cold_rows, warm_rows, floor_rows, 0)
    computed = {n: sum(r["computed"] for r in rows)
                for n, rows in (("cold", cold_rows), ("warm", warm_rows))}
    c1, w1 = (statistics.median(rows[0]["ttft"]) for rows in (cold_rows, warm_rows))
    print(f"\nprefill tokens computed: cold {computed['cold']:,} -> warm {computed['warm']:,} "
          f"({sum(r['loaded'] for r in warm_rows):,} loaded from ucm; vLLM's own cache served "
          f"the repeats inside each engine); turn-1 TTFT p50 {_ms(c1)} -> {_ms(w1)} "
          f"({c1 / w1:.1f}x)")
    worker = out["warm_stats"].get("worker", {})
    kernel = worker.get("kernel", {})
    tiers = ", ".join(f"{k.split('.', 1)[1]} {v}" for k, v in sorted(kernel.items())
                      if k.startswith("load_hits.") and v)
    print(f"warm engine's ucm: {worker.get('loaded_blocks', 0):,} blocks loaded "
          f"({tiers or 'none'}), {worker.get('load_error_blocks', 0):,} failed and recomputed, "
          f"{kernel.get('promoted', 0):,} promoted to a faster tier (connector option "
          f"promote_loads), {worker.get('early_loads', 0):,} loads started early")
    ns = out["namespace"]
    store = out["store"]
    print(f"store: {store} (namespace {ns})")
    print(f"event trace: {out['trace']} (read it with: ucm-trace summary {out['trace']})")
    print(f"engine logs: {out['log']}; total {time.perf_counter() - t0:.0f} s in {out['dtype']}")
    if not args.keep and ns and not args.config:
        from ucm.drivers.kit import safe_dir_name

        shutil.rmtree(store / safe_dir_name(ns), ignore_errors=True)
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both rounds; per-turn rows (`turn_rows`) of the cold and warm rounds and of vLLM's own
    hits in the warm engine, the conversations, the tokenizer, and where things are."""
    from transformers import AutoTokenizer

    from ucm.bench.engines import EngineProcess, EngineSpec, Phase, native_dtype
    from ucm.config import default_cache_dir

    work = args.workdir or tempfile.mkdtemp(prefix="ucm-demo-")
    if args.dtype:
        dtype, why = args.dtype, "chosen with --dtype"
    else:
        dtype, why = native_dtype()
    _say(f"dtype {dtype}: {why}")
    if args.model == "random":
        _say(f"building a random {RANDOM_SPEC.layers}-layer Llama and a tokenizer in {work}")
        built = dataclasses.replace(RANDOM_SPEC, dtype=dtype)
        model = str(build_model(os.path.join(work, "model"), built))
        bpt, real = built.kv_bytes_per_token(), False
    else:
        if args.model == "smollm2":
            from ucm.bench.smollm2 import build_smollm2

            _say("SmolLM2-135M-Instruct (a bf16 checkpoint), built once into ~/.cache/ucm-models")
            model = str(build_smollm2())
        else:
            model = args.model
        real = True
        bpt = _kv_bytes_per_token(model, 4 if dtype == "float32" else 2)
    tokenizer = AutoTokenizer.from_pretrained(model)
    docs = pick_documents(tokenizer, args.docs + 1, args.doc_tokens)
    warm_doc, docs = docs[-1], docs[:-1]
    convs = conversations(docs, sessions=args.sessions, turns=args.turns)
    _say("documents: " + "; ".join(f"{label} ({len(tokenizer(t)['input_ids']):,} tokens)"
                                   for label, t in docs))
    # Both engines first serve the same batch shape over another document, twice (the second
    # time from vLLM's own cache): a fresh engine's first batch of a shape pays one-off costs
    # (kernel set-up, first touch of cache pages) that would otherwise land on turn 1
    # (docs/performance.md, ucm demo).
    # The warm-up carries a whole document, as turn 1 does (the same lengths, so the same
    # kernel shapes and as many cache blocks touched; in the warm engine its blocks load
    # from ucm, as turn 1's do); sessions share documents as the turns' do.
    spare = Conversation(0, SYSTEM + warm_doc[1], [QUESTIONS[0]])
    warmup_prompts = [chat_prompt(tokenizer, spare.messages(0)) for _ in convs]
    warmups = [Phase(warmup_prompts, max_tokens=2, name=f"warmup{i}") for i in (1, 2)]

    def turn_phase(t: int, prompts: list[list[int]], max_tokens: int, name: str) -> Any:
        return Phase(prompts, max_tokens=max_tokens, name=name, stepwise=True,
                     ignore_eos=not real)

    config_file = {}
    if args.config:  # checked here, so a bad file fails before any engine starts
        from ucm.config import load_config

        load_config(args.config)
        config_file = {"ucm_config_file": os.path.abspath(args.config)}
    run_id = f"demo{os.getpid()}x{int(time.time())}"  # an earlier demo's blocks stay apart
    spec = EngineSpec(model=model, dtype=dtype, block_size=BLOCK, max_model_len=8192,
                      kv_cache_bytes=512 * 2**20, connector="ucm",
                      extra={"model_id": run_id, **config_file}, prefix_caching=True,
                      chunked_prefill_tokens=4096, max_num_seqs=max(16, args.sessions))
    log = os.path.join(work, "engines.log")
    # Both engines record the kernel's event trace (UCM_TRACE), one file set per process.
    trace_dir = os.environ.get("UCM_TRACE") or str(default_cache_dir() / "traces" / run_id)
    env = {"UCM_TRACE": trace_dir}

    _say("round 1: cold engine (fresh process, empty store): starting")
    prompts: list[list[list[int]]] = []
    cold: dict[str, Any] = {"phases": []}
    with EngineProcess(spec, log_path=log, env=env,
                       progress=lambda m: _say(f"  cold: {m}")) as engine:
        for p in warmups:
            engine.run(p)
        for t in range(args.turns):
            batch = [chat_prompt(tokenizer, c.messages(t)) for c in convs]
            _say(f"  cold: turn {t + 1}: {len(batch)} requests, "
                 f"{sum(map(len, batch)):,} prompt tokens")
            result = engine.run(turn_phase(t, batch, args.answer_tokens, str(t + 1)))
            cold["phases"].append(result)
            prompts.append(batch)
            for c, ids in zip(convs, result["tokens"], strict=True):
                c.answers.append(tokenizer.decode(ids, skip_special_tokens=True).strip())
        cold.update(engine.finish())

    _say("round 2: warm engine (fresh process, same store) replays the conversation: starting")
    warm: dict[str, Any] = {"phases": []}
    with EngineProcess(spec, log_path=log, env=env,
                       progress=lambda m: _say(f"  warm: {m}")) as engine:
        for p in warmups:
            engine.run(p)
        for t, batch in enumerate(prompts):
            warm["phases"].append(engine.run(turn_phase(t, batch, args.answer_tokens,
                                                        str(t + 1))))
        # The same turns again: vLLM's own prefix cache now holds them (the floor).
        floor_phases = [engine.run(turn_phase(t, batch, args.answer_tokens, str(t + 1)))
                        for t, batch in enumerate(prompts)]
        warm.update(engine.finish())

    return {"cold": turn_rows(cold, bpt), "warm": turn_rows(warm, bpt),
            "floor": turn_rows({"phases": floor_phases}, bpt), "conversations": convs,
            "tokenizer": tokenizer, "warm_stats": warm["stats"], "dtype": dtype,
            "namespace": warm["stats"].get("worker", {}).get("namespace"),
            "store": default_cache_dir() / "blocks", "trace": trace_dir, "log": log}


def _kv_bytes_per_token(model: str, elem: int) -> int:
    import json

    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv * head * elem


if __name__ == "__main__":
    sys.exit(main())
