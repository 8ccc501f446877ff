"""What the ``lmcache-mp`` backend believes LMCache's L1 holds, session by session.

The scheduler names a session's chunks by position (chunk keys such as
``tenant/session/000003``); LMCache names them by content (the chained chunk hash of
:mod:`kvprefetch.agents.lmcache.keys`). :class:`L1Residency` keeps both for each session
whose last warm completed: its chunk keys, and the chunk hash each keyed chunk has in L1.
:class:`~kvprefetch.agents.backends.lmcache.warmer.LMCacheWarmer` adds a session when a warm
completes and forgets it on evict advice; when LMCache reports chunk hashes gone from L1
(:mod:`kvprefetch.agents.lmcache.kv_events`), :meth:`L1Residency.removed` turns them back
into the chunk keys that left, which the agent reports to the scheduler as the tier's own
evictions.

A removal can overtake the warm it undoes (LMCache publishes events off the request path):
:meth:`L1Residency.mark` taken before a warm, passed to :meth:`L1Residency.add` after it,
makes the warm's record stop at the first chunk removed in between (the last ``RECENT``
removed hashes are remembered for this; a warm older than that history is recorded up to
nothing, and all its keys are returned as gone).

A lookup in LMCache stops at the first chunk L1 lacks, so a session that loses chunk ``i``
loses the use of every chunk after it: it keeps chunks ``0 .. i-1`` here and reports the
rest. One hash may stand for chunks of several sessions (a shared prefix): an eviction
reports each of them. A removal record names hashes without their cache salt, so a chunk
two tenants hold under the same tokens reports both when either copy goes (a report too
many costs the scheduler a re-plan; one too few would leave its books wrong).

Bounded: at most ``max_chunks`` (session, hashed chunk) entries; past that the sessions
warmed longest ago are dropped and their keys returned, for the caller to report as no
longer vouched for. Thread-safe; no I/O.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Default bound on (session, hashed chunk) entries: far more chunks than an L1 of a few
#: hundred GiB holds at a megabyte or more per chunk.
MAX_CHUNKS = 1 << 20
#: Removed chunk hashes remembered for :meth:`L1Residency.add`'s ``since``.
RECENT = 1 << 16


@dataclass(frozen=True, slots=True)
class _Warm:
    """One session's warm chunks: ``hashes[i]`` is chunk ``keys[i]``'s hash; keys past
    ``len(hashes)`` (a trailing partial chunk LMCache never keys) have none."""

    keys: tuple[str, ...]
    hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class ResidencyStats:
    sessions: int
    #: (session, hashed chunk) entries held.
    chunks: int
    #: Chunk keys :meth:`L1Residency.removed` returned (LMCache dropped them from L1).
    removed_keys: int
    #: Sessions dropped to stay within ``max_chunks``.
    dropped_sessions: int
    #: Sessions :meth:`L1Residency.withdraw_all` forgot (after a gap in LMCache's events).
    withdrawn_sessions: int


class L1Residency:
    """The sessions the backend warmed into L1, by chunk key and by chunk hash (see the
    module docstring). Sessions are ``tenant/session`` wire names."""

    def __init__(self, max_chunks: int = MAX_CHUNKS) -> None:
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be positive, got {max_chunks}")
        self._max = max_chunks
        self._lock = threading.Lock()
        #: Oldest warm first.
        self._sessions: OrderedDict[str, _Warm] = OrderedDict()
        #: chunk hash -> {session: the chunk's index in that session}.
        self._by_hash: dict[bytes, dict[str, int]] = {}
        self._held: set[str] = set()
        self._chunks = 0
        self._removed_keys = self._dropped = self._withdrawn = 0
        #: One step per :meth:`removed` call; hash -> the step that last removed it.
        self._step = 0
        self._recent: OrderedDict[bytes, int] = OrderedDict()
        #: The newest step whose hashes fell out of ``_recent``.
        self._forgotten_step = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def mark(self) -> int:
        """The point in the removals a warm starts at, for :meth:`add`'s ``since``."""
        with self._lock:
            return self._step

    def add(self, session: str, keys: Sequence[str], hashes: Sequence[bytes], *,
            since: int | None = None) -> list[str]:
        """A warm of ``session`` completed: ``keys`` are resident, chunk ``keys[i]`` under
        ``hashes[i]`` (``hashes`` may be shorter: its partial tail, or no hashes at all
        when nobody listens to LMCache's events). Replaces the session's earlier warm.
        With ``since`` (:meth:`mark` before the warm), chunks from the first one removed
        since then on are not recorded. Returns the keys that are not resident after all
        and those of sessions dropped to stay within the bound (oldest first)."""
        if len(hashes) > len(keys):
            raise ValueError(f"{len(hashes)} chunk hashes for {len(keys)} chunk keys")
        with self._lock:
            self._forget(session)
            cut = self._removed_since(hashes, since)
            gone = list(keys[cut:]) if cut is not None else []
            if cut is not None:
                keys, hashes = keys[:cut], hashes[:cut]
                self._removed_keys += len(gone)
            if not keys:
                return gone
            warm = _Warm(tuple(keys), tuple(hashes))
            self._sessions[session] = warm
            self._held.update(warm.keys)
            for index, chunk_hash in enumerate(warm.hashes):
                self._by_hash.setdefault(chunk_hash, {})[session] = index
            self._chunks += len(warm.hashes)
            while self._chunks > self._max and len(self._sessions) > 1:
                oldest = next(iter(self._sessions))
                gone.extend(self._sessions[oldest].keys)
                self._forget(oldest)
                self._dropped += 1
            return gone

    def forget(self, session: str) -> None:
        """The session left L1 by our own doing (evict advice): nothing to report."""
        with self._lock:
            self._forget(session)

    def removed(self, chunk_hashes: Iterable[bytes]) -> list[str]:
        """LMCache dropped these chunks from L1. Each session holding one keeps only the
        chunks before its first lost one; returns the chunk keys that left (every session's
        lost chunk and those after it), in no particular order."""
        with self._lock:
            self._step += 1
            cut: dict[str, int] = {}
            for chunk_hash in chunk_hashes:
                self._recent[chunk_hash] = self._step
                self._recent.move_to_end(chunk_hash)
                for session, index in (self._by_hash.get(chunk_hash) or {}).items():
                    cut[session] = min(index, cut.get(session, index))
            while len(self._recent) > RECENT:
                _, step = self._recent.popitem(last=False)
                self._forgotten_step = max(self._forgotten_step, step)
            gone: list[str] = []
            for session, index in cut.items():
                warm = self._sessions[session]
                lost = warm.keys[index:]
                gone.extend(lost)
                if not index:
                    self._forget(session)
                    continue
                # Trimmed in place: the session keeps its age in the bound's order.
                self._sessions[session] = _Warm(warm.keys[:index], warm.hashes[:index])
                self._held.difference_update(lost)
                self._unindex(session, warm.hashes[index:])
            self._removed_keys += len(gone)
            return gone

    def withdraw_all(self) -> list[str]:
        """Forget every session (what L1 holds is no longer known); returns their keys."""
        with self._lock:
            keys = [k for warm in self._sessions.values() for k in warm.keys]
            self._withdrawn += len(self._sessions)
            self._sessions.clear()
            self._by_hash.clear()
            self._held.clear()
            self._chunks = 0
            return keys

    def keys(self) -> tuple[str, ...]:
        """Every chunk key believed resident."""
        with self._lock:
            return tuple(k for warm in self._sessions.values() for k in warm.keys)

    def holds(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [k in self._held for k in keys]

    def stats(self) -> ResidencyStats:
        with self._lock:
            return ResidencyStats(len(self._sessions), self._chunks, self._removed_keys,
                                  self._dropped, self._withdrawn)

    def _removed_since(self, hashes: Sequence[bytes], since: int | None) -> int | None:
        """Under the lock: the index of the first of ``hashes`` removed after step
        ``since`` (0 when the history no longer reaches back to it), else None."""
        if since is None or since >= self._step:
            return None
        if self._forgotten_step > since:
            return 0
        for index, chunk_hash in enumerate(hashes):
            if self._recent.get(chunk_hash, 0) > since:
                return index
        return None

    def _forget(self, session: str) -> None:
        """Under the lock."""
        warm = self._sessions.pop(session, None)
        if warm is None:
            return
        self._held.difference_update(warm.keys)
        self._unindex(session, warm.hashes)

    def _unindex(self, session: str, hashes: Sequence[bytes]) -> None:
        """Under the lock: drop ``session``'s entries for these hashes."""
        for chunk_hash in hashes:
            holders = self._by_hash.get(chunk_hash)
            if holders is not None:
                holders.pop(session, None)
                if not holders:
                    del self._by_hash[chunk_hash]
        self._chunks -= len(hashes)


__all__ = ["MAX_CHUNKS", "RECENT", "L1Residency", "ResidencyStats"]
