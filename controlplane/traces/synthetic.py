"""Synthetic multi-turn traffic: sessions no predictor was trained on (``--trace synthetic:NAME``).

The shared traces are what the shipped predictor learned from (Claude Code) or have few
returning requests (Mooncake); a gain measured only there may be a fit to them. This module
draws traffic from a parametric session model with laws of its own, seeded and
deterministic, so policies can be judged on regimes those traces do not cover.

A session (:class:`SyntheticProfile` holds every parameter):

* its length in turns is geometric with mean ``turns_mean``; its first input is
  log-normal (``context_median_tokens``, ``context_sigma``);
* each response ends with ``tool_use`` with probability ``tool_share``, else ``end_turn``;
  the next request follows after a tool run (log-normal ``tool_median_s``, ``tool_sigma``)
  or a person's think time (log-normal ``think_median_s``, ``think_sigma``), to which a
  human turn adds, with probability ``away_share``, an absence (log-normal
  ``away_median_s``, sigma 1): the minutes-to-hours pauses of real users;
* the next input is the whole previous context (input + output, all of it reusable) plus
  the new tokens: a tool result (log-normal ``tool_result_median_tokens``, sigma 1.2) or
  user text (``user_median_tokens``, sigma 1); with probability ``reset_share`` the context
  is compacted instead (a fresh first input, nothing reused);
* outputs are log-normal (``output_median_tokens``, sigma 0.9);
* ``stop_reasons`` False drops the stop reasons from the trace (clients that do not report
  them), leaving the laws as they are.

Named profiles (:data:`PROFILES`): ``agentic`` (short tool loops, ~85% tool turns),
``chat`` (human turns only, long absences), ``research`` (slow tools, large contexts),
``agentic-nostop`` (``agentic`` without stop reasons) and ``random``, whose parameters are
themselves drawn from wide ranges by the seed (a new regime per seed). For comparison,
the shared Claude Code set has a median of 33 turns per session, 86% of its gaps after
``tool_use`` (median 9 s, p90 71 s), human gaps with median 265 s and p90 ~1 h, and inputs
with median 107k tokens.

Sessions are closed loop (``gap_s`` set) and have no clock of their own: like Claude Code
they are placed by the arrival process (:mod:`.arrivals`), so ``--load`` scales the
session rate. ``--seed`` draws both the sessions and their starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TypeGuard

import numpy as np

from kvprefetch.controlplane.base.errors import UnknownFormatError
from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession
from kvprefetch.controlplane.traces.arrivals import ArrivalOptions, assign_start_times

__all__ = ["FORMAT_NAME", "PREFIX", "PROFILES", "SyntheticProfile", "is_synthetic",
           "load_synthetic", "synthetic_trace"]

FORMAT_NAME = "synthetic"
#: ``--trace synthetic:NAME[:SESSIONS]`` selects a profile (and a number of sessions).
PREFIX = "synthetic:"
DEFAULT_SESSIONS = 300
#: Block size of the generated traces (tokens); only the reuse granularity of reports.
BLOCK_TOKENS = 256
#: Seconds per output token and per request, only to estimate a session's duration for
#: the concurrency arrival process (the simulator times responses itself).
_DECODE_S_PER_TOKEN = 0.03
_REQUEST_OVERHEAD_S = 0.5


@dataclass(frozen=True, slots=True)
class SyntheticProfile:
    """The laws of one kind of traffic (see the module docstring)."""

    turns_mean: float
    tool_share: float
    tool_median_s: float
    tool_sigma: float
    think_median_s: float
    think_sigma: float
    away_share: float
    away_median_s: float
    context_median_tokens: float
    context_sigma: float
    tool_result_median_tokens: float
    user_median_tokens: float
    output_median_tokens: float
    reset_share: float = 0.0
    stop_reasons: bool = True

    def __post_init__(self) -> None:
        for name in ("tool_share", "away_share", "reset_share"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        for name in ("turns_mean", "tool_median_s", "think_median_s", "away_median_s",
                     "context_median_tokens", "tool_result_median_tokens",
                     "user_median_tokens", "output_median_tokens"):
            v = getattr(self, name)
            if not (v > 0.0 and math.isfinite(v)):
                raise ValueError(f"{name} must be positive and finite, got {v!r}")
        if self.turns_mean < 1.0:
            raise ValueError(f"turns_mean must be >= 1, got {self.turns_mean!r}")


_AGENTIC = SyntheticProfile(
    turns_mean=50, tool_share=0.85, tool_median_s=6.0, tool_sigma=1.3,
    think_median_s=120.0, think_sigma=1.6, away_share=0.05, away_median_s=1800.0,
    context_median_tokens=30_000, context_sigma=0.8, tool_result_median_tokens=1_200,
    user_median_tokens=150, output_median_tokens=250, reset_share=0.02)

#: The named profiles; ``random`` is drawn per seed (:func:`random_profile`).
PROFILES: dict[str, SyntheticProfile | None] = {
    "agentic": _AGENTIC,
    "agentic-nostop": replace(_AGENTIC, stop_reasons=False),
    "chat": SyntheticProfile(
        turns_mean=12, tool_share=0.0, tool_median_s=1.0, tool_sigma=0.5,
        think_median_s=45.0, think_sigma=1.2, away_share=0.2, away_median_s=3600.0,
        context_median_tokens=20_000, context_sigma=1.0, tool_result_median_tokens=1.0,
        user_median_tokens=300, output_median_tokens=400),
    "research": SyntheticProfile(
        turns_mean=30, tool_share=0.7, tool_median_s=60.0, tool_sigma=1.0,
        think_median_s=300.0, think_sigma=1.5, away_share=0.1, away_median_s=3600.0,
        context_median_tokens=60_000, context_sigma=0.6, tool_result_median_tokens=4_000,
        user_median_tokens=200, output_median_tokens=500, reset_share=0.03),
    "random": None,
}


def random_profile(rng: np.random.Generator) -> SyntheticProfile:
    """A profile with every parameter drawn from a wide range (log-uniform for scales)."""
    def logu(lo: float, hi: float) -> float:
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    return SyntheticProfile(
        turns_mean=logu(3, 120), tool_share=float(rng.uniform(0.0, 0.95)),
        tool_median_s=logu(1, 300), tool_sigma=float(rng.uniform(0.3, 2.0)),
        think_median_s=logu(5, 900), think_sigma=float(rng.uniform(0.5, 2.0)),
        away_share=float(rng.uniform(0.0, 0.3)), away_median_s=logu(300, 14_400),
        context_median_tokens=logu(2_000, 120_000), context_sigma=float(rng.uniform(0.3, 1.2)),
        tool_result_median_tokens=logu(100, 8_000), user_median_tokens=logu(20, 2_000),
        output_median_tokens=logu(50, 2_000), reset_share=float(rng.uniform(0.0, 0.05)),
        stop_reasons=bool(rng.uniform() < 0.7))


def is_synthetic(path: object) -> TypeGuard[str]:
    """Whether a ``--trace`` value names synthetic traffic rather than a file."""
    return isinstance(path, str) and path.startswith(PREFIX)


def _parse(spec: str) -> tuple[str, int]:
    """(profile, sessions) of ``synthetic:NAME[:SESSIONS]``."""
    rest = spec[len(PREFIX):]
    name, _, count = rest.partition(":")
    if name not in PROFILES:
        raise UnknownFormatError(
            f"unknown synthetic profile {name!r} in {spec!r}; known: {', '.join(PROFILES)} "
            f"(write synthetic:NAME or synthetic:NAME:SESSIONS)")
    if not count:
        return name, DEFAULT_SESSIONS
    if not count.isdigit() or int(count) < 1:
        raise UnknownFormatError(
            f"{spec!r}: the number of sessions after the profile must be a positive "
            f"integer, got {count!r}")
    return name, int(count)


def _lognormal(rng: np.random.Generator, median: float, sigma: float) -> float:
    return float(median * math.exp(sigma * rng.standard_normal()))


def _session(rng: np.random.Generator, p: SyntheticProfile, sid: str
             ) -> tuple[tuple[TraceRequest, ...], float]:
    """One session's requests and its duration estimate (for the concurrency process)."""
    turns = int(rng.geometric(1.0 / p.turns_mean))
    requests: list[TraceRequest] = []
    t = 0.0
    context = 0  # tokens of KV after the previous response
    stop: str | None = None
    for turn in range(turns):
        if turn == 0 or rng.uniform() < p.reset_share:
            inp = max(16, round(_lognormal(rng, p.context_median_tokens, p.context_sigma)))
            reused = 0
        else:
            new = (p.tool_result_median_tokens if stop == "tool_use"
                   else p.user_median_tokens)
            sigma = 1.2 if stop == "tool_use" else 1.0
            inp = context + max(1, round(_lognormal(rng, new, sigma)))
            reused = context
        if turn == 0:
            gap: float | None = None
        elif stop == "tool_use":
            gap = _lognormal(rng, p.tool_median_s, p.tool_sigma)
        else:
            gap = _lognormal(rng, p.think_median_s, p.think_sigma)
            if rng.uniform() < p.away_share:
                gap += _lognormal(rng, p.away_median_s, 1.0)
        out = max(1, round(_lognormal(rng, p.output_median_tokens, 0.9)))
        last = turn == turns - 1
        stop = "end_turn" if last or rng.uniform() >= p.tool_share else "tool_use"
        t += gap or 0.0
        requests.append(TraceRequest(
            session_id=sid, turn=turn, offset_s=t, input_tokens=inp, output_tokens=out,
            reused_tokens=reused, gap_s=gap, stop_reason=stop if p.stop_reasons else None))
        t += _REQUEST_OVERHEAD_S + _DECODE_S_PER_TOKEN * out
        context = inp + out
    return tuple(requests), t


