"""What a node's vLLM holds in its GPU prefix cache (HBM), session by session, from its KV
events.

vLLM names a cached block by its chained block hash; the scheduler names a session by its
wire name (``tenant/session``). The gateway puts that name in each request it forwards
(``session_id``, see :func:`kvprefetch.controlplane.live.gateway.engine_body`) and asks for
``kv_cache_report_mode: full``, so every ``BlockStored`` event names the session whose
request stored the blocks, or reused them from the prefix cache (a reused prefix is
reported again, from the first block). :class:`HbmResidency` keeps, per session, the
hashes of its context's blocks in order (block ``i`` holds tokens ``i*block_size`` to
``(i+1)*block_size``), and turns events into the sessions whose HBM prefix changed and
its length in tokens now:

* a store at block ``i`` (its parent is the session's block ``i-1``, or none: ``i = 0``)
  replaces the session's blocks from ``i`` on (a turn that diverged keeps only the
  shared prefix);
* a removed block cuts every session holding it back to the blocks before it (vLLM's
  prefix lookup stops at the first missing block);
* ``AllBlocksCleared`` and a gap in the events (:meth:`HbmResidency.withdraw_all`) empty
  every session.

A store whose parent is not the session's last known block of that position (a store of a
request without the full report, or after a gap) cannot be placed and is ignored, counted
in ``unplaced``; a store without a session id names nobody and is ignored too.

Bounded: at most ``max_blocks`` (session, block) entries; past that the sessions stored
longest ago are dropped and reported at 0 tokens (no longer vouched for). Thread-safe; no
I/O.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: A vLLM block hash as its events carry it (``ExternalBlockHash``: bytes or an int).
BlockHash = bytes | int
#: Default bound on (session, block) entries.
MAX_BLOCKS = 1 << 20


@dataclass(frozen=True, slots=True)
class HbmStats:
    sessions: int
    #: (session, block) entries held.
    blocks: int
    #: Stores that could not be placed in their session's chain (module docstring).
    unplaced: int
    #: Sessions dropped to stay within ``max_blocks``.
    dropped_sessions: int


class HbmResidency:
    """Each session's blocks in vLLM's prefix cache (see the module docstring). Every
    method that changes state returns ``{session: tokens in HBM now}`` for the sessions
    whose HBM prefix changed (0: none left)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self._max = max_blocks
        self._lock = threading.Lock()
        #: session -> its blocks' hashes in order; least recently stored first.
        self._chains: OrderedDict[str, list[BlockHash]] = OrderedDict()
        #: session -> tokens per block (vLLM's block size).
        self._block_tokens: dict[str, int] = {}
        #: block hash -> {session: the block's index in that session's chain}.
        self._holders: dict[BlockHash, dict[str, int]] = {}
        self._blocks = 0
        self._unplaced = self._dropped = 0
        #: The engine's block size, as its latest store said (0 before one).
        self.block_tokens = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._chains)

    def tokens(self, session: str) -> int:
        """Tokens of the session's prefix in HBM (0: none known)."""
        with self._lock:
            return self._tokens(session)

    def listing(self) -> dict[str, int]:
        """Every session believed in HBM, with its tokens there."""
        with self._lock:
            return {s: self._tokens(s) for s in self._chains}

    def stored(self, session: str | None, parent: BlockHash | None,
               hashes: Sequence[BlockHash], block_size: int) -> dict[str, int]:
        """vLLM cached (or reused) ``hashes`` for a request of ``session``, right after
        block ``parent`` (None: from the first block)."""
        if not session or not hashes or block_size <= 0:
            if hashes:
                self._count_unplaced()
            return {}
        with self._lock:
            chain = self._chains.get(session)
            if parent is None:
                start = 0
            else:
                at = (self._holders.get(parent) or {}).get(session)
                if chain is None or at is None:
                    self._unplaced += 1
                    return {}
                start = at + 1
            before = self._tokens(session)
            if chain is None:
                chain = self._chains[session] = []
            self._unindex(session, chain[start:])
            del chain[start:]
            for offset, block in enumerate(hashes):
                self._holders.setdefault(block, {})[session] = start + offset
            chain.extend(hashes)
            self._blocks += len(hashes)
            self._block_tokens[session] = block_size
            self.block_tokens = block_size
            self._chains.move_to_end(session)
            changed = {}
            if self._tokens(session) != before:
                changed[session] = self._tokens(session)
            while self._blocks > self._max and len(self._chains) > 1:
                oldest = next(iter(self._chains))
                self._forget(oldest)
                self._dropped += 1
                changed[oldest] = 0
            return changed

    def removed(self, hashes: Iterable[BlockHash]) -> dict[str, int]:
        """vLLM evicted these blocks from its prefix cache."""
        with self._lock:
            cut: dict[str, int] = {}
            for block in hashes:
                for session, index in (self._holders.get(block) or {}).items():
                    cut[session] = min(index, cut.get(session, index))
            changed = {}
            for session, index in cut.items():
                chain = self._chains[session]
                self._unindex(session, chain[index:])
                del chain[index:]
                if not chain:
                    self._forget(session)
                changed[session] = self._tokens(session)
            return changed

    def withdraw_all(self) -> dict[str, int]:
        """Forget every session (HBM was cleared, or what it holds is no longer known);
        returns each at 0 tokens."""
        with self._lock:
            changed = dict.fromkeys(self._chains, 0)
            self._chains.clear()
            self._holders.clear()
            self._block_tokens.clear()
            self._blocks = 0
            return changed

    def stats(self) -> HbmStats:
        with self._lock:
            return HbmStats(len(self._chains), self._blocks, self._unplaced, self._dropped)

    # -- under the lock ----------------------------------------------------------------

    def _count_unplaced(self) -> None:
        with self._lock:
            self._unplaced += 1

    def _tokens(self, session: str) -> int:
        chain = self._chains.get(session)
        return len(chain) * self._block_tokens.get(session, 0) if chain else 0

    def _forget(self, session: str) -> None:
        chain = self._chains.pop(session, None)
        self._block_tokens.pop(session, None)
        if chain:
            self._unindex(session, chain)

    def _unindex(self, session: str, blocks: Sequence[BlockHash]) -> None:
        for block in blocks:
            holders = self._holders.get(block)
            if holders is not None and holders.pop(session, None) is not None:
                self._blocks -= 1
                if not holders:
                    del self._holders[block]


__all__ = ["MAX_BLOCKS", "BlockHash", "HbmResidency", "HbmStats"]
