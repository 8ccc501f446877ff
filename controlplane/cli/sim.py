"""``kvprefetch sim``: replay a trace over a modelled fleet and compare policies."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.shards import MAX_SHARDS
from kvprefetch.controlplane.base.types import Trace
from kvprefetch.controlplane.cli.options import (
    add_test_fraction_option,
    add_trace_format_option,
    load_trace_option,
    non_negative_int,
    positive_float,
    positive_int,
    require_extra_module,
)
from kvprefetch.controlplane.cli.predictor_option import add_predictor_option
from kvprefetch.controlplane.core.engines import DEFAULT_ENGINE, ENGINES
from kvprefetch.controlplane.core.policies import PEER_POLICIES, POLICY_NAMES, SIM_POLICIES

if TYPE_CHECKING:
    from kvprefetch.controlplane.core.policies import PolicySpec
    from kvprefetch.controlplane.sim.hints import HintConfig

#: Default Poisson rate of session starts for the simulator: one every 75 s. On the public
#: Claude Code set with the default 4-node 8B fleet this puts the peak working set of live
#: sessions at the pressure seen in production, >= 3x the fleet's HBM + DRAM tiers (the
#: figures: docs/results/constants.md).
DEFAULT_SIM_SESSION_RATE_PER_S = 1.0 / 75.0

EPILOG = """examples:
  kvprefetch sim                                   # bundled Claude Code slice, all policies
  kvprefetch sim --trace kv-cache-tester/traces --json out/sim.json --plot out/sim.png
  kvprefetch sim --policies ondemand,predictive --predictor ewma --load 1.5
  kvprefetch sim --scenario cold-start --nodes 2 --model 70b
  kvprefetch sim --trace kv-cache-tester/traces --scenario scale-out --nodes 3

The full public Claude Code set (kv-cache-tester/traces above) is the traces/ folder of
github.com/callanjfox/kv-cache-tester; the bundled slice is 24 of its files.
  kvprefetch sim --nodes 1 --hints user_typing,tool_running --hint-coverage 0.5  # half hint
  kvprefetch sim --nodes 2 --engine local --ablation   # what each forecast decision is worth
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--trace", help="trace file or directory (default: the bundled Claude Code "
                   "slice shipped with kvprefetch), or synthetic:PROFILE[:SESSIONS] for "
                   "traffic drawn from --seed (profiles: agentic, agentic-nostop, chat, "
                   "research, random)")
    add_trace_format_option(p)
    p.add_argument("--policies", default="all",
                   help=f"comma-separated subset of: {', '.join(SIM_POLICIES)} (default: "
                   f"all, which runs {', '.join(POLICY_NAMES)}; the peers "
                   f"{', '.join(PEER_POLICIES)} are published retention policies, simulator "
                   "only; 'reactive' is predictive with its forecasts off and 'perfect' "
                   "predictive fed the true next arrivals)")
    add_engine_argument(p)
    p.add_argument("--ablation", action="store_true",
                   help="also run predictive with each forecast-driven decision's forecast "
                   "switched off alone (predictive-no-dram, -no-prefetch, -no-advice, "
                   "-no-hints; those the engine profile offers): what each decision is worth")
    add_predictor_option(p, several=False, default="default",
                         help="the one predictor of the 'predictive' policy: a name, "
                         "NAME:ARTIFACT or module:Class (default: 'default', the shipped "
                         "model: empirical gap survival per stop reason, trained on half of "
                         "the public Claude Code set, adapting online to the replayed "
                         "traffic)")
    p.add_argument("--fleet", help="fleet YAML (model, node, remote, router, planner)")
    p.add_argument("--nodes", type=positive_int, help="number of GPU nodes (default 4)")
    p.add_argument("--model", help="model preset: 8b or 70b (default 8b)")
    arr = p.add_mutually_exclusive_group()
    arr.add_argument("--session-rate", type=positive_float,
                     help=f"Poisson rate of session starts per second (default "
                     f"{DEFAULT_SIM_SESSION_RATE_PER_S:.4f}, one per 75 s)")
    arr.add_argument("--concurrency", type=positive_int,
                     help="instead of a rate: keep this many sessions live")
    p.add_argument("--load", type=positive_float, default=1.0,
                   help="multiply the session arrival rate (load sweeps; default 1.0); "
                        "traces with timestamps of their own (mooncake, azure, journal) "
                        "run on a clock this many times faster")
    p.add_argument("--limit-sessions", type=positive_int,
                   help="replay only the first N sessions")
    add_test_fraction_option(
        p, allow_zero=False,
        help="replay only the held-out session groups of the split that `kvprefetch train "
        "--test-fraction FRACTION --seed SPLIT_SEED` trains on the rest of (so a trained "
        "predictor is scored on sessions it never saw)")
    p.add_argument("--split-seed", type=non_negative_int, default=0,
                   help="seed of --test-fraction's split (default 0)")
    p.add_argument("--scenario", default="default", choices=("default", "cold-start",
                                                              "scale-out"),
                   help="cold-start: send every context once, clear all local tiers, send "
                   "them all again; scale-out: the last of --nodes joins (empty) at the "
                   "median session start")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the arrival process")
    add_hint_arguments(p)
    add_shard_arguments(p)
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                   help="parallel worker processes, one policy each (default: all cores)")
    p.add_argument("--json", dest="json_out", help="write the report as JSON here (atomic)")
    p.add_argument("--plot", help="write a PNG: TTFT CDF per policy, useful vs wasted bytes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def with_ablations(policies: tuple[PolicySpec, ...], engine: str, *, hints: bool
                   ) -> tuple[PolicySpec, ...]:
    """``policies`` with predictive's ablations (:mod:`kvprefetch.controlplane.sim.ablation`)
    right after it; a :class:`ConfigError` when predictive is not among them."""
    from kvprefetch.controlplane.core.engines import engine_profile
    from kvprefetch.controlplane.sim.ablation import ablations

    names = [p.name for p in policies]
    if "predictive" not in names:
        raise ConfigError("--ablation needs predictive in --policies")
    at = names.index("predictive") + 1
    extra = ablations(policies[at - 1], engine_profile(engine), hints=hints)
    return (*policies[:at], *extra, *policies[at:])


