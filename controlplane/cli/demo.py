"""``kvprefetch demo``: the live control plane on a local Ray runtime, moving real bytes.

Starts Ray (small object store), embedded Valkey and S3 (SeaweedFS), N emulated GPU nodes
(one prefetch agent and one engine emulator each, pinned by a per-node custom resource),
and replays the bundled Claude Code slice (or ``--trace``: a Claude Code folder, or
``synthetic:PROFILE`` traffic) at a time compression through the Python client,
once per policy (``ondemand``, then ``predictive``) and arrival seed. Prints a table, writes
a JSON report (the fields of ``kvprefetch sim``, pooled over the seeds, plus real bytes and
how sure the means are) and a PNG. Everything is shut down at the end, also on Ctrl-C.

Repeats: ``--repeats N`` replays every policy over the arrival seeds ``--seed`` ..
``--seed + N - 1``. The seed drives the trace's arrival process (a seeded order of the
slice's sessions and Poisson start times; :mod:`kvprefetch.controlplane.traces.arrivals`), so each
seed replays a different mix of sessions arriving at different times. Both policies replay
each seed back to back (in alternating order from one seed to the next, so that neither
always runs first); Valkey, S3 and Ray are started once, each run gets fresh tiers (a new
deployment, new local tier folders, new key prefixes in Valkey and S3, and for
``lmcache-mp`` new LMCache servers). Per policy the report pools all seeds' requests (the
keys of a single run) and adds each seed's returning mean and p90, and a 95% confidence
interval of the returning mean over the per-seed means (Student t, N - 1 degrees of
freedom; none for N = 1). With ``ondemand`` and ``predictive`` both run, their per-seed
difference gets an interval too: the runs are paired by seed.

The replayed trace, per seed: the first ``--sessions`` sessions to arrive, at most
``--turns`` turns each, idle gaps capped at ``--max-gap-s`` (long pauses only stretch the
demo: the tiers are then cold either way), at most the model's context of tokens.

Client hints: the emulated gateway sends the hints the trace implies
(:func:`kvprefetch.controlplane.sim.hints.plan_hints`: "user typing" before human turns, "tool
running" with a noisy ETA after tool calls; the hint plan's seed is the arrival seed) at
their planned times on the compressed clock, and the service's predictor reads them: the
``default`` predictor is the shipped model with the hint layer
(:class:`kvprefetch.predictors.hinted.HintedPredictor`), the spec a deployment runs.
``--no-hints`` turns the hints off.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvprefetch.controlplane.base.atomic import save_figure_atomic

log = logging.getLogger(__name__)
GIB = 1 << 30
MIB = 1 << 20

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

#: Two-sided 95% Student t quantiles (t_{0.975}) for 1..30 degrees of freedom.
_T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
         2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905,
         2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
         2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272)
_Z975 = 1.959964


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvprefetch.controlplane.cli import demo_vllm

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG + demo_vllm.EPILOG
    p.add_argument("--engine", choices=("emulated", "vllm"), default="emulated",
                   help="'emulated' = engine emulators on emulated GPU nodes (default); "
                        "'vllm' = real vLLM (CPU build) + LMCache servers behind the "
                        "OpenAI-compatible gateway (needs make setup-vllm; see below)")
    p.add_argument("--nodes", type=int, default=2, help="emulated GPU nodes (default 2)")
    p.add_argument("--backend", choices=("local", "lmcache-mp"), default="local",
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


@contextlib.contextmanager
def sigint_stops(stop: threading.Event) -> Iterator[None]:
    """While inside: the first Ctrl-C sets ``stop`` (the replay ends and everything shuts
    down), a second one interrupts at once."""
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        print("\ninterrupted: stopping the replay and shutting down...", file=sys.stderr)
        stop.set()

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def build_trace(args: argparse.Namespace, window: int, seed: int | None = None) -> Any:
    """The replayed trace of arrival seed ``seed`` (default ``args.seed``)."""
    from kvprefetch.controlplane.sim.simulator import clamp_to_window
    from kvprefetch.controlplane.traces import ArrivalOptions, bundled_trace_path, load_trace

    trace = load_trace(args.trace or bundled_trace_path("claude-code"),
                       arrivals=ArrivalOptions(session_rate_per_s=args.session_rate),
                       seed=args.seed if seed is None else seed)
    sessions = []
    for s in trace.sessions[: args.sessions]:
        reqs = tuple(replace(r, gap_s=min(r.gap_s, args.max_gap_s) if r.gap_s else r.gap_s)
                     for r in s.requests[: args.turns])
        sessions.append(replace(s, requests=reqs))
    return clamp_to_window(replace(trace, sessions=tuple(sessions)), window)


# ---------------------------------------------------------------------------------------------
# How sure: per-seed means, their interval, pooled over seeds. Pure.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SeedStat:
    """One seed's returning requests under one policy (service seconds)."""

    seed: int
    ttft_mean_s: float
    ttft_p90_s: float
    requests: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "ttft_mean_s": self.ttft_mean_s,
                "ttft_p90_s": self.ttft_p90_s, "requests": self.requests}


