"""``kvprefetch bench aiperf``: NVIDIA's aiperf, a peer benchmark client, replays the vLLM
demo's multi-turn trace through the gateway, next to our own replayer (the bench:
:mod:`kvprefetch.controlplane.harness.aiperf_bench`)."""

from __future__ import annotations

import argparse

EPILOG = """defaults: 10 sessions, at most 6 turns each (60 requests per client), the demo's
scaling (token counts x 1/32, outputs <= 8 tokens, gaps <= 30 trace s replayed 10x
faster); vLLM's start-up 1-3 min, then ~1.5 min per client: about 5-7 min on 2 cores.

  make bench-aiperf      # sets up .venv-vllm and .venv-aiperf, writes out/bench-aiperf.json
  .venv-vllm/bin/kvprefetch bench aiperf --aiperf .venv-aiperf/bin/aiperf --json out/b.json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--aiperf", default=None,
                   help="the aiperf command (default: .venv-aiperf/bin/aiperf, else aiperf "
                        "on PATH)")
    p.add_argument("--policy", default="predictive",
                   help="the scheduler's policy for both replays (default predictive)")
    p.add_argument("--sessions", type=int, default=10, help="sessions to replay (10)")
    p.add_argument("--turns", type=int, default=6, help="turns per session at most (6)")
    p.add_argument("--seed", type=int, default=0, help="arrival seed (0)")
    p.add_argument("--compression", type=float, default=10.0,
                   help="trace seconds per wall second (10)")
    p.add_argument("--token-scale", type=float, default=1 / 32,
                   help="multiply the trace's token counts by this (1/32)")
    p.add_argument("--artifact-dir", default="out/aiperf",
                   help="aiperf's artifacts and the trace file it replayed (out/aiperf)")
    p.add_argument("--json", dest="json_out", default="out/bench-aiperf.json",
                   help="the report (default out/bench-aiperf.json)")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="longest the aiperf run may take (600)")
    p.add_argument("--no-progress", action="store_true")

def demo_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """The demo's options for ``--engine vllm`` with this bench's settings, the engine's
    defaults applied."""
    from kvprefetch.controlplane.cli import demo, demo_vllm

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    ns = parser.parse_args([
        "--engine", "vllm", "--sessions", str(args.sessions), "--turns", str(args.turns),
        "--seed", str(args.seed), "--compression", str(args.compression),
        "--token-scale", str(args.token_scale), "--repeats", "1", "--no-hints",
        "--policies", args.policy] + (["--no-progress"] if args.no_progress else []))
    demo_vllm.apply_defaults(ns)
    return ns

def run(args: argparse.Namespace) -> int:
    from kvprefetch.controlplane.harness.aiperf_bench import run_aiperf_bench

    return run_aiperf_bench(args, demo_namespace(args))