def add_engine_argument(p: argparse.ArgumentParser) -> None:
    """``--engine`` (``sim`` and ``sim-grid``): the engine profile every policy runs on."""
    profiles = "; ".join(f"{e.name}: {e.summary}" for e in ENGINES.values())
    p.add_argument("--engine", default=DEFAULT_ENGINE, choices=tuple(ENGINES), metavar="PROFILE",
                   help=f"engine profile every policy runs on, which grants each of them the "
                   f"same mechanisms (default {DEFAULT_ENGINE}). {profiles}")


def add_shard_arguments(p: argparse.ArgumentParser) -> None:
    """``--shards`` and ``--shared-tier`` (``sim`` and ``sim-grid``); checked by
    :func:`check_shards`."""
    p.add_argument("--shards", type=int, default=1, metavar="N",
                   help="split the decisions over N scheduler shards, as `service.shards` "
                   "does live: each session is decided by the shard it hashes to, each shard "
                   "plans with 1/N of every node's DRAM tier, link and Valkey rate and its "
                   "own copy of the predictor (default 1)")
    p.add_argument("--shared-tier", action="store_true",
                   help="with --shards: the shards book each node's whole DRAM tier and the "
                   "node evicts least recently used first across them when they overfill it, "
                   "as `service.shard_tier: shared` does live (default: 1/N each)")


def check_shards(args: argparse.Namespace) -> None:
    """Refuse a shard count out of range and ``--shared-tier`` without shards."""
    if not 1 <= args.shards <= MAX_SHARDS:
        raise ConfigError(f"--shards must be 1-{MAX_SHARDS}, got {args.shards}")
    if args.shared_tier and args.shards == 1:
        raise ConfigError("--shared-tier needs --shards N with N >= 2")


