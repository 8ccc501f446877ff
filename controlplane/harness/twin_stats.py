"""Paired per-request statistics for a demo and its twin: requests paired by (seed, session,
turn), and seeded bootstrap intervals of the mean difference and of the ratio of means.
Pure: no I/O, no clock; the random generator is seeded by the caller."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: A request's identity across runs of the same trace: (arrival seed, session id, turn).
RequestKey = tuple[int, str, int]


@dataclass(frozen=True, slots=True)
class PairedStats:
    """``b`` against ``a`` over paired requests (seconds): the means, ``b - a`` and
    ``b / a`` of the means, each with its bootstrap interval (percentile method: resample
    the pairs with replacement, the 2.5th and 97.5th percentile of the statistic)."""

    pairs: int
    mean_a_s: float
    mean_b_s: float
    diff_s: float
    diff_ci95_s: tuple[float, float]
    ratio: float
    ratio_ci95: tuple[float, float]
    resamples: int
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return {"pairs": self.pairs, "mean_a_s": round(self.mean_a_s, 6),
                "mean_b_s": round(self.mean_b_s, 6), "diff_s": round(self.diff_s, 6),
                "diff_ci95_s": [round(v, 6) for v in self.diff_ci95_s],
                "ratio": round(self.ratio, 6),
                "ratio_ci95": [round(v, 6) for v in self.ratio_ci95],
                "resamples": self.resamples, "seed": self.seed}


def request_key(row: Mapping[str, Any]) -> RequestKey:
    """The pairing key of a per-request row (``seed``, ``session``, ``turn``)."""
    return (int(row["seed"]), str(row["session"]), int(row["turn"]))


def pair_rows(a: Iterable[Mapping[str, Any]], b: Iterable[Mapping[str, Any]], *,
              returning_only: bool = True) -> list[tuple[float, float]]:
    """``(a's ttft_s, b's ttft_s)`` of the requests both hold, by :func:`request_key`, in
    key order; rows with an ``error`` and, with ``returning_only``, first turns
    (``returning`` false) are left out. A key twice on one side is a ValueError (the rows
    are not one replay per seed)."""

    def index(rows: Iterable[Mapping[str, Any]], side: str) -> dict[RequestKey, float]:
        out: dict[RequestKey, float] = {}
        for row in rows:
            if row.get("error") or (returning_only and not row.get("returning", True)):
                continue
            key = request_key(row)
            if key in out:
                raise ValueError(f"request {key} appears twice in {side}")
            out[key] = float(row["ttft_s"])
        return out

    ia, ib = index(a, "a"), index(b, "b")
    return [(ia[k], ib[k]) for k in sorted(ia.keys() & ib.keys())]


def _percentile(sorted_xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted values, linear between order statistics."""
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def bootstrap_paired(pairs: Sequence[tuple[float, float]], *, resamples: int = 2000,
                     seed: int = 0) -> PairedStats:
    """:class:`PairedStats` of ``pairs`` ((a, b) per request): ``resamples`` bootstrap
    draws of len(pairs) pairs each from ``random.Random(seed)``. ValueError on no pairs or
    ``resamples`` < 1; a ratio whose denominator mean is 0 is infinite."""
    n = len(pairs)
    if n == 0:
        raise ValueError("no paired requests")
    if resamples < 1:
        raise ValueError("resamples must be >= 1")
    sa = sum(a for a, _ in pairs)
    sb = sum(b for _, b in pairs)
    rng = random.Random(seed)
    diffs, ratios = [], []
    idx = range(n)
    for _ in range(resamples):
        pick = rng.choices(idx, k=n)
        ra = sum(pairs[i][0] for i in pick)
        rb = sum(pairs[i][1] for i in pick)
        diffs.append((rb - ra) / n)
        ratios.append(rb / ra if ra else float("inf"))
    diffs.sort()
    ratios.sort()
    return PairedStats(
        pairs=n, mean_a_s=sa / n, mean_b_s=sb / n, diff_s=(sb - sa) / n,
        diff_ci95_s=(_percentile(diffs, 0.025), _percentile(diffs, 0.975)),
        ratio=sb / sa if sa else float("inf"),
        ratio_ci95=(_percentile(ratios, 0.025), _percentile(ratios, 0.975)),
        resamples=resamples, seed=seed)
