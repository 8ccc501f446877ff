"""The options of ``kvprefetch demo --engine vllm`` and this engine's defaults for the
options it shares with the emulated demo (the run:
:mod:`kvprefetch.controlplane.harness.demo_vllm`)."""

from __future__ import annotations

import argparse

EPILOG = """
--engine vllm: the real engine on this machine, scaled to fit 2 cores and ~10 minutes.
Needs vLLM's CPU build in the running Python: `make demo-vllm` (sets up .venv-vllm and
runs it, JSON to out/demo-vllm.json). Starts local Ray, Valkey + S3, per node a vLLM CPU
server (a tiny random-weight Llama generated locally, nothing downloaded) and an `lmcache
server` whose L2 is our adapter with an emulated load link, one lmcache-mp agent per node,
and the gateway; replays the trace through the gateway (ondemand, then predictive) and
measures TTFT at the client, in wall seconds. Scaled replay by default: 2 arrival seeds
(the policies' order alternates), per seed the first 10 sessions, at most 6 turns each,
idle gaps capped at 30 trace s and replayed 10x faster, token counts x 1/32 (contexts up to
~4k tokens), outputs capped at 8 tokens: 60 requests per policy and seed, ~30-40 s each;
with vLLM's start-up (1-3 min) about 4-6 min in all on 2 cores. L2 loads are not paced by
default: on CPU, LMCache's L2 path already costs a large share of the prefill it saves;
--link-mib-s adds pacing. The run
measures TTFT cold / from L1 / from L2 at start and reports the ratio it got. JSON: the
emulated demo's fields plus meta.engine = "vllm", meta.vllm and, per policy,
engine_counters (vLLM's and LMCache's own counters).

  make demo-vllm
  .venv-vllm/bin/kvprefetch demo --engine vllm --json out/demo-vllm.json
  .venv-vllm/bin/kvprefetch demo --engine vllm --sessions 6 --turns 4   # ~4 min
"""

#: ``--warming``: when the agents hold a new prefetch (``agent.warming``).
WARMING = ("waiting", "busy", "off")

#: Defaults of the shared demo options when the engine is vLLM (the emulated demo's own
#: defaults are in kvprefetch.controlplane.cli.demo).
DEFAULTS = {"repeats": 2, "compression": 10.0, "sessions": 10, "turns": 6,
            "max_gap_s": 30.0, "chunk_tokens": 256}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options only ``--engine vllm`` reads."""
    g = p.add_argument_group("--engine vllm (real vLLM CPU + LMCache behind the gateway)")
    g.add_argument("--token-scale", type=float, default=1 / 32,
                   help="multiply the trace's token counts by this (default 1/32: a 128k "
                        "context becomes 4k tokens, the tiny model's window)")
    g.add_argument("--max-output-tokens", type=int, default=8,
                   help="cap each answer at this many tokens (default 8; CPU decode is slow)")
    g.add_argument("--vllm-blocks", type=int, default=40,
                   help="vLLM's own KV cache per node, in blocks of 128 tokens (default 40 "
                        "= 5,120 tokens, a bit more than one full context)")
    g.add_argument("--pressure", type=float, default=2.5,
                   help="peak working set / the nodes' L1 together (default 2.5)")
    g.add_argument("--link-mib-s", type=float, default=None,
                   help="pace L2 loads (our adapter's emulated link) at this many MiB/s per "
                        "node (default: no pacing; LMCache's L2 path on CPU already costs "
                        "more than the prefill it saves, see --help's text below)")
    g.add_argument("--load-cost-ratio", type=float, default=None,
                   help="instead of --link-mib-s: pace loads so that the link alone costs "
                        "this times the prefill of the same tokens (at 16 us/token)")
    g.add_argument("--warming", choices=WARMING, default="waiting",
                   help="how the agents' warms yield to the node's vLLM (its /metrics): "
                        "waiting = held while requests wait (the agent's default), busy = "
                        "also while one runs, off = never held (default waiting)")
    g.add_argument("--vllm-start-timeout-s", type=float, default=420.0,
                   help="longest wait for vLLM to answer /health (default 420)")


def apply_defaults(args: argparse.Namespace) -> None:
    """This engine's defaults for the shared options the user did not give
    (:class:`kvprefetch.controlplane.cli.demo.ExplicitStore` notes those given)."""
    given = getattr(args, "explicit", None) or set()
    for name, value in DEFAULTS.items():
        if name not in given:
            setattr(args, name, value)

