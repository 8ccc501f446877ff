"""``kvprefetch bench sglang``: batch_get MiB/s of our SGLang HiCache backend from the
warmed local tier and from Valkey vs SGLang's file backend (see agents.sglang.bench)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pages", type=int, default=64, help="pages stored and read")
    parser.add_argument("--page-mib", type=float, default=2.0, help="bytes per page (MiB)")
    parser.add_argument("--batch-pages", type=int, default=64, help="pages per batch_get")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="OUT", help="write the result as JSON (atomically)")


def run(args: argparse.Namespace) -> int:
    """Exit code 0, or 1 when a backend's bytes did not verify."""
    try:
        from agents.sglang.bench import (
            SGLangBenchConfig,
            default_dram_dir,
            format_table,
            run_sglang_bench,
        )
    except ImportError as exc:
        print(f"bench sglang: SGLang is not installed ({exc}): make setup-sglang",
              file=sys.stderr)
        return 2
    from controlplane.base.atomic import write_json_atomic

    config = SGLangBenchConfig(pages=args.pages, page_mib=args.page_mib,
                               batch_pages=args.batch_pages, repeats=args.repeats,
                               dram_dir=default_dram_dir())
    result = run_sglang_bench(config)
    print(format_table(result))
    if args.json:
        write_json_atomic(args.json, result)
    return 0 if all(r["verified"] for r in result["backends"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvprefetch bench sglang")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
