"""Train/test splits of a trace that never put one session on both sides.

The unit of a split is the *group*: a session together with its child sessions (Claude Code
sub-agents share their parent's context, so they go where the parent goes).

* ``session``: a seeded random choice of groups for the test side.
* ``time``: groups ordered by their first start time; the latest ones are the test side.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from kvprefetch.controlplane.base.errors import PredictorError
from kvprefetch.controlplane.base.types import Trace, TraceSession
from kvprefetch.predictors.features import session_group


class SplitKind(StrEnum):
    SESSION = "session"
    TIME = "time"


@dataclass(frozen=True)
class TraceSplit:
    train: Trace
    test: Trace
    kind: SplitKind
    test_fraction: float
    seed: int

    def describe(self) -> dict[str, object]:
        return {
            "split": self.kind.value,
            "test_fraction": self.test_fraction,
            "seed": self.seed,
            "train_sessions": len(self.train.sessions),
            "test_sessions": len(self.test.sessions),
        }


def split_trace(
    trace: Trace, kind: SplitKind | str = SplitKind.SESSION, test_fraction: float = 0.25,
    seed: int = 0,
) -> TraceSplit:
    """Split ``trace`` into train and test sessions by group (deterministic)."""
    kind = SplitKind(kind)
    if not 0.0 <= test_fraction < 1.0:
        raise PredictorError(f"test fraction must be in [0, 1), got {test_fraction}")
    groups: dict[str, list[TraceSession]] = {}
    for s in trace.sessions:
        groups.setdefault(session_group(s), []).append(s)
    names = sorted(groups)
    n_test = round(len(names) * test_fraction)
    if test_fraction > 0 and n_test == 0 and len(names) >= 2:
        n_test = 1
    if test_fraction > 0 and n_test >= len(names):
        raise PredictorError(
            f"trace {trace.name!r} has {len(names)} session group(s): too few to hold out "
            f"{test_fraction:.0%} for testing"
        )
    if kind is SplitKind.SESSION:
        rng = np.random.default_rng(seed)
        test_names = {names[i] for i in rng.permutation(len(names))[:n_test]}
    else:
        by_time = sorted(names, key=lambda g: (min(s.start_s for s in groups[g]), g))
        test_names = set(by_time[len(by_time) - n_test :]) if n_test else set()
    train = tuple(s for s in trace.sessions if session_group(s) not in test_names)
    test = tuple(s for s in trace.sessions if session_group(s) in test_names)
    return TraceSplit(
        Trace(f"{trace.name}[train]", train, trace.source_format, trace.block_tokens),
        Trace(f"{trace.name}[test]", test, trace.source_format, trace.block_tokens),
        kind, test_fraction, seed,
    )
