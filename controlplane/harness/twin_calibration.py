"""A demo's twin calibrated from the live run's own measurements: the rates the engine
showed (remote loads, the node tier's lookup, prefill, a fixed cost per request) fitted from
the run's per-request rows or the engine's calibration pass, and the fleet model that
carries them into the simulator. Pure: no I/O."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class LineFit:
    """``y = intercept + slope * x`` by least squares over ``points`` points, both
    coefficients >= 0 (a negative one is set to 0 and the other refitted)."""

    intercept: float
    slope: float
    points: int


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LineFit:
    """Least-squares line through ``(xs, ys)`` with non-negative coefficients. One point,
    or all x equal: the line through the origin and the mean point when x > 0, else the
    mean of y as the intercept. ValueError on no points or unequal lengths."""
    n = len(xs)
    if n == 0 or n != len(ys):
        raise ValueError("fit_line needs as many x as y, at least one")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return LineFit(0.0, my / mx, n) if mx > 0 else LineFit(max(0.0, my), 0.0, n)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    if slope < 0:
        return LineFit(max(0.0, my), 0.0, n)
    if intercept < 0:  # through the origin
        sxx0 = sum(x * x for x in xs)
        return LineFit(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sxx0, n)
    return LineFit(intercept, slope, n)


@dataclass(frozen=True, slots=True)
class Calibration:
    """Costs on the service clock (service seconds; bytes are modelled KV bytes). A field
    left None keeps the fleet model's own figure. ``sources`` names, per field set, the
    measurement it comes from."""

    #: The remote store's read, per modelled byte, and its fixed cost per load.
    load_s_per_byte: float | None = None
    load_latency_s: float | None = None
    #: Moving reused KV from the node tier into the engine, per modelled byte (the
    #: host-to-GPU copy and the tier's lookup together).
    local_s_per_byte: float | None = None
    #: Prefill of one new token (at the fleet's reference prompt length).
    prefill_s_per_token: float | None = None
    #: Fixed cost per request before its first token, beyond the copy, prefill and one
    #: decode step.
    request_overhead_s: float | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 15) if isinstance(v, float) else v)
                for k, v in asdict(self).items()}


def _ok(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in rows if not r.get("error")]


def calibrate_emulated(rows: Iterable[Mapping[str, Any]], *, compression: float,
                       kv_scale: float, kv_bytes_per_token: int,
                       h2d_bytes_per_s: float) -> tuple[Calibration, dict[str, Any]]:
    """The emulated engine's costs from its per-request rows
    (:func:`kvprefetch.controlplane.harness.demo_report.request_rows`), on the service
    clock (wall x ``compression``):

    - the remote link: each demand load the request dispatched, its wall wait against the
      bytes the agent moved (real bytes / ``kv_scale`` = modelled bytes), fitted as a fixed
      cost plus a rate;
    - the node tier: each lookup (LMCache's retrieve) that found tokens, its wall wait
      against the modelled bytes it found, fitted through the origin and added to the
      host-to-GPU copy (``h2d_bytes_per_s``) that the engine times as the cost model does.

    Prefill is the cost model's in the emulator: not calibrated. Returns the calibration
    and the fits (points, coefficients) for the report."""
    ok = _ok(rows)
    c = compression
    loads = [r for r in ok if r.get("demand_bytes_moved", 0) > 0]
    lookups = [r for r in ok if r.get("looked_up") and r.get("lookup_tokens", 0) > 0]
    fits: dict[str, Any] = {}
    kw: dict[str, Any] = {"sources": {}}
    if loads:
        fit = fit_line([r["demand_bytes_moved"] / kv_scale for r in loads],
                       [r["transfer_wall_s"] * c for r in loads])
        fits["demand_load"] = asdict(fit)
        if fit.slope > 0:
            kw["load_s_per_byte"], kw["load_latency_s"] = fit.slope, fit.intercept
            kw["sources"]["load"] = (f"{fit.points} demand loads of the run: wait at the GPU "
                                     "against the bytes the agent moved (least squares)")
    if lookups:
        xs = [r["lookup_tokens"] * kv_bytes_per_token for r in lookups]
        ys = [r["lookup_wall_s"] * c for r in lookups]
        sxx = sum(x * x for x in xs)
        per_byte = sum(x * y for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
        fits["lookup"] = {"points": len(lookups), "s_per_byte": per_byte,
                          "mean_s": sum(ys) / len(ys)}
        if per_byte > 0:
            kw["local_s_per_byte"] = 1.0 / h2d_bytes_per_s + per_byte
            kw["sources"]["local"] = (f"{len(lookups)} node-tier lookups of the run (LMCache "
                                      "retrieve): wait against bytes found, through the "
                                      "origin, plus the cost model's host-to-GPU copy")
    return Calibration(**kw), fits


def calibrate_vllm(calibration: Mapping[str, float], *, compression: float,
                   kv_bytes_per_token: int, decode_s_per_token: float = 0.0) -> Calibration:
    """The vLLM CPU engine's costs from its calibration pass
    (:func:`kvprefetch.controlplane.harness.vllm_nodes.calibrate`: TTFT of one prompt cold,
    vLLM-cached, from LMCache's L1 and from L2), on the service clock: prefill per token =
    (cold - cached) / tokens; the node tier per byte = (L1 - cached) / bytes; the remote
    link per byte = (L2 - L1) / bytes; the fixed cost per request = the vLLM-cached TTFT
    (every token but the last one cached: the request's path through the server and one
    step) less ``decode_s_per_token`` (service seconds, the step the cost model counts)."""
    tokens = float(calibration["prompt_tokens"])
    nbytes = tokens * kv_bytes_per_token
    c = compression
    cold, cached = calibration["ttft_cold_s"], calibration["ttft_vllm_cached_s"]
    l1, l2 = calibration["ttft_l1_s"], calibration["ttft_l2_s"]
    src = f"the calibration pass at {int(tokens)} tokens (medians of TTFT)"
    kw: dict[str, Any] = {"sources": {}}
    if cold > cached:
        kw["prefill_s_per_token"] = (cold - cached) * c / tokens
        kw["sources"]["prefill"] = f"{src}: (cold - vLLM-cached) / tokens"
    if l1 > cached:
        kw["local_s_per_byte"] = (l1 - cached) * c / nbytes
        kw["sources"]["local"] = f"{src}: (from L1 - vLLM-cached) / bytes"
    if cached * c > decode_s_per_token:
        kw["request_overhead_s"] = cached * c - decode_s_per_token
        kw["sources"]["request_overhead"] = f"{src}: vLLM-cached less one modelled decode step"
    if l2 > l1:
        kw["load_s_per_byte"] = (l2 - l1) * c / nbytes
        kw["load_latency_s"] = 0.0
        kw["sources"]["load"] = f"{src}: (from L2 - from L1) / bytes"
    return Calibration(**kw)


def calibrated_fleet(fleet: Any, cal: Calibration, *, reference_prompt_tokens: int = 2048
                     ) -> Any:
    """``fleet`` (a :class:`~kvprefetch.controlplane.base.config.FleetConfig`) with the
    calibrated costs: the Valkey read rate and latency (the NIC raised so that it does not
    cap them), the host-to-GPU rate, the prefill FLOP rate (so that a prompt of
    ``reference_prompt_tokens`` new tokens takes the calibrated time per token)."""
    node: dict[str, Any] = {}
    remote: dict[str, Any] = {}
    if cal.load_s_per_byte:
        rate = 1.0 / cal.load_s_per_byte
        remote["valkey_gbyte_s_per_node"] = rate / 1e9
        node["nic_gbps"] = max(fleet.node.nic_gbps, rate * 8 / 1e9 * 1.000001)
    if cal.load_latency_s is not None:
        remote["valkey_latency_s"] = cal.load_latency_s
    if cal.local_s_per_byte:
        node["h2d_gbyte_s"] = 1.0 / cal.local_s_per_byte / 1e9
    if cal.request_overhead_s is not None:
        node["request_overhead_s"] = cal.request_overhead_s
    if cal.prefill_s_per_token:
        n = reference_prompt_tokens
        flops = fleet.model.prefill_flops(n, 0) / (n * cal.prefill_s_per_token)
        node["peak_flops_per_gpu"] = flops / (fleet.node.gpus * fleet.node.prefill_mfu)
    if not all(math.isfinite(v) for v in (*node.values(), *remote.values())):
        raise ValueError(f"calibration gives a non-finite rate: {cal}")
    raw = fleet.model_dump()
    raw["node"].update(node)
    raw["remote"].update(remote)
    return type(fleet).model_validate(raw)