def add_hint_arguments(p: argparse.ArgumentParser) -> None:
    """The client-hint flags (``sim`` and ``sim-grid``); read them with :func:`hint_config`."""
    hints = p.add_argument_group(
        "client hints", "simulated clients that tell the control plane what comes next "
        "(planned from the trace; without --hints none are sent)")
    hints.add_argument("--hints", metavar="KINDS",
                       help="comma-separated hint kinds the clients send: 'user_typing' "
                       "(the user started typing the next human turn, no ETA; typing speed "
                       "drawn per session from Dhakal et al., CHI 2018) and/or 'tool_running' "
                       "(a tool call runs, with an ETA of its duration). The policies that "
                       "run --predictor "
                       "read them through the 'hinted' wrapper; 'perfect' does not need them. "
                       "'session_closed' is the live service's: a trace ends its sessions "
                       "itself")
    hints.add_argument("--hint-coverage", type=float, metavar="F",
                       help="share of session groups (a client with its sub-agents) that send "
                       "hints, in [0, 1] (default 1.0); raising it with the same --hint-seed "
                       "only adds clients")
    hints.add_argument("--hint-seed", type=non_negative_int, metavar="N",
                       help="seed of the hint draws: which clients hint, typing speeds, ETA "
                       "noise (default: --seed)")
    hints.add_argument("--tool-eta-sigma", type=float, metavar="S",
                       help="sigma of the log-normal noise (median 1) on tool-run ETAs: ETA = "
                       "true gap x exp(N(0, S)); 0 = exact ETAs (default 0.5)")
    hints.add_argument("--typing-abandon-share", type=float, metavar="F",
                       help="share of typing hints that lead nowhere (the user stops typing; no "
                       "request follows for a while), in [0, 1) (default 0)")


def held_out(trace: Trace, fraction: float, seed: int, predictor_spec: str) -> Trace:
    """The test side of a session-group split; refuses a model trained on any of it."""
    from kvprefetch.predictors.registry import load as load_predictor
    from kvprefetch.predictors.splits import split_trace

    test = split_trace(trace, "session", fraction, seed).test
    groups = {s.parent_id or s.session_id for s in test.sessions}
    if predictor_spec != "oracle":
        model = load_predictor(predictor_spec, trace=test)
        seen = set(getattr(model, "train_info", {}).get("train_groups", ()))
        if seen & groups:
            raise ConfigError(
                f"predictor {predictor_spec!r} was trained on {len(seen & groups)} of the "
                f"{len(groups)} held-out session groups; train it with the same "
                "--test-fraction and --seed"
            )
    return test


#: Hint flags that set one HintConfig field: (flag, argparse dest, field).
_HINT_FIELD_FLAGS = (
    ("--hint-coverage", "hint_coverage", "coverage"),
    ("--tool-eta-sigma", "tool_eta_sigma", "tool_eta_sigma"),
    ("--typing-abandon-share", "typing_abandon_share", "abandon_share"),
)


