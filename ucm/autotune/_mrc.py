"""Miss-ratio curves read three ways, and the two questions they answer.

- From requests (a trace file, a ucm trace directory): the kernel's own estimator
  (`ucm.kernel._mrc.MissRatioCurve`, miniature caches over a spatial sample) fed every block
  of every request in order, or the exact curve (`exact_curve`: the simulator replayed at
  each capacity, prefix semantics).
- From a running server's `/metrics`: the `ucm_mrc_*` series (`parse_metrics`).

A curve is [(capacity in blocks, hit ratio), ...], capacities ascending. `capacity_for`
answers "the capacity needed for hit ratio X", `hit_at` "the hit ratio at capacity C", both
interpolated linearly between the curve's points and never extrapolated.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from ucm.autotune._simulate import SimTier, simulate
from ucm.autotune._traces import Request
from ucm.kernel._mrc import MissRatioCurve, uniform_key
from ucm.kernel._policy import POLICIES

Curve = list[tuple[float, float]]
DEFAULT_CAPACITIES = (250, 500, 1000, 2000, 4000, 8000, 16000, 32000, 64000)


@dataclass
class CurveReport:
    """One tier's curve and what it was computed from."""

    policy: str
    block_bytes: int | None
    curve: Curve  # capacity in blocks, hit ratio
    source: str
    rate: float | None = None  # the sampling rate, where sampled
    tier: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "block_bytes": self.block_bytes,
                "curve": [[int(c) if c == int(c) else c, round(h, 6)] for c, h in self.curve]}


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose {', '.join(POLICIES)}")
    return policy


def sampled_curve(requests: Sequence[Request], policy: str, capacities: Sequence[int], *,
                  rate: float = 0.1, max_keys: int = 16384, min_blocks: int = 1000,
                  seed: int = 0) -> tuple[Curve, MissRatioCurve]:
    """The kernel's estimator over every block of every request, capacities in blocks. A
    trace's keys are hashed first (`uniform_key`: block numbers are not hashes); each `seed`
    draws another sample."""
    mrc = MissRatioCurve(check_policy(policy), capacities, rate=rate, max_keys=max_keys,
                         min_blocks=min_blocks)
    hashed: dict[bytes, bytes] = {}
    access = mrc.access_many
    for request in requests:
        keys = []
        for key in request.blocks:
            h = hashed.get(key)
            if h is None:
                h = hashed[key] = uniform_key(key, seed)
            keys.append(h)
        access(keys)
    return [(float(c), h) for c, h in mrc.curve()], mrc


def exact_curve(requests: Sequence[Request], policy: str, capacities: Sequence[int]) -> Curve:
    """The simulator's curve: one tier of `policy` replayed at each capacity."""
    check_policy(policy)
    return [(float(c), simulate(requests, [SimTier(policy, c)]).hit_ratio)
            for c in sorted(set(capacities))]


def hit_at(curve: Curve, capacity: float) -> float | None:
    """The hit ratio at `capacity`, interpolated; None outside the curve's capacities."""
    if not curve or capacity < curve[0][0] or capacity > curve[-1][0]:
        return None
    for (c0, h0), (c1, h1) in pairwise(curve):
        if c0 <= capacity <= c1:
            return h0 if c1 == c0 else h0 + (h1 - h0) * (capacity - c0) / (c1 - c0)
    return curve[-1][1]


def capacity_for(curve: Curve, target: float) -> float | None:
    """The least capacity whose hit ratio reaches `target`, interpolated between the first
    point below and the first at or above it; None when no point reaches it."""
    below: tuple[float, float] | None = None
    for c, h in curve:
        if h >= target:
            if below is None or h == below[1]:
                return c
            c0, h0 = below
            return c0 + (c - c0) * (target - h0) / (h - h0)
        below = (c, h)
    return None


def _size(blocks: float, block_bytes: int | None) -> str:
    text = f"{blocks:,.0f} blocks"
    if block_bytes:
        n = blocks * block_bytes
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if n < 1024 or unit == "TiB":
                return f"{text} ({n:,.1f} {unit})"
            n /= 1024
    return text


def render(report: CurveReport, *, targets: Sequence[float] = (),
           at: Sequence[float] = ()) -> str:
    """The curve as a table, then the answers asked for."""
    head = f"{report.tier + ': ' if report.tier else ''}{report.policy}, {report.source}"
    if report.rate is not None:
        head += f", sampling rate {report.rate:.4g}"
    lines = [head, "capacity | hit ratio", "---:|---:"]
    lines += [f"{_size(c, report.block_bytes)} | {h:.4f}" for c, h in report.curve]
    for target in targets:
        cap = capacity_for(report.curve, target)
        answer = (_size(cap, report.block_bytes) if cap is not None
                  else f"more than {_size(report.curve[-1][0], report.block_bytes)} "
                  "(the largest capacity measured)")
        lines.append(f"capacity for hit ratio {target:g}: {answer}")
    for capacity in at:
        ratio = hit_at(report.curve, capacity)
        lines.append(f"hit ratio at {_size(capacity, report.block_bytes)}: " + (
            f"{ratio:.4f}" if ratio is not None else
            f"outside the measured capacities ({report.curve[0][0]:,.0f}-"
            f"{report.curve[-1][0]:,.0f} blocks)"))
    return "\n".join(lines)


def write_json(path: str | os.PathLike[str], reports: Sequence[CurveReport]) -> None:
    """One report as {"policy", "block_bytes", "curve"}; several (tiers) as a list of them
    with their tier names. Written whole to a temporary file, then renamed."""
    data: Any = (reports[0].as_json() if len(reports) == 1 else
                 [{"tier": r.tier, **r.as_json()} for r in reports])
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


