"""Session start times for traces without a shared clock (Claude Code: every file starts at 0).

Two arrival processes, both seeded and deterministic (same seed, same sessions, same starts):

* **Poisson** (``session_rate_per_s``): session starts form a Poisson process of rate
  ``session_rate_per_s * load``; the first session starts at 0.
* **Target concurrency** (``concurrency``): ``round(concurrency * load)`` slots (at least 1);
  each slot runs one session at a time and starts the next one the moment its session's
  trace duration has elapsed, so at most that many sessions are live at once. The first
  session of each slot starts at a uniform random time in ``[0, mean duration)``, which spreads
  the start-up burst the way a system already in steady state would look.

Sessions are taken in a seeded random order, so a different seed mixes long and short
sessions differently. Child sessions (sub-agents) are not arrivals: they start at their
parent's start plus their offset in the parent.

Traces with a clock of their own (Mooncake, Azure, a journal) keep their timestamps; for
them ``load`` scales the clock (:func:`scale_clock`: load 2 replays the same requests in
half the time), so a load sweep means the same on every trace.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvprefetch.controlplane.base.types import Trace

#: Default Poisson rate of session starts when neither a rate nor a concurrency is given:
#: one new session every 60 s. With the shared Claude Code set (mean session length about
#: 3.2 h, median 1 h) this keeps on the order of 100-200 sessions live, a busy but realistic
#: load for a small fleet.
DEFAULT_SESSION_RATE_PER_S: float = 1.0 / 60.0


class ArrivalOptions(BaseModel):
    """How sessions of a trace without a shared clock are placed on the replay clock.

    Exactly one of ``session_rate_per_s`` and ``concurrency`` is set; when neither is given
    the Poisson process with :data:`DEFAULT_SESSION_RATE_PER_S` is used. ``load`` scales the
    rate (or the number of concurrency slots) for load sweeps.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_rate_per_s: float | None = Field(default=None, gt=0.0)
    concurrency: int | None = Field(default=None, ge=1)
    load: float = Field(default=1.0, gt=0.0)

    @model_validator(mode="before")
    @classmethod
    def _default_to_poisson(cls, data: Any) -> Any:
        if isinstance(data, dict):
            rate = data.get("session_rate_per_s")
            slots = data.get("concurrency")
            if rate is not None and slots is not None:
                raise ValueError("set exactly one of session_rate_per_s and concurrency")
            if rate is None and slots is None:
                data = {**data, "session_rate_per_s": DEFAULT_SESSION_RATE_PER_S}
        return data

    @model_validator(mode="after")
    def _exactly_one(self) -> Self:
        if (self.session_rate_per_s is None) == (self.concurrency is None):
            raise ValueError("set exactly one of session_rate_per_s and concurrency")
        return self

    @property
    def effective_rate_per_s(self) -> float | None:
        return None if self.session_rate_per_s is None else self.session_rate_per_s * self.load

    @property
    def effective_concurrency(self) -> int | None:
        return None if self.concurrency is None else max(1, round(self.concurrency * self.load))


def assign_start_times(
    durations_s: Sequence[float], options: ArrivalOptions, seed: int
) -> list[float]:
    """Start time of each session (same order as ``durations_s``), on the replay clock.

    ``durations_s[i]`` is how long session ``i`` stays live (its trace duration); only the
    concurrency process uses it. Pure function of its arguments.
    """
    n = len(durations_s)
    if n == 0:
        return []
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    starts = [0.0] * n
    rate = options.effective_rate_per_s
    if rate is not None:
        gaps = rng.exponential(1.0 / rate, size=n)
        gaps[0] = 0.0
        for position, when in zip(order, np.cumsum(gaps), strict=True):
            starts[int(position)] = float(when)
        return starts
    slots = options.effective_concurrency
    assert slots is not None  # guaranteed by ArrivalOptions
    mean_duration_s = float(np.mean(durations_s))
    initial = np.sort(rng.uniform(0.0, mean_duration_s, size=min(slots, n)))
    initial[0] = 0.0
    free_at: list[float] = [float(x) for x in initial]
    heapq.heapify(free_at)
    for position in order:
        start = heapq.heappop(free_at)
        starts[int(position)] = start
        heapq.heappush(free_at, start + max(0.0, float(durations_s[int(position)])))
    return starts


def scale_clock(trace: Trace, load: float) -> Trace:
    """``trace`` replayed at ``load`` times its rate: every session's start and every
    open-loop request's offset divided by ``load`` (sessions stay in their order). A
    closed-loop request's ``gap_s`` (the client's think or tool time) is the client's, not
    the arrival process's, and is kept."""
    if not load > 0.0:
        raise ValueError(f"load must be > 0, got {load}")
    if load == 1.0:
        return trace
    k = 1.0 / load
    sessions = tuple(
        replace(s, start_s=s.start_s * k,
                requests=tuple(r if r.gap_s is not None else replace(r, offset_s=r.offset_s * k)
                               for r in s.requests))
        for s in trace.sessions)
    return replace(trace, sessions=sessions)
