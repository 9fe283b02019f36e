"""`ucm-trace`: read the event traces the kernel writes (`trace: {path: DIR}` or
`UCM_TRACE=DIR`).

    ucm-trace summary DIR                  figures per event type, driver and tier
    ucm-trace show DIR --request-id R      events, filtered
    ucm-trace export --format perfetto DIR -o out.json
    ucm-trace plot DIR -o out.png
    ucm-trace follow DIR                   live records of a running process
    ucm-trace diff A B                     latency and hit-rate changes
    ucm-trace mrc DIR [--hit X] [--at C]   miss-ratio curve of the traced lookups

TRACE is a trace directory or one segment file.

Nothing in a trace is trusted: records stream, and what one command reads is bounded
(`ucm.trace.ReadLimits`): records and decompressed bytes per segment (--max-segment-records,
--max-segment-bytes) and in all (--max-records, --max-bytes; `diff`: both traces together;
`follow`: per poll), and at most 8 malformed frames per segment. A segment past a limit is cut
there and a command past one stops, each with a warning naming the file; `summary` counts
what was skipped. The defaults read a full default trace directory.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from ucm.trace import ReadBudget, ReadLimits

from ._trace_model import Event, Trace, diff, load, summarize

_DEFAULTS = ReadLimits()
_SIZE = re.compile(r"(\d+)\s*([kmg]?)(i?)b?", re.IGNORECASE)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _rate(r: float | None) -> str:
    return "-" if r is None else f"{r * 100:.1f}%"


def _table(out: TextIO, header: Sequence[str], rows: list[Sequence[Any]]) -> None:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        out.write("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                            for i, (c, w) in enumerate(zip(r, widths, strict=True))) + "\n")
        if j == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


def render_summary(s: dict[str, Any], out: TextIO) -> None:
    out.write(f"trace: {s['events']} events over {s['duration_s']:.3f} s, processes "
              f"{', '.join(map(str, s['processes'])) or '-'}; dropped records: "
              f"{s['dropped_records']}\n")
    skipped = s.get("skipped") or {}
    if skipped:
        out.write("unreadable and skipped: " + ", ".join(
            f"{n} {what}" for what, n in skipped.items()) + "\n")
    out.write("\nevents by type (latency in ms, dispatch to done)\n")
    _table(out, ["type", "count", "ok", "failed", "keys", "bytes", "throughput/s", "p50", "p90",
                 "p99", "max", "queue p50"],
           [[name, r["count"], r["outcomes"].get("ok", 0), r["count"] - r["outcomes"].get("ok", 0),
             r["keys"], _size(r["bytes"]), _size(r["throughput_bps"]),
             _ms(r["latency_s"]["p50"]), _ms(r["latency_s"]["p90"]),
             _ms(r["latency_s"]["p99"]), _ms(r["latency_s"]["max"]), _ms(r["queue_s"]["p50"])]
            for name, r in s["types"].items()])
    out.write("\ndriver calls by tier (latency in ms)\n")
    _table(out, ["tier/op", "calls", "errors", "keys", "bytes", "throughput/s", "p50", "p90",
                 "p99", "max"],
           [[name, r["count"], r["errors"], r["keys"], _size(r["bytes"]),
             _size(r["throughput_bps"]), _ms(r["latency_s"]["p50"]),
             _ms(r["latency_s"]["p90"]), _ms(r["latency_s"]["p99"]), _ms(r["latency_s"]["max"])]
            for name, r in s["drivers"].items()])
    out.write("\nhit rate per tier (lookups: of the keys that reached the tier; loads: of "
              "the keys asked of its driver)\n")
    _table(out, ["tier", "lookup keys", "lookup hits", "lookup rate", "load keys", "load hits",
                 "load rate", "evicted"],
           [[tier, r["lookup_keys"], r["lookup_hits"], _rate(r["lookup_rate"]), r["load_keys"],
             r["load_hits"], _rate(r["load_rate"]), s["evictions"].get(tier, 0)]
            for tier, r in s["hit_rate"].items()])
    out.write("\nerrors by kind\n")
    if s["errors"]:
        _table(out, ["where/kind", "count"], [[k, v] for k, v in s["errors"].items()])
    else:
        out.write("  none\n")
    out.write("\nslowest events\n")
    _table(out, ["event", "type", "request", "keys", "ms", "outcome", "tiers", "bytes"],
           [[f"{r['pid']}:{r['event_id']}", r["type"], r["request_id"] or "-", r["keys"],
             _ms(r["seconds"]), r["outcome"], ",".join(r["tiers"]) or "-", _size(r["bytes"])]
            for r in s["slowest"]])


def _select(trace: Trace, args: argparse.Namespace) -> list[Event]:
    base = trace.t_min
    out = []
    for ev in trace.events:
        t = ev.start if ev.start is not None else ev.submit
        if args.request_id is not None and ev.request_id != args.request_id:
            continue
        if args.key_prefix and not (ev.key or "").startswith(args.key_prefix.lower()):
            continue
        if args.tier and args.tier not in ev.tiers:
            continue
        if args.type and ev.type.lower() != args.type.lower():
            continue
        if args.outcome and (ev.outcome or "unfinished") != args.outcome:
            continue
        if args.since is not None and (t is None or (t - base) / 1e9 < args.since):
            continue
        if args.until is not None and (t is None or (t - base) / 1e9 > args.until):
            continue
        if args.min_ms is not None and (ev.seconds or 0) * 1e3 < args.min_ms:
            continue
        out.append(ev)
    return out


def _event_line(ev: Event, base: int) -> str:
    t = ev.start if ev.start is not None else ev.submit or 0
    ops = " ".join(f"{o.tier}.{o.op}[{o.keys}{'' if o.hits is None else f'/{o.hits}'} "
                   f"{(o.t1 - o.t0) / 1e6:.3f}ms{' ' + o.error if o.error else ''}]"
                   for o in ev.ops)
    err = f" {ev.kind}: {ev.error}" if ev.error else ""
    return (f"{(t - base) / 1e9:10.6f}s {ev.pid}:{ev.event_id} {ev.type} "
            f"req={ev.request_id or '-'} key={ev.key or '-'} keys={ev.keys} "
            f"{_ms(ev.seconds)}ms {ev.outcome or 'unfinished'}{err} {ops}").rstrip()


def _record_line(r: Any) -> str:
    fields = " ".join(f"{k}={v}" for k, v in r.fields.items())
    return f"{r.t / 1e9:.6f} {r.pid}:{r.event_id} {r.phase} {fields}"


def _count(text: str) -> int:
    """A count or size of at least 1: 4096, 64MiB, 2GiB, 10M (k, M, G: powers of 1000)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None or (m.group(3) and not m.group(2)):
        raise argparse.ArgumentTypeError(f"not a count or size: {text!r}")
    number, prefix, binary = m.groups()
    value = int(number) * int((1024 if binary else 1000) ** " KMG".index(prefix.upper() or " "))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def _limits(args: argparse.Namespace) -> ReadLimits:
    return ReadLimits(segment_records=args.max_segment_records,
                      segment_bytes=args.max_segment_bytes, records=args.max_records,
                      bytes=args.max_bytes, bad_frames=_DEFAULTS.bad_frames)


