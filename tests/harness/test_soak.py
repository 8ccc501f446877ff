"""A short soak (``kvprefetch bench soak`` in small): steady traffic against the scheduler
service in process, sessions opening, turning and closing (the live set stays the same),
the journal on and compacted every few thousand records, stand-in agents completing every
order and stand-in engines reporting their HBM. After warm-up, the memory must stay flat:
the resident set, the objects the garbage collector tracks, and every collection the
service reports.

The bounds are sized against the traffic: the window after warm-up closes a few thousand
sessions and sends tens of thousands of events even on a busy 2-core machine, so a leak of
one closed session's SessionInfo each (which the reported sizes do not show), or of a few
hundred bytes per event, goes over them, while the bounded de-duplication memory filling
and the allocator's noise stay under them.

The soak runs in a fresh process: in the test session's own process (large after the other
tests) the allocator's noise alone can exceed the resident-set bound."""

from __future__ import annotations

import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor

import pytest

from kvprefetch.controlplane.harness.soak import SoakSpec, run_soak

MIB = 1 << 20
SPEC = SoakSpec(duration_s=22.0, warmup_s=6.0, live_sessions=300, mean_turns=4,
                sample_interval_s=0.5, journal_compact_records=3_000, hashed_share=1.0,
                seed=15)
#: After warm-up: growth of the resident set (bytes) and of gc-tracked objects allowed
#: between the first and the last samples (medians of three).
MAX_RSS_GROWTH_BYTES = 4 * MIB
MAX_GC_OBJECTS_GROWTH = 1_500


def _median(samples: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in samples)


@pytest.mark.slow
def test_memory_stays_flat_under_steady_traffic() -> None:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        result = pool.submit(run_soak, SPEC).result(timeout=300)
    samples = result["samples"]
    after = [s for s in samples if s["t_s"] >= SPEC.warmup_s]
    first, last = after[:3], after[-3:]
    rss_growth = _median(last, "rss_bytes") - _median(first, "rss_bytes")
    gc_growth = _median(last, "gc_objects") - _median(first, "gc_objects")
    facts = (f"{result['events_after_warmup']:,} events and "
             f"{result['sessions_closed_after_warmup']:,} sessions closed after warm-up; "
             f"RSS {_median(first, 'rss_bytes') / MIB:.1f} -> "
             f"{_median(last, 'rss_bytes') / MIB:.1f} MiB; gc objects "
             f"{_median(first, 'gc_objects'):,.0f} -> {_median(last, 'gc_objects'):,.0f}; "
             f"{result['journal_compactions']} compactions, {result['orders_done']:,} "
             "orders done")

    # The traffic is what the bounds assume, and nothing went wrong.
    assert result["lost_events"] == 0 and result["loop_errors"] == 0, facts
    assert result["sessions_closed_after_warmup"] >= 1_000, facts
    assert result["events_after_warmup"] >= 10_000, facts
    assert result["orders_done"] >= 1_000 and result["journal_compactions"] >= 2, facts

    # Every collection the service reports is bounded by the live set.
    end = result["end"]["sizes"]
    assert end["sessions"] <= SPEC.live_sessions, (end, facts)
    assert end["core_sessions"] == end["sessions"], (end, facts)
    assert end["timers"] <= 2 * SPEC.live_sessions, (end, facts)
    assert end["orders_in_flight"] <= SPEC.live_sessions, (end, facts)
    # The journal is compacted: on disk, the live sessions' records and one interval's.
    assert max(s["journal_bytes"] for s in after) < 8 * MIB, facts

    # Memory is flat after warm-up.
    assert rss_growth <= MAX_RSS_GROWTH_BYTES, facts
    assert result["rss_growth"] <= 0.10, facts
    assert gc_growth <= MAX_GC_OBJECTS_GROWTH, facts
