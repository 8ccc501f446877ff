"""The sweep's index of idle sessions: which of them a sweep must forecast again.

The sweep (:meth:`Prefetcher.sweep <kvprefetch.controlplane.core.prefetcher.Prefetcher.sweep>`)
re-plans, every ``planner.sweep_interval_s``, the idle sessions whose KV left their home
node (*due*: no armed order, fewer than the per-idle prefetches, silent for at most
``planner.max_lead_s``).
Asking the predictor about every one of them makes each sweep O(due sessions), nearly all of
them answered "no order".

A predictor that implements :class:`GatedPredictor` forecasts an idle session from a law
shared by a group of sessions (``adaptive``: its bucket's survival curve) and the session's
silence, and says over which silences a forecast of the group may pass the planner's gate
(``p_return >= min_p_return`` and ``confidence >= min_confidence``); everywhere else the
planner makes no order and the sweep changes nothing. :class:`IdleIndex` keeps the due
sessions by group and by the slot of their last finish (silences grow together, so the
sessions whose silence is in an interval are the ones whose last finish is in one), and a
sweep forecasts only the sessions in their group's region: the same orders, in the same
order, as forecasting them all. ``gate_region`` reads each group's law as a forecast would
(a learned law is rebuilt when read), so it is called once per sweep for every group with a
due session, which leaves the predictor in the state the forecasts of all of them would.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Hashable, Iterator, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["GatedPredictor", "IdleIndex"]


@runtime_checkable
class GatedPredictor(Protocol):
    """What lets the sweep skip idle sessions whose forecast cannot pass the gate.

    ``idle_group`` is called after each event of a session that is due (cheap, no side
    effects); ``gate_region`` once per sweep per group with a due session."""

    def idle_group(self, session_id: str) -> Hashable | None:
        """The group whose shared law, with the silence, makes the session's forecast;
        None when no law is read (it is then always forecast). Changes only with an event
        of the session that the predictor observes."""
        ...

    def gate_region(self, group: Hashable, *, min_p_return: float, min_confidence: float,
                    max_silence_s: float) -> Sequence[tuple[float, float]]:
        """Closed silence intervals outside which no forecast of the group passes the gate
        (up to ``max_silence_s`` at least); reading the law as one forecast would."""
        ...


class _Group:
    """Due sessions of one group by slot of last finish."""

    __slots__ = ("keys", "slots")

    def __init__(self) -> None:
        self.slots: dict[int, set[str]] = {}
        #: the slots' numbers, sorted
        self.keys: list[int] = []

    def add(self, slot: int, sid: str) -> None:
        members = self.slots.get(slot)
        if members is None:
            members = self.slots[slot] = set()
            if self.keys and slot < self.keys[-1]:
                insort(self.keys, slot)
            else:
                self.keys.append(slot)
        members.add(sid)

    def discard(self, slot: int, sid: str) -> None:
        members = self.slots.get(slot)
        if members is None:
            return
        members.discard(sid)
        if not members:
            del self.slots[slot]
            del self.keys[bisect_left(self.keys, slot)]


class IdleIndex:
    """Due sessions by group (:class:`GatedPredictor`) and slot of their last finish."""

    def __init__(self, slot_s: float) -> None:
        if not slot_s > 0:
            raise ValueError(f"slot_s must be > 0, got {slot_s}")
        self._slot_s = slot_s
        #: sid -> (group or None, last finish, slot)
        self._where: dict[str, tuple[Hashable | None, float, int]] = {}
        self._groups: dict[Hashable, _Group] = {}
        self._ungrouped: set[str] = set()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, sid: object) -> bool:
        return sid in self._where

    def _slot(self, t: float) -> int:
        return math.floor(t / self._slot_s)

    def put(self, sid: str, group: Hashable | None, last_finish_s: float) -> None:
        held = self._where.get(sid)
        if held is not None:
            if held[0] == group and held[1] == last_finish_s:
                return
            self.remove(sid)
        slot = self._slot(last_finish_s)
        self._where[sid] = (group, last_finish_s, slot)
        if group is None:
            self._ungrouped.add(sid)
            return
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group()
        g.add(slot, sid)

    def remove(self, sid: str) -> None:
        held = self._where.pop(sid, None)
        if held is None:
            return
        group, _, slot = held
        if group is None:
            self._ungrouped.discard(sid)
            return
        g = self._groups.get(group)
        if g is None:
            return
        g.discard(slot, sid)
        if not g.keys:
            del self._groups[group]

    def expire(self, now_s: float, horizon_s: float) -> list[str]:
        """Remove and return the sessions silent for more than ``horizon_s`` at ``now_s``
        (``now_s - last_finish > horizon_s``, exactly as written)."""
        gone: list[str] = []
        # Whole slots two slots clear of the cut-off go without a look at their members
        # (rounding in the slot of a time cannot move it that far); the rest one by one.
        whole = self._slot(now_s - horizon_s) - 2
        where = self._where
        for g in list(self._groups.values()):
            keys = g.keys
            while keys and keys[0] <= whole:
                gone.extend(g.slots.pop(keys.pop(0)))
            for slot in keys[:3]:
                gone.extend(sid for sid in g.slots[slot]
                            if now_s - where[sid][1] > horizon_s)
        gone.extend(sid for sid in self._ungrouped if now_s - where[sid][1] > horizon_s)
        for sid in gone:
            if sid in where:
                self.remove(sid)
        # Slots popped above left their members in _where: remove() found no slot for
        # them, and their group may now be empty.
        for group in [k for k, g in self._groups.items() if not g.keys]:
            del self._groups[group]
        return gone

    def groups(self) -> list[Hashable]:
        """Groups with at least one due session."""
        return list(self._groups)

    def members_in(self, group: Hashable, now_s: float,
                   region: Sequence[tuple[float, float]]) -> Iterator[str]:
        """The group's sessions whose silence at ``now_s`` may be in ``region`` (and a few
        next to it: whole slots, one slot of slack each side)."""
        g = self._groups.get(group)
        if g is None:
            return
        keys = g.keys
        for lo, hi in region:
            first = 0 if math.isinf(hi) else bisect_left(keys, self._slot(now_s - hi) - 1)
            last = bisect_right(keys, self._slot(now_s - lo) + 1)
            for slot in keys[first:last]:
                yield from g.slots[slot]

    def ungrouped(self) -> set[str]:
        return self._ungrouped