def _budget(args: argparse.Namespace) -> ReadBudget:
    """One budget for everything the command reads."""
    return ReadBudget(_limits(args))


def cmd_summary(args: argparse.Namespace) -> int:
    s = summarize(load(args.trace, _budget(args)), slowest=args.slowest)
    if args.json:
        json.dump(s, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        render_summary(s, sys.stdout)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    trace = load(args.trace, _budget(args))
    events = _select(trace, args)
    if args.limit:
        events = events[: args.limit]
    for ev in events:
        sys.stdout.write(_event_line(ev, trace.t_min) + "\n")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ._trace_perfetto import to_chrome

    doc = to_chrome(load(args.trace, _budget(args)))
    with open(args.output, "w") as f:
        json.dump(doc, f, default=str)
    print(f"wrote {len(doc['traceEvents'])} trace events to {args.output}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from ._trace_plot import plot

    plot(load(args.trace, _budget(args)), args.output)
    print(f"wrote {args.output}")
    return 0


def cmd_follow(args: argparse.Namespace) -> int:
    from ucm.trace import Follower

    follower = Follower(args.trace, from_start=args.from_start, limits=_limits(args))
    end = None if args.duration is None else time.monotonic() + args.duration
    try:
        while end is None or time.monotonic() < end:
            for r in follower.poll():
                if args.request_id is None or r.fields.get("request_id") == args.request_id:
                    sys.stdout.write(_record_line(r) + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    budget = _budget(args)
    d = diff(summarize(load(args.a, budget)), summarize(load(args.b, budget)))
    if args.json:
        json.dump(d, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return 0

    def ratio(r: float | None) -> str:
        return "-" if r is None else f"x{r:.2f}"

    for section, title in (("types", "event latency (ms): A -> B"),
                           ("drivers", "driver call latency (ms): A -> B")):
        print(title)
        _table(sys.stdout, ["name", "count A", "count B", "p50", "p90", "p99"],
               [[name, r["count"][0], r["count"][1]] +
                [f"{_ms(r[q][0])} -> {_ms(r[q][1])} {ratio(r[q][2])}" for q in ("p50", "p90",
                                                                                 "p99")]
                for name, r in d[section].items()])
        print()
    print("hit rate per tier: A -> B")
    _table(sys.stdout, ["tier", "lookup", "load"],
           [[tier] + [f"{_rate(r[k][0])} -> {_rate(r[k][1])}"
                      + ("" if r[k][2] is None else f" ({r[k][2] * 100:+.1f} pt)")
                      for k in ("lookup_rate", "load_rate")]
            for tier, r in d["hit_rate"].items()])
    return 0


def _limit_options() -> argparse.ArgumentParser:
    """The read limits every command takes (counts and sizes: 4096, 64MiB, 2GiB)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("read limits (a trace is not trusted: see ucm-trace --help)")
    g.add_argument("--max-records", type=_count, default=_DEFAULTS.records, metavar="N",
                   help=f"records read in all (default {_DEFAULTS.records})")
    g.add_argument("--max-bytes", type=_count, default=_DEFAULTS.bytes, metavar="SIZE",
                   help=f"decompressed bytes read in all (default {_DEFAULTS.bytes >> 30} GiB)")
    g.add_argument("--max-segment-records", type=_count, default=_DEFAULTS.segment_records,
                   metavar="N", help="records read from one segment file (default "
                   f"{_DEFAULTS.segment_records})")
    g.add_argument("--max-segment-bytes", type=_count, default=_DEFAULTS.segment_bytes,
                   metavar="SIZE", help="decompressed bytes read from one segment file "
                   f"(default {_DEFAULTS.segment_bytes >> 20} MiB)")
    return p


def cmd_mrc(args: argparse.Namespace) -> int:
    from ucm.autotune import _mrc
    from ucm.autotune._traces import read_ucm_trace

    try:
        requests = read_ucm_trace(args.trace)
        _mrc.answer([_mrc.curve_of_requests(requests, args, args.trace)], args)
    except ValueError as exc:
        print(f"ucm-trace: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ucm-trace", description="Read the event traces the ucm kernel writes (trace: "
        "{path: DIR} or UCM_TRACE=DIR).", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Nothing in a trace is trusted: records stream, and what one command reads is "
        "bounded:\n  records and decompressed bytes per segment file (--max-segment-records, "
        f"default {_DEFAULTS.segment_records};\n  --max-segment-bytes, default "
        f"{_DEFAULTS.segment_bytes >> 20} MiB) and in all (--max-records, default "
        f"{_DEFAULTS.records};\n  --max-bytes, default {_DEFAULTS.bytes >> 30} GiB; diff: both "
        "traces together; follow: per poll),\n  and at most "
        f"{_DEFAULTS.bad_frames} malformed frames per segment. A segment past a limit is cut "
        "there,\n  a command past one stops; each says so in a warning naming the file.")
    sub = p.add_subparsers(dest="command", required=True)
    limits = [_limit_options()]

    s = sub.add_parser("summary", parents=limits,
                       help="figures per event type, driver and tier")
    s.add_argument("trace")
    s.add_argument("--slowest", type=int, default=10, help="slowest events to list")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_summary)

    s = sub.add_parser("show", parents=limits,
                       help="events, one per line, filtered")
    s.add_argument("trace")
    s.add_argument("--request-id")
    s.add_argument("--key-prefix", help="hex prefix of the event's first key")
    s.add_argument("--tier", "--driver", dest="tier", help="events that called this tier")
    s.add_argument("--type", help="lookup, load, store, prefetch, delete, unpin")
    s.add_argument("--outcome", choices=["ok", "error", "deadline", "cancelled", "unfinished"])
    s.add_argument("--since", type=float, help="seconds after the trace's first record")
    s.add_argument("--until", type=float, help="seconds after the trace's first record")
    s.add_argument("--min-ms", type=float, help="only events at least this slow")
    s.add_argument("--limit", type=int)
    s.set_defaults(fn=cmd_show)

    s = sub.add_parser("export", parents=limits,
                       help="Chrome trace-event JSON for ui.perfetto.dev")
    s.add_argument("trace")
    s.add_argument("--format", choices=["perfetto", "chrome"], default="perfetto")
    s.add_argument("-o", "--output", required=True)
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("plot", parents=limits,
                       help="timeline and latency histograms (PNG)")
    s.add_argument("trace")
    s.add_argument("-o", "--output", required=True)
    s.set_defaults(fn=cmd_plot)

    s = sub.add_parser("follow", parents=limits,
                       help="print records as a running process writes them")
    s.add_argument("trace", help="the trace directory")
    s.add_argument("--duration", type=float, help="stop after this many seconds")
    s.add_argument("--interval", type=float, default=0.2)
    s.add_argument("--from-start", action="store_true", help="print existing records too")
    s.add_argument("--request-id")
    s.set_defaults(fn=cmd_follow)

    from ucm.autotune import _mrc  # the simulator's imports, only for this parser

    s = sub.add_parser("mrc", help="miss-ratio curve of the traced requests (their Lookups' "
                       "keys), for a policy: the capacity a hit ratio needs, and back")
    s.add_argument("trace")
    _mrc.add_replay_options(s)
    s.set_defaults(fn=cmd_mrc)

    s = sub.add_parser("diff", parents=limits,
                       help="latency and hit-rate changes from trace A to trace B")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_diff)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fn: Callable[[argparse.Namespace], int] = args.fn  # a cmd_* (set_defaults)
    try:
        return fn(args)
    except FileNotFoundError as exc:
        print(f"ucm-trace: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
