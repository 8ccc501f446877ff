"""``kvprefetch demo`` (the emulated engine): the live control plane on a local Ray runtime,
moving real bytes.

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
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvprefetch.controlplane.harness.demo_report import (
    Run,
    SeedTrace,
    build_report,
    machine_verdict,
    run_from_books,
    write_outputs,
)
from kvprefetch.controlplane.harness.demo_twin import print_twin, twin_section

log = logging.getLogger(__name__)
GIB = 1 << 30
MIB = 1 << 20


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


def seed_trace(args: argparse.Namespace, trace: Any, seed: int) -> SeedTrace:
    """``trace`` with the client hints it implies for arrival seed ``seed`` (none with
    ``--no-hints``)."""
    if not args.hints:
        return SeedTrace(seed, trace, ())
    from kvprefetch.controlplane.sim.hints import HintConfig, plan_hints

    return SeedTrace(seed, trace, plan_hints(trace, HintConfig(coverage=args.hint_coverage,
                                                               seed=seed)))


def run_demo(args: argparse.Namespace) -> int:
    """``kvprefetch demo`` on the emulated engine (see the module docstring): exit code 0,
    130 when stopped by Ctrl-C."""
    from kvprefetch.controlplane.base.config import fleet_from_dict
    from kvprefetch.controlplane.base.errors import ConfigError
    from kvprefetch.controlplane.core.policies import parse_policies

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
    seeds = [seed_trace(args, build_trace(args, fleet.model.max_context_tokens, args.seed + i),
                        args.seed + i) for i in range(args.repeats)]
    stop = threading.Event()
    started = time.perf_counter()
    with sigint_stops(stop):
        runs = _run(args, fleet, [p.name for p in policies], seeds, service_predictor, stop)
    if runs is None:
        return 130
    report = build_report(args, fleet, seeds, runs, service_predictor,
                     time.perf_counter() - started)
    report["twin"] = emulated_twin(args, fleet, seeds, report)
    print_report(report)
    print_twin(report)
    write_outputs(args, report)
    return 0


def emulated_twin(args: argparse.Namespace, fleet: Any, seeds: list[SeedTrace],
                  report: dict[str, Any]) -> dict[str, Any]:
    """The report's calibrated twin (:mod:`.demo_twin`): the remote link and the node
    tier's lookup fitted from this run's per-request rows, all policies together."""
    from kvprefetch.controlplane.harness.twin_calibration import calibrate_emulated

    rows = [r for p in report["policies"].values() for r in p["per_request"]]
    cal, fits = calibrate_emulated(rows, compression=args.compression, kv_scale=args.kv_scale,
                                   kv_bytes_per_token=fleet.model.kv_bytes_per_token,
                                   h2d_bytes_per_s=fleet.node.h2d_gbyte_s * 1e9)
    return twin_section(report, seeds, fleet, cal, predictor=args.predictor,
                        hints=bool(args.hints), fits=fits)


def _run(args: argparse.Namespace, fleet: Any, policies: list[str], seeds: list[SeedTrace],
         predictor: str, stop: threading.Event) -> dict[str, list[Run]] | None:
    """Every (seed, policy) run, on one Ray runtime and one Valkey + S3; None if stopped."""
    import ray

    from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
    from kvprefetch.controlplane.base.actors import NAMESPACE, node_resource

    runs: dict[str, list[Run]] = {p: [] for p in policies}
    with contextlib.ExitStack() as stack:
        valkey = stack.enter_context(EmbeddedValkey(aof=True))  # write-back pins
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


def _print_run(one: Run, repeats: int) -> None:
    from kvprefetch.controlplane.sim.metrics import summarize

    r = summarize(one.run).returning
    print(f"  seed {one.seed} {one.policy}: {r.requests} returning, TTFT mean "
          f"{r.ttft_mean_s:.3f} s, p90 {r.ttft_p90_s:.3f} s; {one.replay.hints_sent} hints; "
          f"replay {one.replay.wall_s:.1f} s", file=sys.stderr, flush=True)


def _run_policy(args: argparse.Namespace, fleet: Any, policy: str, st: SeedTrace,
                predictor: str, valkey: Any, s3: Any, stop: threading.Event) -> Run | None:
    import ray
    from tqdm import tqdm

    from kvprefetch.agents.agent import AgentConfig, RemoteStoreConfig
    from kvprefetch.agents.backends.registry import backend_spec
    from kvprefetch.agents.engine_emulator import EngineConfig, ServeRequest, ServeResult
    from kvprefetch.agents.stores.local import LocalTierConfig
    from kvprefetch.agents.stores.tiered import TieredStoreConfig
    from kvprefetch.agents.transfer import TransferConfig
    from kvprefetch.controlplane.harness.replay import Replayer
    from kvprefetch.controlplane.live.connect import connect
    from kvprefetch.controlplane.live.ray_app import deploy, local_placements
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
    # Fresh node servers (LMCache's) per run, for a backend that needs one: their L1 must
    # not carry over from the last run.
    stack = contextlib.ExitStack()
    servers = (_start_lmcache(args, fleet, remote, tier_bytes, link_mib_s, stack)
               if backend_spec(args.backend).server is not None else [])
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
    return Run(st.seed, policy, policy_run, out, books, list(statuses), link_mib_s)


def _start_lmcache(args: argparse.Namespace, fleet: Any, remote: Any, tier_bytes: int,
                   link_mib_s: float | None, stack: contextlib.ExitStack) -> list[Any]:
    """One real ``lmcache server`` per node: L1 the size of the agents' own tier, L2 our
    adapter over the run's Valkey + S3 (its loads at the node's link rate)."""
    from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json
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
    from kvprefetch.agents.backends.lmcache.warmer import LMCacheBackendConfig
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


def print_report(report: dict[str, Any]) -> None:
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
    refused = machine_verdict(report["machine"]) if "machine" in report else None
    if refused is not None:
        print(refused)
    elif "ondemand" in pol and "predictive" in pol:
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
