"""``kvprefetch bench soak``: does the scheduler's memory stay flat under steady traffic?
(The soak itself: :mod:`kvprefetch.controlplane.harness.soak`.)"""

from __future__ import annotations

import argparse
import sys
from collections import deque

from kvprefetch.controlplane.harness.soak import SoakSample, SoakSpec, format_table, run_soak

EPILOG = """\
Reported: events, events/s, sessions opened and closed, journal compactions; the resident
set (RSS) at the first sample after warm-up, at the end and its peak after warm-up; the
growth from warm-up to the end (and per 1,000 events, a least-squares slope); the same for
the objects the garbage collector tracks and for each collection size. JSON (--json,
written atomically): {"spec": {...}, "samples": [...], "warm": {...}, "end": {...},
"rss_growth", "flat", ...}.

examples:
  kvprefetch bench soak                                  # 6 minutes, 3 of them warm-up
  kvprefetch bench soak --duration 1800 --warmup 300 --json out/soak.json   # make soak
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvprefetch bench soak``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    d = SoakSpec()
    parser.add_argument("--duration", type=float, default=d.duration_s, metavar="S",
                        help=f"wall seconds of traffic (default {d.duration_s:g})")
    parser.add_argument("--warmup", type=float, default=d.warmup_s, metavar="S",
                        help=f"of which warm-up (default {d.warmup_s:g})")
    parser.add_argument("--sessions", type=int, default=d.live_sessions,
                        help=f"live sessions at all times (default {d.live_sessions})")
    parser.add_argument("--mean-turns", type=int, default=d.mean_turns,
                        help=f"mean turns of a session before it closes (default "
                        f"{d.mean_turns})")
    parser.add_argument("--nodes", type=int, default=d.nodes)
    parser.add_argument("--policy", default=d.policy)
    parser.add_argument("--predictor", default=d.predictor)
    parser.add_argument("--speedup", type=float, default=d.time_compression,
                        help=f"service seconds per wall second (default "
                        f"{d.time_compression:g})")
    parser.add_argument("--compact-records", type=int, default=d.journal_compact_records,
                        help="compact the journal every this many records (0: never; "
                        f"default {d.journal_compact_records:,})")
    parser.add_argument("--no-journal", action="store_true", help="run without a journal")
    parser.add_argument("--rate", type=float, default=0.0, metavar="EVENTS_PER_S",
                        help="events per second at most (default: closed loop)")
    parser.add_argument("--sample-interval", type=float, default=d.sample_interval_s,
                        metavar="S")
    parser.add_argument("--max-growth", type=float, default=d.max_growth,
                        help="RSS growth after warm-up called flat (default 0.10)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--json", metavar="OUT", help="write the result as JSON (atomically)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress lines on stderr")


def run(args: argparse.Namespace) -> int:
    """Run the soak; print the report; write ``--json``. Exit 0 when RSS stayed flat, 1
    when it did not (or the run failed)."""
    from kvprefetch.controlplane.base.errors import ConfigError
    from kvprefetch.controlplane.cli.benchrun import run_bench

    try:
        spec = SoakSpec(
            duration_s=args.duration, warmup_s=args.warmup, live_sessions=args.sessions,
            mean_turns=args.mean_turns, sample_interval_s=args.sample_interval,
            nodes=args.nodes, policy=args.policy, predictor=args.predictor,
            time_compression=args.speedup, journal=not args.no_journal,
            journal_compact_records=args.compact_records, max_events_per_s=args.rate,
            max_growth=args.max_growth, seed=args.seed)
    except ConfigError as exc:
        print(f"bench soak: {exc}", file=sys.stderr)
        return 2
    recent: deque[float] = deque(maxlen=1)
    every = max(1.0, spec.duration_s / 20)

    def progress(s: SoakSample) -> None:
        if args.no_progress or (recent and s.t_s - recent[0] < every):
            return
        recent.append(s.t_s)
        print(f"  {s.t_s:7.1f} s  {s.events:>10,} events  RSS {s.rss_bytes / (1 << 20):8.1f} "
              f"MiB  gc {s.gc_objects:>9,}  sessions {s.sizes.get('sessions', 0):,}  "
              f"journal {s.journal_bytes / (1 << 20):.1f} MiB", file=sys.stderr)

    out = run_bench("bench soak", 0, lambda step: run_soak(spec, on_sample=progress),
                    format_table, json_out=args.json, progress=False)
    return 0 if out is not None and out["flat"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvprefetch bench soak")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