def t975(dof: int) -> float:
    """The 0.975 quantile of Student's t with ``dof`` >= 1 degrees of freedom (a table to
    30, then the Cornish-Fisher expansion around the normal, within 1e-4)."""
    if dof < 1:
        raise ValueError("dof must be >= 1")
    if dof <= len(_T975):
        return _T975[dof - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def mean_ci95(values: Sequence[float]) -> tuple[float, float] | None:
    """95% confidence interval of the mean of ``values`` (Student t, n - 1 degrees of
    freedom); None for fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return (mean - half, mean + half)


def seed_summary(per_seed: Sequence[SeedStat]) -> dict[str, Any]:
    """The JSON a policy gets from its seeds: ``per_seed`` and ``ttft_mean_ci95_s`` (the
    interval of the mean over per-seed means; None for one seed)."""
    ci = mean_ci95([s.ttft_mean_s for s in per_seed])
    return {"per_seed": [s.to_dict() for s in per_seed],
            "ttft_mean_ci95_s": [round(ci[0], 6), round(ci[1], 6)] if ci else None}


def paired_difference(base: Sequence[SeedStat], other: Sequence[SeedStat]
                      ) -> dict[str, Any] | None:
    """``other - base`` of the returning mean, seed by seed (the runs of a seed replay the
    same trace): the per-seed differences, their mean and its 95% interval. None when the
    two share no seed."""
    by_seed = {s.seed: s for s in base}
    diffs = [(s.seed, s.ttft_mean_s - by_seed[s.seed].ttft_mean_s)
             for s in other if s.seed in by_seed]
    if not diffs:
        return None
    values = [d for _, d in diffs]
    ci = mean_ci95(values)
    return {"per_seed": [{"seed": seed, "ttft_mean_diff_s": round(d, 6)} for seed, d in diffs],
            "ttft_mean_diff_s": round(sum(values) / len(values), 6),
            "ttft_mean_diff_ci95_s": [round(ci[0], 6), round(ci[1], 6)] if ci else None}


# ---------------------------------------------------------------------------------------------
# The runs.
# ---------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """One policy's replay of one seed: what the replayer saw and the service's books."""

    seed: int
    policy: str
    run: Any  # kvprefetch.controlplane.sim.simulator.PolicyRun
    replay: Any  # kvprefetch.controlplane.live.replay.ReplayResult
    books: dict[str, Any]  # the scheduler's summary
    agents: list[Any] = field(default_factory=list)  # the agents' statuses at the end
    link_mib_s: float | None = None


@dataclass(frozen=True, slots=True)
class _SeedTrace:
    seed: int
    trace: Any
    hints: tuple[Any, ...]  # kvprefetch.controlplane.sim.hints.PlannedHint


def run(args: argparse.Namespace) -> int:
    from kvprefetch.controlplane.base.config import fleet_from_dict
    from kvprefetch.controlplane.base.errors import ConfigError
    from kvprefetch.controlplane.core.policies import parse_policies

    if args.engine == "vllm":
        from kvprefetch.controlplane.cli import demo_vllm

        return demo_vllm.run(args)
    if not 1 <= args.nodes <= 8:
        raise ConfigError("--nodes must be 1..8 on one machine")
    if args.compression <= 0 or not 0 < args.kv_scale <= 1:
        raise ConfigError("--compression must be > 0 and --kv-scale in (0, 1]")
    if not 1 <= args.repeats <= 100:
        raise ConfigError("--repeats must be 1..100")
    if not 0.0 <= args.hint_coverage <= 1.0:
        raise ConfigError("--hint-coverage must be in [0, 1]")
    policies = parse_policies(args.policies)
    # The spec a deployment runs (ServiceConfig.predictor, 'default': the shipped model,
    # reading hints), unchanged whether or not the emulated clients send hints.
    service_predictor = args.predictor
    fleet = fleet_from_dict({"nodes": args.nodes, "node": {
        "hbm_kv_bytes": int(args.hbm_gib * GIB), "dram_tier_bytes": int(args.dram_gib * GIB)}})
    seeds = [_seed_trace(args, fleet, args.seed + i) for i in range(args.repeats)]
    stop = threading.Event()
    started = time.perf_counter()
    with sigint_stops(stop):
        runs = _run(args, fleet, [p.name for p in policies], seeds, service_predictor, stop)
    if runs is None:
        return 130
    report = _report(args, fleet, seeds, runs, service_predictor,
                     time.perf_counter() - started)
    _print(report)
    if args.json_out:
        from kvprefetch.controlplane.base.atomic import write_json_atomic

        write_json_atomic(args.json_out, report)
        print(f"wrote {args.json_out}")
    if args.plot:
        write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _seed_trace(args: argparse.Namespace, fleet: Any, seed: int) -> _SeedTrace:
    trace = build_trace(args, fleet.model.max_context_tokens, seed)
    if not args.hints:
        return _SeedTrace(seed, trace, ())
    from kvprefetch.controlplane.sim.hints import HintConfig, plan_hints

    return _SeedTrace(seed, trace, plan_hints(trace, HintConfig(coverage=args.hint_coverage,
                                                                seed=seed)))


def _run(args: argparse.Namespace, fleet: Any, policies: list[str], seeds: list[_SeedTrace],
         predictor: str, stop: threading.Event) -> dict[str, list[_Run]] | None:
    """Every (seed, policy) run, on one Ray runtime and one Valkey + S3; None if stopped."""
    import ray

    from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
    from kvprefetch.agents.ray_entry import NAMESPACE, node_resource

    runs: dict[str, list[_Run]] = {p: [] for p in policies}
    with contextlib.ExitStack() as stack:
        valkey = stack.enter_context(EmbeddedValkey())
        s3 = stack.enter_context(EmbeddedS3())
        ray.init(num_cpus=2, object_store_memory=80 * MIB, include_dashboard=False,
                 namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                 resources={node_resource(i): 1.0 for i in range(fleet.nodes)})
        stack.callback(ray.shutdown)
        for i, st in enumerate(seeds):
            # Alternate the order per seed: neither policy always runs on a fresh runtime.
            for policy in policies if i % 2 == 0 else policies[::-1]:
                if stop.is_set():
                    return None
                one = _run_policy(args, fleet, policy, st, predictor, valkey, s3, stop)
                if one is None:
                    return None
                runs[policy].append(one)
                _print_run(one, len(seeds))
    for rs in runs.values():
        rs.sort(key=lambda r: r.seed)
    return runs


def _print_run(one: _Run, repeats: int) -> None:
    from kvprefetch.controlplane.sim.metrics import summarize

    r = summarize(one.run).returning
    print(f"  seed {one.seed} {one.policy}: {r.requests} returning, TTFT mean "
          f"{r.ttft_mean_s:.3f} s, p90 {r.ttft_p90_s:.3f} s; {one.replay.hints_sent} hints; "
          f"replay {one.replay.wall_s:.1f} s", file=sys.stderr, flush=True)


def _run_policy(args: argparse.Namespace, fleet: Any, policy: str, st: _SeedTrace,
                predictor: str, valkey: Any, s3: Any, stop: threading.Event) -> _Run | None:
    import ray
    from tqdm import tqdm

    from kvprefetch.agents.agent import AgentConfig, RemoteStoreConfig
    from kvprefetch.agents.engine_emulator import EngineConfig, ServeRequest, ServeResult
    from kvprefetch.agents.stores.local import LocalTierConfig
    from kvprefetch.agents.stores.tiered import TieredStoreConfig
    from kvprefetch.agents.transfer import TransferConfig
    from kvprefetch.controlplane.live.client import connect
    from kvprefetch.controlplane.live.ray_app import deploy, local_placements
    from kvprefetch.controlplane.live.replay import Replayer
    from kvprefetch.controlplane.live.service import ServiceConfig

    trace = st.trace
    # Fresh key prefixes, tier folders and deployment per run: no tier carries over.
    run_id = f"{policy}-s{st.seed}-{uuid.uuid4().hex[:6]}"
    remote = RemoteStoreConfig(
        valkey=valkey.store_config(key_prefix=f"{run_id}:"),
        s3=s3.store_config(key_prefix=f"{run_id}/"),
        tiered=TieredStoreConfig(write_mode="write-back"))
    # The real tier holds the modelled DRAM tier at kv_scale, plus slack for headers: the
    # scheduler's books decide what stays; the tier's own LRU is only a backstop.
    tier_bytes = int(fleet.node.dram_tier_bytes * args.kv_scale * 1.25) + 16 * MIB
    dirs = [Path("/dev/shm") / f"kvp-demo-{run_id}-{i}" for i in range(fleet.nodes)]
    link_mib_s = link_rate_mib_s(fleet, args) if args.link_emulation else None
    # The node's ingress link at the modelled rate (what the simulator's link model does):
    # without it the loopback moves a scaled KV object in a fraction of the modelled time.
    transfer = (TransferConfig(bandwidth_limit_mib_s=link_mib_s, burst_bytes=16 * 1024)
                if link_mib_s is not None else TransferConfig())
    # Fresh LMCache servers per run (their L1 must not carry over from the last run).
    stack = contextlib.ExitStack()
    servers = (_start_lmcache(args, fleet, remote, tier_bytes, link_mib_s, stack)
               if args.backend == "lmcache-mp" else [])
    agents, engines = [], []
    for i, d in enumerate(dirs):
        kv = {"dram": LocalTierConfig(path=str(d), capacity_bytes=tier_bytes)}
        agent_kv: dict[str, Any] = kv
        if servers:
            agent_kv, kv = _lmcache_configs(args, fleet, servers[i])
        agents.append(AgentConfig(node=i, node_name=f"gpu-{i}", remote=remote,
                                  transfer=transfer, backend=args.backend,
                                  kv_scale=args.kv_scale, **agent_kv))
        engines.append(EngineConfig(node=i, fleet=fleet, time_compression=args.compression,
                                    kv_scale=args.kv_scale, chunk_tokens=args.chunk_tokens,
                                    backend=args.backend, **kv))
    service = ServiceConfig(fleet=fleet, policy=policy, predictor=predictor,
                            time_compression=args.compression, chunk_tokens=args.chunk_tokens,
                            node_names=tuple(a.node_name for a in agents))
    try:
        deployment = deploy(service, agents, local_placements(fleet.nodes), engines=engines,
                            engine_remote=remote)
    except BaseException:
        stack.close()
        raise
    try:
        client = connect("auto", timeout_s=5.0)
        handles = deployment.engines

        def serve(node: int, req: ServeRequest) -> ServeResult:
            result: ServeResult = ray.get(handles[node].serve.remote(req))
            return result

        bar = tqdm(total=trace.requests, unit="req", desc=f"{policy:>10} s{st.seed}",
                   disable=args.no_progress, mininterval=0.5)
        with bar:
            out = Replayer(trace, client, serve, compression=args.compression,
                           nodes=fleet.nodes, progress=bar.update, stop=stop,
                           hints=st.hints).run()
        if stop.is_set():
            return None
        time.sleep(0.5)  # let the last reports land
        books = ray.get(deployment.scheduler.summary.remote(), timeout=30)
        statuses = ray.get([a.status.remote() for a in deployment.agents], timeout=30)
    finally:
        deployment.shutdown()
        stack.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    policy_run = run_from_books(policy, out.records, books)
    return _Run(st.seed, policy, policy_run, out, books, list(statuses), link_mib_s)


def run_from_books(policy: str, records: Any, books: dict[str, Any]) -> Any:
    """A replay's ``PolicyRun``: its records at the client, its byte counts from the
    scheduler's summary (``books``)."""
    from kvprefetch.controlplane.sim.simulator import PolicyRun

    return PolicyRun(
        policy, records=records, prefetched_bytes=books["prefetch_model_bytes"],
        wasted_bytes=books["wasted_bytes_modelled"],
        prefetch_used_bytes=books["prefetch_used_bytes_modelled"],
        prefetches_over_budget=books["prefetches_over_budget"],
        warmup_bytes=books["warmup_bytes"],
        remote_bytes=books["prefetch_model_bytes"] + books["demand_model_bytes"],
        prefetches=books["prefetches"], prefetches_dropped=books["prefetches_dropped"],
        ttlb_s=books["ttlb_s"], lateness_s=books["lateness_s"], events=books["events"])


def _start_lmcache(args: argparse.Namespace, fleet: Any, remote: Any, tier_bytes: int,
                   link_mib_s: float | None, stack: contextlib.ExitStack) -> list[Any]:
    """One real ``lmcache server`` per node: L1 the size of the agents' own tier, L2 our
    adapter over the run's Valkey + S3 (its loads at the node's link rate)."""
    from kvprefetch.agents.lmcache.l2_adapter import plugin_adapter_json
    from kvprefetch.agents.lmcache.server import LMCacheServer

    adapter = plugin_adapter_json(valkey=remote.valkey, s3=remote.s3, tiered=remote.tiered,
                                  load_bandwidth_mib_s=link_mib_s or 0.0)
    servers = []
    for i in range(fleet.nodes):
        server = LMCacheServer(l2_adapter=adapter, chunk_size=args.chunk_tokens,
                               l1_size_gb=tier_bytes / GIB, transfer_mode="engine_driven")
        servers.append(stack.enter_context(server))
        log.info("node %d: lmcache server %s", i, server.http_url)
    return servers


def _lmcache_configs(args: argparse.Namespace, fleet: Any, server: Any
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The agent's and the engine's settings for one node's LMCache server."""
    from kvprefetch.agents.lmcache.backend import LMCacheBackendConfig
    from kvprefetch.agents.lmcache.engine_kv import LMCacheEngineConfig

    engine = LMCacheEngineConfig(
        port=server.port, http_url=server.http_url, chunk_size=args.chunk_tokens,
        token_bytes=max(4, int(fleet.model.kv_bytes_per_token * args.kv_scale)))
    agent = LMCacheBackendConfig(
        http_url=server.http_url, model_name=engine.model_name, chunk_size=args.chunk_tokens,
        hash_algorithm=server.hash_algorithm,
        chunk_bytes=engine.layout().chunk_bytes(args.chunk_tokens))
    return {"lmcache": agent}, {"lmcache": engine}


def link_rate_mib_s(fleet: Any, args: argparse.Namespace) -> float:
    """The fleet model's remote-read rate per node (Valkey; the NIC if slower), in real
    MiB per wall second: modelled bytes/s x kv_scale x compression."""
    modelled = min(fleet.node.nic_bytes_per_s, fleet.remote.valkey_gbyte_s_per_node * 1e9)
    return float(modelled * args.kv_scale * args.compression / MIB)


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    xs = sorted(values)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    return {"mean": round(sum(xs) / len(xs), 2), "p50": round(q(0.5), 2),
            "p90": round(q(0.9), 2), "max": round(xs[-1], 2)}


# ---------------------------------------------------------------------------------------------
# The report: pooled over seeds, plus per seed.
# ---------------------------------------------------------------------------------------------


def pooled_run(policy: str, runs: Sequence[Any]) -> Any:
    """One PolicyRun of several (the same policy over several seeds): records and transfer
    times together, counts and bytes summed."""
    from kvprefetch.controlplane.sim.simulator import PolicyRun

    out = PolicyRun(policy)
    for r in runs:
        out.records.extend(r.records)
        out.ttlb_s.extend(r.ttlb_s)
        out.lateness_s.extend(r.lateness_s)
        out.prefetched_bytes += r.prefetched_bytes
        out.wasted_bytes += r.wasted_bytes
        out.prefetch_used_bytes += r.prefetch_used_bytes
        out.remote_bytes += r.remote_bytes
        out.prefetches += r.prefetches
        out.prefetches_dropped += r.prefetches_dropped
        out.prefetches_cancelled += r.prefetches_cancelled
        out.prefetches_over_budget += r.prefetches_over_budget
        out.warmup_bytes += r.warmup_bytes
        out.events += r.events
    return out


def _live(runs: list[_Run]) -> dict[str, Any]:
    """The real system's side of one policy, over all its runs."""
    results = [r for one in runs for r in one.replay.results]
    ok = [r for r in results if not r.error]
    books = [one.books for one in runs]
    agents: dict[int, dict[str, int]] = {}
    for one in runs:
        for s in one.agents:
            a = agents.setdefault(s.node, {"node": s.node, "keys": 0, "used_bytes": 0,
                                           "orders_done": 0, "bytes_moved": 0})
            # keys and used bytes as at the end of the fullest run; work summed over runs
            a["keys"] = max(a["keys"], s.keys)
            a["used_bytes"] = max(a["used_bytes"], s.used_bytes)
            a["orders_done"] += s.orders_done
            a["bytes_moved"] += s.bytes_moved
    link = runs[0].link_mib_s if runs else None
    return {
        "link_mib_s": round(link, 3) if link is not None else None,
        # Control-plane time, wall milliseconds (not in the TTFT: see EngineEmulator.serve).
        "route_overhead_ms": _pcts([r.route_overhead_s * 1e3 for r in ok]),
        "gpu_overhead_ms": _pcts([r.gpu_overhead_s * 1e3 for r in ok]),
        "timeline_lag_ms": _pcts([r.lag_s * 1e3 for r in ok]),
        "real_bytes_moved": sum(b["prefetch_bytes"] + b["demand_bytes"] for b in books),
        "real_prefetch_bytes": sum(b["prefetch_bytes"] for b in books),
        "real_demand_bytes": sum(b["demand_bytes"] for b in books),
        "real_bytes_read_local": sum(r.read_bytes for r in results),
        "real_bytes_written": sum(r.written_bytes for r in results),
        "orders_sent": sum(b["orders_sent"] for b in books),
        "orders_failed": sum(b["orders_failed"] for b in books),
        "unrouted": sum(one.replay.unrouted for one in runs),
        "failed_requests": sum(one.replay.failed for one in runs),
        "hints_sent": sum(one.replay.hints_sent for one in runs),
        "hints_failed": sum(one.replay.hints_failed for one in runs),
        "replay_wall_s": round(sum(one.replay.wall_s for one in runs), 2),
        "agents": [agents[n] for n in sorted(agents)],
    }


def _policy_block(policy: str, runs: list[_Run]) -> tuple[dict[str, Any], list[SeedStat]]:
    from kvprefetch.controlplane.sim.metrics import summarize

    block = summarize(pooled_run(policy, [one.run for one in runs])).to_dict()
    block.update(_live(runs))
    per_seed = []
    for one in runs:
        r = summarize(one.run).returning
        per_seed.append(SeedStat(one.seed, r.ttft_mean_s, r.ttft_p90_s, r.requests))
    seeds = seed_summary(per_seed)
    block["returning"]["ttft_mean_ci95_s"] = seeds["ttft_mean_ci95_s"]
    block["per_seed"] = seeds["per_seed"]
    return block, per_seed


def _simulated(args: argparse.Namespace, fleet: Any, seeds: list[_SeedTrace],
               policies: list[str]) -> dict[str, Any]:
    """The simulator's figures for the same traces and the same client hints, pooled."""
    from kvprefetch.controlplane.core.policies import POLICIES
    from kvprefetch.controlplane.sim.metrics import summarize
    from kvprefetch.controlplane.sim.runner import run_policy

    out = {}
    for name in policies:
        runs = [run_policy(st.trace, fleet, POLICIES[name], args.predictor,
                           hints=st.hints if args.hints else None) for st in seeds]
        p = summarize(pooled_run(name, runs))
        out[name] = {"returning": p.returning.to_dict(), "ttft_mean_s": p.overall.ttft_mean_s,
                     "stall_s": p.stall_s}
    return out


def _report(args: argparse.Namespace, fleet: Any, seeds: list[_SeedTrace],
            runs: dict[str, list[_Run]], predictor: str, wall_s: float) -> dict[str, Any]:
    from kvprefetch.controlplane.base.types import HintKind
    from kvprefetch.controlplane.sim.metrics import gap_closure, working_set_peak_bytes

    per_trace = []
    for st in seeds:
        ws = working_set_peak_bytes(st.trace, fleet.model.kv_bytes_per_token)
        per_trace.append({
            "seed": st.seed, "requests": st.trace.requests, "sessions": len(st.trace.sessions),
            "working_set_peak_bytes": ws,
            "pressure_ratio": round(ws / max(1, fleet.local_capacity_bytes), 3)})
    ws_peak = max(t["working_set_peak_bytes"] for t in per_trace)
    trace = seeds[0].trace
    results: dict[str, Any] = {}
    stats: dict[str, list[SeedStat]] = {}
    for name, rs in runs.items():
        results[name], stats[name] = _policy_block(name, rs)
    planned = [h for st in seeds for h in st.hints]
    report: dict[str, Any] = {
        "meta": {
            "trace": trace.name, "trace_format": trace.source_format,
            "requests": sum(t["requests"] for t in per_trace),
            "sessions": sum(t["sessions"] for t in per_trace), "seed": args.seed,
            "repeats": len(seeds), "seeds": per_trace,
            "scenario": "live-demo", "predictor": args.predictor,
            "service_predictor": predictor, "model": fleet.model.name,
            "nodes": fleet.nodes, "working_set_peak_bytes": ws_peak,
            "local_capacity_bytes": fleet.local_capacity_bytes,
            "pressure_ratio": round(ws_peak / max(1, fleet.local_capacity_bytes), 3),
            "wall_s": round(wall_s, 3), "time_compression": args.compression,
            "kv_scale": args.kv_scale, "chunk_tokens": args.chunk_tokens,
            "link_emulation": args.link_emulation, "backend": args.backend,
            "sessions_per_seed": args.sessions, "turns": args.turns,
            "session_rate_per_s": args.session_rate,
            "hints": {"enabled": bool(args.hints), "coverage": args.hint_coverage,
                      "planned_per_policy": len(planned),
                      "planned_typing": sum(h.kind is HintKind.USER_TYPING for h in planned),
                      "planned_tool": sum(h.kind is HintKind.TOOL_RUNNING for h in planned)},
        },
        "policies": results,
        "simulated": _simulated(args, fleet, seeds, list(runs)),
    }
    if "ondemand" in stats and "predictive" in stats:
        diff = paired_difference(stats["ondemand"], stats["predictive"])
        if diff is not None:
            # A run with failed or unrouted requests lost part of its sessions: its means are
            # over other requests than its pair's.
            comparable = all(not (results[n]["failed_requests"] or results[n]["unrouted"])
                             for n in ("ondemand", "predictive"))
            report["comparison"] = {"baseline": "ondemand", "policy": "predictive",
                                    "comparable": comparable, "returning": diff}
    closure = gap_closure({name: p["returning"]["ttft_mean_s"] for name, p in results.items()})
    if closure is not None:
        report["gap_closure"] = closure
    return report


def _print(report: dict[str, Any]) -> None:
    meta = report["meta"]
    n = meta["repeats"]
    hints = meta["hints"]
    print(f"\nlive demo: {meta['requests']} requests of {meta['sessions']} sessions over {n} "
          f"arrival seed(s) from {meta['seed']} on {meta['nodes']} emulated nodes "
          f"({meta['model']}), {meta['time_compression']:g}x time compression, kv_scale "
          f"{meta['kv_scale']:.6g}; pressure up to {meta['pressure_ratio']:.2f}x; client hints "
          + (f"on ({hints['planned_per_policy']} per policy)" if hints["enabled"] else "off"))
    head = (f"{'policy':<11} {'ret':>5} {'ret mean':>9} {'ret p50':>8} {'ret p90':>8} "
            f"{'ret p99':>8} {'stall s':>8} {'TTLB s':>7} {'moved MiB':>10} "
            f"{'prefetch':>9} {'wasted':>7} {'sim mean':>9}")
    print("TTFT of returning requests in service seconds, pooled over the seeds; real MiB "
          "moved by the agents; prefetch/wasted in modelled GiB; sim = the simulator on the "
          "same traces and hints")
    print(head)
    print("-" * len(head))
    for name, p in report["policies"].items():
        r = p["returning"]
        sim = report["simulated"].get(name, {}).get("returning", {}).get("ttft_mean_s", 0.0)
        print(f"{name:<11} {r['requests']:>5} {r['ttft_mean_s']:>9.3f} {r['ttft_p50_s']:>8.3f} "
              f"{r['ttft_p90_s']:>8.3f} {r['ttft_p99_s']:>8.3f} {p['stall_s']:>8.1f} "
              f"{p.get('ttlb_mean_s', 0.0):>7.3f} {p['real_bytes_moved'] / MIB:>10.1f} "
              f"{p['prefetched_bytes'] / GIB:>9.1f} {p['wasted_bytes'] / GIB:>7.1f} "
              f"{sim:>9.3f}")
    print("returning TTFT per arrival seed, mean / p90 (s)"
          + (f"; 95% interval of the mean over the {n} per-seed means (Student t, {n - 1} "
             "dof)" if n > 1 else ""))
    for name, p in report["policies"].items():
        seeds = " | ".join(f"seed {s['seed']}: {s['ttft_mean_s']:.3f} / {s['ttft_p90_s']:.3f}"
                           for s in p["per_seed"])
        ci = p["returning"]["ttft_mean_ci95_s"]
        interval = f"; mean 95% CI [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
        print(f"  {name:<11} {seeds}{interval}")
    print("control-plane time per request, wall ms (measured, not in the TTFT above): "
          "route = gateway arrival -> engine; on-GPU = round trips while the GPU holds the "
          "request, beyond the transfer itself; lag = real run behind the GPU timeline")
    for name, p in report["policies"].items():
        ro, go, lag = p["route_overhead_ms"], p["gpu_overhead_ms"], p["timeline_lag_ms"]
        print(f"  {name:<11} route p50 {ro['p50']:.1f} p90 {ro['p90']:.1f} | on-GPU p50 "
              f"{go['p50']:.1f} p90 {go['p90']:.1f} | lag p90 {lag['p90']:.1f} max "
              f"{lag['max']:.1f}; demand orders {p['orders_sent'] - p['prefetches']}, "
              f"failed orders {p['orders_failed']}; hints sent {p['hints_sent']}")
    for name, p in report["policies"].items():
        if p["failed_requests"] or p["unrouted"] or p["hints_failed"]:
            print(f"WARNING: {name}: {p['failed_requests']} failed and {p['unrouted']} unrouted "
                  f"requests, {p['hints_failed']} hints not accepted: its figures are not "
                  "comparable (see the log)")
    pol = report["policies"]
    if "ondemand" in pol and "predictive" in pol:
        on, pr = pol["ondemand"]["returning"], pol["predictive"]["returning"]
        better = (pr["ttft_mean_s"] < on["ttft_mean_s"], pr["ttft_p90_s"] < on["ttft_p90_s"])
        verdict = "lower" if all(better) else "NOT lower (see the table)"
        print(f"predictive vs ondemand, pooled returning TTFT mean and p90: {verdict}: mean "
              f"{on['ttft_mean_s']:.3f} -> {pr['ttft_mean_s']:.3f} s, p90 "
              f"{on['ttft_p90_s']:.3f} -> {pr['ttft_p90_s']:.3f} s")
        comparison = report.get("comparison", {})
        diff = comparison.get("returning")
        if diff is not None and not comparison["comparable"]:
            print("  no paired comparison: a run had failed or unrouted requests")
        elif diff is not None:
            ci = diff["ttft_mean_diff_ci95_s"]
            sure = ""
            if ci is not None:
                sure = (f", 95% CI [{ci[0]:+.3f}, {ci[1]:+.3f}]: "
                        + ("predictive lower" if ci[1] < 0 else
                           "predictive higher" if ci[0] > 0 else
                           "no difference this many seeds can tell"))
            print(f"  paired by seed, predictive - ondemand returning mean: "
                  f"{diff['ttft_mean_diff_s']:+.3f} s{sure}")
    print(f"wall time {meta['wall_s']:.1f} s")


def write_plot(report: dict[str, Any], path: str | Path) -> None:
    """One PNG: the pooled TTFT CDF of returning requests per policy; each policy's
    per-seed returning means with the 95% interval of their mean; prefetched bytes, useful
    vs wasted. Written atomically (a temporary file, then a rename)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = report["policies"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, p in policies.items():
        qs = p.get("returning_ttft_quantiles_s")
        if qs:
            ax1.plot(qs, [i / (len(qs) - 1) for i in range(len(qs))], label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT of returning requests (s)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title(f"TTFT CDF, returning, pooled over {report['meta']['repeats']} seed(s)")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()
    for x, p in enumerate(policies.values()):
        means = [s["ttft_mean_s"] for s in p["per_seed"]]
        ax2.scatter([x] * len(means), means, s=18, alpha=0.6, color=f"C{x}")
        ci = p["returning"]["ttft_mean_ci95_s"]
        mid = sum(means) / len(means) if means else 0.0
        err = [[mid - ci[0]], [ci[1] - mid]] if ci else None
        ax2.errorbar([x + 0.15], [mid], yerr=err, fmt="o", capsize=6, color=f"C{x}")
    ax2.set_xticks(range(len(policies)), list(policies))
    ax2.set_xlim(-0.5, len(policies) - 0.5)
    ax2.set_ylabel("returning TTFT mean (s)")
    ax2.set_title("per-seed means (dots), mean and 95% CI")
    ax2.grid(True, axis="y", alpha=0.3)
    names = list(policies)
    useful = [(policies[n]["prefetched_bytes"] - policies[n]["wasted_bytes"]) / GIB
              for n in names]
    wasted = [policies[n]["wasted_bytes"] / GIB for n in names]
    ax3.bar(names, useful, label="useful")
    ax3.bar(names, wasted, bottom=useful, label="wasted")
    ax3.set_ylabel("prefetched GiB (modelled), all seeds")
    ax3.set_title("Prefetched bytes: useful vs wasted")
    ax3.legend()
    meta = report["meta"]
    fig.suptitle(f"live demo, {meta['trace']} - {meta['nodes']} x {meta['model']}, "
                 f"{meta['time_compression']:g}x")
    fig.tight_layout()
    save_figure_atomic(fig, path)