def parse_metrics(text: str, source: str) -> list[CurveReport]:
    """The `ucm_mrc_*` series of a Prometheus text exposition, one report per tier (curves
    summed over other labels' series are not merged: the first series of a tier wins).
    ValueError naming `source` when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    points: dict[str, dict[float, float]] = {}
    policies: dict[str, str] = {}
    block_bytes: dict[str, float] = {}
    rates: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ValueError(f"{source}: not a Prometheus text exposition ({exc})") from exc
    for family in families:
        for sample in family.samples:
            tier = sample.labels.get("tier")
            if tier is None:
                continue
            if sample.name == "ucm_mrc_hit_ratio":
                cap = float(sample.labels.get("capacity_bytes", "nan"))
                points.setdefault(tier, {}).setdefault(cap, sample.value)
                policies.setdefault(tier, sample.labels.get("policy", "?"))
            elif sample.name == "ucm_mrc_block_bytes":
                block_bytes.setdefault(tier, sample.value)
            elif sample.name == "ucm_mrc_sample_rate":
                rates.setdefault(tier, sample.value)
    if not points:
        raise ValueError(f"{source}: no ucm_mrc_hit_ratio series (is `mrc:` set in the "
                         "server's ucm config, and has it seen any traffic?)")
    reports = []
    for tier in sorted(points):
        size = block_bytes.get(tier) or 0.0
        by_bytes = sorted(points[tier].items())
        curve = ([(c / size, h) for c, h in by_bytes] if size > 0 else by_bytes)
        reports.append(CurveReport(policies[tier], round(size) if size > 0 else None, curve,
                                   "live /metrics", rates.get(tier), tier))
    return reports


# -- the commands' shared part (ucm tune --mrc / --live, ucm-trace mrc) ----------------------
def add_question_options(parser: Any) -> None:
    """--hit, --at and --json: the questions a curve answers and where it is written."""
    parser.add_argument("--hit", type=_ratios, default=[], metavar="X[,X...]",
                        help="print the capacity needed for these hit ratios (0-1)")
    parser.add_argument("--at", type=_numbers, default=[], metavar="C[,C...]",
                        help="print the hit ratio at these capacities (blocks)")
    parser.add_argument("--json", metavar="OUT", help='write {"policy", "block_bytes", '
                        '"curve": [[capacity_in_blocks, hit_ratio], ...]}')


def add_replay_options(parser: Any) -> None:
    """How a curve is computed from requests: policy, capacities, sampling."""
    parser.add_argument("--policy", default="shadow", choices=POLICIES)
    parser.add_argument("--capacities", type=_numbers, metavar="C[,C...]",
                        help="capacities in blocks (default: the distinct blocks seen, "
                        "times 1/256 to 1)")
    parser.add_argument("--rate", type=float, default=0.1,
                        help="sampling rate of the estimator (default 0.1)")
    parser.add_argument("--max-keys", type=int, default=1 << 18,
                        help="keys the miniature caches hold together; over it the rate drops "
                        "(default 262144: a trace's curve is read once, memory is not scarce)")
    parser.add_argument("--min-blocks", type=int, default=1000,
                        help="a capacity's miniature samples more where the rate would leave "
                        "it under this many blocks (default 1000)")
    parser.add_argument("--exact", action="store_true",
                        help="replay the simulator at each capacity instead of sampling")
    parser.add_argument("--block-bytes", type=int, help="bytes of one block (sizes in bytes)")
    add_question_options(parser)


def _numbers(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"capacities must be > 0: {text!r}")
    return values


def _ratios(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of hit ratios: {text!r}") from None
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"hit ratios must be in (0, 1]: {text!r}")
    return values


def default_capacities(requests: Sequence[Request]) -> list[int]:
    distinct = len({key for r in requests for key in r.blocks})
    return sorted({max(1, distinct >> k) for k in range(9)})


def curve_of_requests(requests: Sequence[Request], args: Any, source: str) -> CurveReport:
    """The curve the replay options ask for, from requests already read."""
    if not requests or not any(r.blocks for r in requests):
        raise ValueError(f"{source}: no requests with blocks in it")
    if not 0 < args.rate <= 1:
        raise ValueError(f"--rate must be in (0, 1], got {args.rate}")
    if args.block_bytes is not None and args.block_bytes <= 0:
        raise ValueError(f"--block-bytes must be > 0, got {args.block_bytes}")
    caps = ([int(c) for c in args.capacities] if args.capacities
            else default_capacities(requests))
    if args.exact:
        return CurveReport(args.policy, args.block_bytes,
                           exact_curve(requests, args.policy, caps), f"{source}, exact replay")
    curve, mrc = sampled_curve(requests, args.policy, caps, rate=args.rate,
                               max_keys=args.max_keys, min_blocks=args.min_blocks)
    return CurveReport(args.policy, args.block_bytes, curve, f"{source}, sampled", mrc.rate)


def answer(reports: Sequence[CurveReport], args: Any) -> None:
    """Prints each report's table and answers; writes --json."""
    for report in reports:
        print(render(report, targets=args.hit, at=args.at))
    if args.json:
        write_json(args.json, reports)
        print(f"wrote {args.json}")


def read_metrics(url: str, *, timeout: float = 10.0) -> str:
    """A server's /metrics text (`url` with no path: its /metrics)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s) URL (e.g. http://127.0.0.1:9400/metrics)")
    if parts.path in ("", "/"):
        url = urllib.parse.urlunsplit(parts._replace(path="/metrics"))
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return str(resp.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"cannot read {url}: {getattr(exc, 'reason', exc)}") from exc
