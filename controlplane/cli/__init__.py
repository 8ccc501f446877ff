"""The ``kvprefetch`` command line. Each sub-command lives in its own module exposing
``add_arguments(parser)`` and ``run(args) -> int``; heavy imports happen inside ``run``."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

from kvprefetch.controlplane import __version__
from kvprefetch.controlplane.base.errors import KvPrefetchError
from kvprefetch.controlplane.cli.options import missing_extra

#: sub-command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("kvprefetch.controlplane.cli.sim",
            "replay a trace over a modelled fleet, compare policies"),
    "sim-grid": ("kvprefetch.controlplane.cli.sim_grid",
                 "judge a policy over traces x fleet sizes x loads x seeds (sim per cell)"),
    "train": ("kvprefetch.controlplane.cli.train", "train a predictor on a trace"),
    "eval-predictor": ("kvprefetch.controlplane.cli.eval_predictor",
                       "evaluate predictors side by side on held-out gaps"),
    "demo": ("kvprefetch.controlplane.cli.demo",
             "live control plane on local Ray: ondemand vs predictive with real bytes"),
    "serve": ("kvprefetch.controlplane.cli.serve",
              "attach to a Ray cluster: scheduler, one agent per GPU node, HTTP API"),
    "gateway": ("kvprefetch.controlplane.cli.gateway",
                "the OpenAI-compatible gateway in front of the nodes' vLLM servers"),
    "journal": ("kvprefetch.controlplane.cli.journal_cmd",
                "check a scheduler journal (--repair), or compact it"),
    "init": ("kvprefetch.controlplane.cli.init",
             "write the example configs (serve, fleet, dashboard, alerts, deployment) to DIR"),
}
#: `kvprefetch bench <what>`
BENCHES: dict[str, tuple[str, str]] = {
    "store": ("kvprefetch.controlplane.cli.bench_store",
              "TTLB of one session-sized object from Valkey / S3 / tiered into the DRAM tier"),
    "lmcache": ("kvprefetch.controlplane.cli.bench_lmcache",
                "our LMCache L2 adapter vs LMCache's valkey and s3 adapters (lmcache bench l2)"),
    "sglang": ("kvprefetch.controlplane.cli.bench_sglang",
               "our SGLang HiCache backend (local tier, Valkey) vs SGLang's file backend"),
    "control-plane": ("kvprefetch.controlplane.cli.bench_control_plane",
                      "scheduler events/s, route latency, planning step and memory per "
                      "session: pure core, service, one Ray actor"),
    "soak": ("kvprefetch.controlplane.cli.bench_soak",
             "steady traffic against the scheduler service and its journal: is RSS flat?"),
    "aiperf": ("kvprefetch.controlplane.cli.bench_aiperf",
               "NVIDIA's aiperf replays the vLLM demo's multi-turn trace through the gateway, "
               "next to our own client (needs make setup-vllm and setup-aiperf)"),
}


def _add_commands(sub: argparse._SubParsersAction, table: dict[str, tuple[str, str]],
                  prefix: str = "") -> None:
    for name, (module, help_) in table.items():
        p = sub.add_parser(name, help=help_, description=help_)
        try:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
        except ModuleNotFoundError as exc:
            message = missing_extra(exc, prefix + name)
            if message is None:
                raise
            # Still listed; any use of it, --help included, says which extra it needs.
            stub = argparse.ArgumentParser(prog=p.prog, add_help=False)
            stub.set_defaults(_run=_needs_extra(message), _needs_extra=True)
            sub.choices[name] = stub
            continue
        _add_verbose(p)
        p.set_defaults(_run=mod.run)


def _needs_extra(message: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(message, file=sys.stderr)
        return 2
    return run


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    """``-v`` after a sub-command too; SUPPRESS keeps the one given before it."""
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="debug logging")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices.values():
                _add_verbose(nested)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvprefetch",
        description="Prefetch-scheduling control plane for LLM inference KV caches.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"kvprefetch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_commands(sub, COMMANDS)
    bench = sub.add_parser("bench", help="benchmarks", description="benchmarks")
    bench.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="debug logging")
    _add_commands(bench.add_subparsers(dest="bench", metavar="WHAT", required=True), BENCHES,
                  prefix="bench ")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # As with `python -m`, user plugins given as `module:Class` (predictors) resolve from the
    # current directory too.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "_needs_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args._run(args))
    except KvPrefetchError as exc:
        print(f"kvprefetch: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        command = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
        message = missing_extra(exc, command)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvprefetch: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
