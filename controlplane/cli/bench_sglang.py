"""``kvprefetch bench sglang``: batch_get MiB/s of our SGLang HiCache backend from the
warmed local tier and from Valkey vs SGLang's file backend, and the replay of HiCache's page
reads with and without warming (see
kvprefetch.controlplane.harness.sglang_bench and kvprefetch.controlplane.harness.sglang_replay)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=int, default=64, help="pages stored and read")
    parser.add_argument("--page-mib", type=float, default=2.0, help="bytes per page (MiB)")
    parser.add_argument("--batch-pages", type=int, default=64, help="pages per batch_get")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--read-threads", type=int, default=4,
                        help="threads our backend reads one batch's local pages on")
    parser.add_argument("--replay-sessions", type=int, default=1,
                        help="replay: the first sessions of the bundled claude-code slice "
                             "that have returning requests")
    parser.add_argument("--replay-requests", type=int, default=2,
                        help="replay: returning requests per session (0: no replay)")
    parser.add_argument("--replay-time-scale", type=float, default=2.0,
                        help="replay: how many times faster than the trace's clock")
    parser.add_argument("--json", metavar="OUT", help="write the result as JSON (atomically)")


def run(args: argparse.Namespace) -> int:
    """Exit code 0, or 1 when a backend's (or the replay's) bytes did not verify."""
    try:
        from kvprefetch.controlplane.harness.sglang_bench import (
            SGLangBenchConfig,
            default_dram_dir,
            format_table,
            run_sglang_bench,
        )
        from kvprefetch.controlplane.harness.sglang_replay import ReplayConfig
    except ImportError as exc:
        print(f"bench sglang: SGLang is not installed ({exc}): make setup-sglang",
              file=sys.stderr)
        return 2
    from kvprefetch.controlplane.base.atomic import write_json_atomic

    dram_dir = default_dram_dir()
    replay = (ReplayConfig(sessions=args.replay_sessions,
                           requests_per_session=args.replay_requests,
                           time_scale=args.replay_time_scale, read_threads=args.read_threads,
                           dram_dir=dram_dir)
              if args.replay_requests > 0 else None)
    config = SGLangBenchConfig(pages=args.pages, page_mib=args.page_mib,
                               batch_pages=args.batch_pages, repeats=args.repeats,
                               read_threads=args.read_threads, dram_dir=dram_dir,
                               replay=replay)
    result = run_sglang_bench(config)
    print(format_table(result))
    if args.json:
        write_json_atomic(args.json, result)
    verified = all(r["verified"] for mode in ("backends", "host_pool")
                   for r in result[mode].values()) and (
        result["replay"] is None or result["replay"]["verified"])
    return 0 if verified else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvprefetch bench sglang")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