def hint_config(args: argparse.Namespace, *, seed: int | None = None) -> HintConfig | None:
    """The client hints of the command line, or None without --hints; a bad value is a
    :class:`ConfigError` that names its flag. The hint draws use ``--hint-seed``, else
    ``seed`` (the run's seed; default ``args.seed``)."""
    from kvprefetch.controlplane.sim.hints import HintConfig, parse_hint_kinds

    given = [flag for flag, dest, _ in _HINT_FIELD_FLAGS if getattr(args, dest) is not None]
    if args.hint_seed is not None:
        given.append("--hint-seed")
    if args.hints is None:
        if given:
            raise ConfigError(f"{given[0]} needs --hints (e.g. --hints "
                              "user_typing,tool_running)")
        return None
    if "session_closed" in (name.strip() for name in args.hints.split(",")):
        raise ConfigError("--hints: session_closed is a hint the live service takes; a "
                          "replayed trace ends its sessions itself, so the simulated clients "
                          "send only user_typing and tool_running")
    try:
        kinds = parse_hint_kinds(args.hints)
    except ConfigError as exc:
        raise ConfigError(f"--hints: {exc}") from exc
    fields: dict[str, float] = {}
    for flag, dest, name in _HINT_FIELD_FLAGS:
        value = getattr(args, dest)
        if value is None:
            continue
        try:
            HintConfig(**{name: value})
        except ConfigError as exc:
            raise ConfigError(f"{flag}: {exc}") from exc
        fields[name] = value
    if args.hint_seed is not None:
        seed = args.hint_seed
    elif seed is None:
        seed = args.seed
    return HintConfig(kinds=kinds, seed=seed, **fields)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvprefetch.controlplane.base.atomic import write_atomic
    from kvprefetch.controlplane.base.config import default_fleet, load_fleet
    from kvprefetch.controlplane.core.policies import parse_policies
    from kvprefetch.controlplane.sim.report import format_table, write_plot
    from kvprefetch.controlplane.sim.runner import SimOptions, run_policies
    from kvprefetch.controlplane.sim.scenarios import apply_scenario
    from kvprefetch.controlplane.sim.simulator import clamp_to_window
    from kvprefetch.controlplane.traces import ArrivalOptions, bundled_trace_path
    from kvprefetch.predictors.registry import resolve

    if args.plot:
        require_extra_module("matplotlib")  # before the run, not after it
    policies = parse_policies(args.policies, peers=True)
    check_shards(args)
    hints = hint_config(args)
    if args.ablation:
        policies = with_ablations(policies, args.engine, hints=hints is not None)
    resolve(args.predictor)  # fail fast on an unknown predictor, before loading anything
    if args.fleet:
        overrides: dict[str, object] = {}
        if args.nodes is not None:
            overrides["nodes"] = args.nodes
        if args.model is not None:
            overrides["model"] = args.model
        fleet = load_fleet(args.fleet, overrides=overrides)
    else:
        fleet = default_fleet(args.model or "8b", 4 if args.nodes is None else args.nodes)
    if args.concurrency is not None:
        arrivals = ArrivalOptions(concurrency=args.concurrency, load=args.load)
    else:
        try:
            arrivals = ArrivalOptions(
                session_rate_per_s=args.session_rate or DEFAULT_SIM_SESSION_RATE_PER_S,
                load=args.load,
            )
        except ValueError as exc:
            raise ConfigError(f"--session-rate/--load: {exc}") from exc
    path = args.trace or bundled_trace_path("claude-code")
    show = not args.no_progress and sys.stderr.isatty()
    trace = load_trace_option(path, args.trace_format, arrivals=arrivals, seed=args.seed,
                              limit_sessions=args.limit_sessions, progress=show)
    if args.test_fraction is not None:
        trace = held_out(trace, args.test_fraction, args.split_seed, args.predictor)
    trace, events = apply_scenario(trace, args.scenario)
    trace = clamp_to_window(trace, fleet.model.max_context_tokens)
    options = SimOptions(predictor=args.predictor, seed=args.seed,
                         clear_tiers_at_s=events.clear_tiers_at_s, join_at_s=events.join_at_s,
                         scenario=args.scenario, workers=args.workers, hints=hints,
                         shards=args.shards, shared_tier=args.shared_tier,
                         engine=args.engine)
    bar = tqdm(total=trace.requests * len(policies), unit="req", desc="replaying",
               disable=args.no_progress, mininterval=0.5)
    with bar:
        report = run_policies(trace, fleet, policies, options, progress=bar.update)
    print(format_table(report))
    if report.meta.pressure_ratio < 3:
        remedy = ("replay a larger trace" if fleet.nodes <= 1
                  else "lower --nodes or replay a larger trace")
        print(f"note: pressure {report.meta.pressure_ratio:.2f}x is below the >= 3x of "
              "production fleets, so local tiers hold much of the working set and prefetch "
              f"matters less; {remedy}")
    if args.json_out:
        write_atomic(args.json_out, [report.to_json().encode()])
        print(f"wrote {args.json_out}")
    if args.plot:
        write_plot(report.to_dict(), args.plot)
        print(f"wrote {args.plot}")
    return 0
