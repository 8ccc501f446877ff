"""``kvprefetch demo``: the live control plane on a local Ray runtime, moving real bytes.

The options and the choice of engine; the runs are the harness's
(:mod:`kvprefetch.controlplane.harness.demo`, ``--engine vllm``:
:mod:`kvprefetch.controlplane.harness.demo_vllm`).
"""

from __future__ import annotations

import argparse
from typing import Any

from kvprefetch.controlplane.cli import demo_vllm
from kvprefetch.controlplane.cli.options import require_extra_module

EPILOG = """defaults: 2 nodes; 3 arrival seeds x 2 policies (ondemand, predictive) = 6 replays,
each of the first 12 sessions to arrive (0.05 session starts per trace second), at most 16
turns each, at 20x time compression: about 35-40 s per replay, about 5 minutes in all on 2
cores. Client hints on (coverage 1.0); the predictor is the shipped 'default', read through
'hinted'.

examples:
  kvprefetch demo                                  # 3 seeds x 2 policies, ~5 min on 2 cores
  kvprefetch demo --repeats 1                      # one seed, ~2 min
  kvprefetch demo --backend lmcache-mp             # one real LMCache server per node
  kvprefetch demo --no-hints --repeats 5 --seed 10
  kvprefetch demo --nodes 3 --compression 40 --json out/demo.json --plot out/demo.png
"""



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG + demo_vllm.EPILOG
    p.add_argument("--engine", choices=("emulated", "vllm"), default="emulated",
                   help="'emulated' = engine emulators on emulated GPU nodes (default); "
                        "'vllm' = real vLLM (CPU build) + LMCache servers behind the "
                        "OpenAI-compatible gateway (needs make setup-vllm; see below)")
    p.add_argument("--nodes", type=int, default=2, help="emulated GPU nodes (default 2)")
    p.add_argument("--backend", choices=("local", "lmcache-mp"), default="local",
                   action=ExplicitStore,
                   help="node-local KV tier: 'local' = the agents' own DRAM tier; "
                        "'lmcache-mp' = a real LMCache MP server per node (L2: our adapter "
                        "over the same Valkey + S3), the engine emulators its engine-driven "
                        "clients, the agents warming it over its HTTP API (default local)")
    p.add_argument("--policies", default="ondemand,predictive",
                   help="policies to run, in order (default: ondemand,predictive)")
    p.add_argument("--predictor", default="default",
                   help="predictor of 'predictive' (default: 'default', the shipped model "
                        "reading hints, as a deployment runs it; 'hinted:SPEC' makes any "
                        "other spec read them)")
    p.add_argument("--repeats", type=int, default=3, action=ExplicitStore,
                   help="arrival seeds per policy: --seed, --seed+1, ... (default 3; "
                        "vllm: 2)")
    p.add_argument("--compression", type=float, default=20.0, action=ExplicitStore,
                   help="service seconds per wall second (default 20; vllm: 10)")
    p.add_argument("--kv-scale", type=float, default=1 / 4096,
                   help="real bytes per modelled KV byte (default 1/4096)")
    p.add_argument("--chunk-tokens", type=int, default=4096, action=ExplicitStore,
                   help="tokens per stored chunk (default 4096; vllm: 256, LMCache's)")
    p.add_argument("--sessions", type=int, default=12, action=ExplicitStore,
                   help="sessions to replay per seed: the first to arrive (default 12; "
                        "vllm: 10)")
    p.add_argument("--turns", type=int, default=16, action=ExplicitStore,
                   help="turns per session at most (16; vllm: 6)")
    p.add_argument("--max-gap-s", type=float, default=60.0, action=ExplicitStore,
                   help="cap idle gaps at this many trace seconds (default 60; vllm: 30)")
    p.add_argument("--trace",
                   help="replay this trace instead of the bundled Claude Code slice: a "
                   "Claude Code folder or synthetic:PROFILE (traffic no predictor has seen, "
                   "drawn from each arrival seed; see `kvprefetch sim --help`)")
    p.add_argument("--session-rate", type=float, default=0.05,
                   help="session starts per trace second (default 0.05)")
    p.add_argument("--hbm-gib", type=float, default=2.0, help="HBM for KV per node, GiB (2)")
    p.add_argument("--dram-gib", type=float, default=24.0, help="DRAM tier per node, GiB (24)")
    p.add_argument("--no-link-emulation", dest="link_emulation", action="store_false",
                   help="let the agents move bytes as fast as the loopback allows, instead of "
                        "at the fleet model's remote-read rate (scaled by kv_scale and the "
                        "compression)")
    p.add_argument("--no-hints", dest="hints", action="store_false",
                   help="send no client hints (default: the hints the trace implies)")
    p.add_argument("--hint-coverage", type=float, default=1.0,
                   help="share of clients (session groups) that send hints (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="first arrival seed (default 0)")
    p.add_argument("--json", dest="json_out", help="write the report as JSON here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--no-progress", action="store_true")
    demo_vllm.add_arguments(p)


class ExplicitStore(argparse._StoreAction):
    """``store``, and the option's dest noted in ``namespace.explicit``: the engines share
    these options with different defaults, and a default is replaced only where the user
    gave none."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        explicit = set(getattr(namespace, "explicit", ()) or ())
        namespace.explicit = explicit | {self.dest}


def run(args: argparse.Namespace) -> int:
    if args.plot:  # written last: a missing matplotlib stops the demo before it starts
        require_extra_module("matplotlib")
    if args.engine == "vllm":
        from kvprefetch.controlplane.harness.demo_vllm import run_demo_vllm

        demo_vllm.apply_defaults(args)
        return run_demo_vllm(args)
    from kvprefetch.controlplane.harness.demo import run_demo

    return run_demo(args)
