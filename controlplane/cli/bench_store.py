"""``kvprefetch bench store``: the data-plane benchmark (logic in
:mod:`kvprefetch.controlplane.harness.store_bench`)."""

from __future__ import annotations

import argparse
import sys

MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvprefetch bench store``."""
    parser.add_argument("--object-mib", type=float, default=512.0,
                        help="size of the session's KV object (default 512 MiB)")
    parser.add_argument("--chunk-mib", type=float, default=32.0,
                        help="chunk size (default 32 MiB: 256 tokens of Llama-3.1-8B)")
    parser.add_argument("--part-mib", type=float, default=4.0,
                        help="Valkey stripe / checksum part size (default 4 MiB)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="loopback repeats; each runs naive, engine (and for Valkey the "
                        "raw limit) back to back; figures are medians (default 5)")
    parser.add_argument("--conditions", default="loopback,link",
                        help="comma-separated: loopback, link")
    parser.add_argument("--stores", default="valkey,s3,tiered",
                        help="comma-separated: valkey, s3, tiered")
    parser.add_argument("--valkey-link", default="0.0005,100",
                        help="Valkey link: first-byte latency s, MiB/s per connection")
    parser.add_argument("--s3-link", default="0.015,25",
                        help="S3 link: first-byte latency s, MiB/s per connection")
    parser.add_argument("--s3-backend", choices=("auto", "seaweedfs", "moto"), default="auto")
    parser.add_argument("--json", metavar="OUT", help="write the result as JSON (atomically)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _link(text: str, flag: str) -> object:
    from kvprefetch.agents.linkemu import LinkProfile

    try:
        latency, bandwidth = (float(x) for x in text.split(","))
    except ValueError as exc:
        raise SystemExit(f"{flag}: expected 'LATENCY_S,MIB_S', got {text!r}") from exc
    return LinkProfile(latency_s=latency, bandwidth_mib_s=bandwidth)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table; write ``--json``. Returns the exit code."""
    from pydantic import ValidationError

    from kvprefetch.controlplane.harness.store_bench import (
        StoreBenchConfig,
        bench_steps,
        format_table,
        run_store_bench,
    )

    try:
        config = StoreBenchConfig(
            object_bytes=int(args.object_mib * MIB),
            chunk_bytes=int(args.chunk_mib * MIB),
            part_bytes=int(args.part_mib * MIB),
            repeats=args.repeats,
            conditions=tuple(c.strip() for c in args.conditions.split(",") if c.strip()),
            stores=tuple(s.strip() for s in args.stores.split(",") if s.strip()),
            valkey_link=_link(args.valkey_link, "--valkey-link"),
            s3_link=_link(args.s3_link, "--s3-link"),
            s3_backend=args.s3_backend,
        )
    except ValidationError as exc:
        print(f"bench store: {exc}", file=sys.stderr)
        return 2
    from kvprefetch.controlplane.cli.benchrun import run_bench

    result = run_bench("bench store", bench_steps(config),
                       lambda step: run_store_bench(config, step), format_table,
                       json_out=args.json, progress=not args.no_progress)
    return 0 if result is not None else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvprefetch bench store")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
