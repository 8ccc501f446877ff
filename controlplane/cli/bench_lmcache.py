"""``kvprefetch bench lmcache``: our LMCache L2 adapter against LMCache's ``valkey`` and ``s3``
adapters under ``lmcache bench l2 --no-skip-verify`` (logic in
:mod:`kvprefetch.controlplane.harness.lmcache_bench`)."""

from __future__ import annotations

import argparse
import sys

DEFAULT_ADAPTERS = ("kvprefetch", "lmcache-valkey", "lmcache-s3")
ADAPTER_NAMES = (*DEFAULT_ADAPTERS, "kvprefetch-valkey")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvprefetch bench lmcache``."""
    parser.add_argument("--data-size-kb", type=int, default=4096,
                        help="bytes per key (one LMCache chunk), KiB (default 4096 = 4 MiB)")
    parser.add_argument("--num-keys", type=int, default=32,
                        help="keys per submitted task (default 32)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measured rounds per run, after one warm-up round (default 3)")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="(default 1)")
    parser.add_argument("--repeats", type=int, default=6,
                        help="measured runs of every adapter, order rotating; figures are "
                        "medians (default 6: even, so each adapter runs first as often as "
                        "second)")
    parser.add_argument("--warmup-runs", type=int, default=1,
                        help="runs of every adapter first, not counted (default 1: a fresh "
                        "Valkey stores its first few hundred MiB far slower, whoever writes "
                        "them)")
    parser.add_argument("--adapters", default=",".join(DEFAULT_ADAPTERS),
                        help="comma-separated subset of: " + ", ".join(ADAPTER_NAMES))
    parser.add_argument("--write-mode", choices=("write-through", "write-back"),
                        default="write-back",
                        help="our adapter's write policy (default write-back: after each run "
                        "the backlog is drained by a restarted adapter and every key read "
                        "back from S3 alone)")
    parser.add_argument("--lookup-hit-rate", type=float, default=0.0,
                        help="share of looked-up keys that were stored (lmcache bench l2 "
                        "--lookup-max-hit-rate; default 0: every lookup misses)")
    parser.add_argument("--no-raw", action="store_true",
                        help="skip the plain single-connection GET loop figure")
    parser.add_argument("--json", metavar="OUT", help="write the result as JSON (atomically)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table; write ``--json``. Returns the exit code: 0, or 1
    when an adapter failed to verify or the benchmark could not run."""
    from pydantic import ValidationError

    from kvprefetch.controlplane.harness.lmcache_bench import (
        LMCacheBenchConfig,
        bench_steps,
        format_table,
        run_lmcache_bench,
    )

    try:
        config = LMCacheBenchConfig(
            data_size_kb=args.data_size_kb,
            num_keys=args.num_keys,
            rounds=args.rounds,
            warmup_rounds=args.warmup_rounds,
            repeats=args.repeats,
            warmup_runs=args.warmup_runs,
            adapters=tuple(a.strip() for a in args.adapters.split(",") if a.strip()),
            write_mode=args.write_mode,
            lookup_hit_rate=args.lookup_hit_rate,
            raw_get_loop=not args.no_raw,
        )
    except ValidationError as exc:
        print(f"bench lmcache: {exc}", file=sys.stderr)
        return 2
    from kvprefetch.controlplane.cli.benchrun import run_bench

    result = run_bench("bench lmcache", bench_steps(config),
                       lambda step: run_lmcache_bench(config, step), format_table,
                       json_out=args.json, progress=not args.no_progress)
    return 0 if result is not None and result["verified"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvprefetch bench lmcache")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