def synthetic_trace(profile: SyntheticProfile, sessions: int, *, seed: int = 0,
                    arrivals: ArrivalOptions | None = None, name: str = "synthetic") -> Trace:
    """``sessions`` sessions drawn from ``profile`` (seeded), placed by ``arrivals``."""
    if sessions < 1:
        raise ValueError(f"sessions must be >= 1, got {sessions}")
    rng = np.random.default_rng([seed, 0x5EED])
    width = len(str(sessions - 1))
    drawn = [_session(rng, profile, f"syn-{i:0{width}d}") for i in range(sessions)]
    starts = assign_start_times([d for _, d in drawn], arrivals or ArrivalOptions(), seed)
    out = [TraceSession(session_id=reqs[0].session_id, start_s=start, requests=reqs)
           for (reqs, _), start in zip(drawn, starts, strict=True)]
    out.sort(key=lambda s: (s.start_s, s.session_id))
    return Trace(name, tuple(out), FORMAT_NAME, BLOCK_TOKENS)


def load_synthetic(spec: str, *, seed: int = 0, arrivals: ArrivalOptions | None = None,
                   limit_sessions: int | None = None) -> Trace:
    """The trace ``synthetic:NAME[:SESSIONS]`` names, for ``seed`` (see the module
    docstring). ``random`` draws its profile from the seed too."""
    name, sessions = _parse(spec)
    if limit_sessions is not None:
        sessions = max(1, min(sessions, limit_sessions))
    profile = PROFILES[name]
    if profile is None:
        profile = random_profile(np.random.default_rng([seed, 0xA11]))
    return synthetic_trace(profile, sessions, seed=seed, arrivals=arrivals,
                           name=f"synthetic-{name}")
