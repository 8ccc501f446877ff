"""The HiCache backend's counters, readable from another process (no SGLang, no torch).

SGLang builds the storage backend inside each TP rank's scheduler process and has no call
that returns a backend's own state to anyone else (its ``get_stats`` hook feeds its own
Prometheus metrics and must return SGLang's ``StorageMetrics``). So a backend configured
with ``stats_dir`` rewrites one small JSON file per rank there, at start-up and after
every call that changed its counters: a temporary file renamed over the last one, so a
reader sees a whole snapshot. :func:`read_stats` sums the ranks' files. The cost is one
write of about 200 bytes and a rename per storage batch (up to 128 pages of MiBs each).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvprefetch.agents.sglang.keys import PageKeyScheme

log = logging.getLogger(__name__)

#: The backend's counters, in pages (``pages_written``: pages stored in the remote store).
COUNTERS = ("local_hits", "local_bad", "valkey_hits", "s3_hits", "remote_hits", "misses",
            "pages_written")


def rank_label(scheme: PageKeyScheme) -> str:
    """The name of one rank's stats file (without ``.json``)."""
    return f"tp{scheme.tp_rank}-pp{scheme.pp_rank}-cp{scheme.attn_cp_rank}"


class StatsPublisher:
    """Writes one rank's counters to ``<directory>/<rank>.json``. Called under the
    backend's counter lock, so one rank never has two writes in flight."""

    def __init__(self, directory: str | os.PathLike[str], scheme: PageKeyScheme) -> None:
        self._dir = Path(directory)
        self._path = self._dir / f"{rank_label(scheme)}.json"
        self._tmp = self._dir / f".{rank_label(scheme)}.json.tmp"
        self._model_name = scheme.model_name
        self._failing = False
        try:  # once: publish runs per storage batch
            self._dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("kvprefetch HiCache storage: stats directory %s: %s", self._dir, exc)

    def publish(self, counts: Mapping[str, int]) -> None:
        """Best effort: a stats file that cannot be written never fails a storage call
        (logged once until a write succeeds again)."""
        record = {"model_name": self._model_name, "counters": dict(counts)}
        try:
            self._tmp.write_text(json.dumps(record))
            os.replace(self._tmp, self._path)
            self._failing = False
        except OSError as exc:
            if not self._failing:
                log.warning("kvprefetch HiCache storage: stats file %s: %s", self._path, exc)
            self._failing = True


@dataclass(frozen=True, slots=True)
class BackendStats:
    """The counters of every rank that published into one directory, summed."""

    counters: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    #: The model name each rank names its objects with (SGLang's storage config).
    model_names: tuple[str, ...] = ()

    @property
    def ranks(self) -> int:
        return len(self.model_names)

    def since(self, earlier: BackendStats) -> dict[str, int]:
        """Each counter's growth from ``earlier`` to this snapshot."""
        return {k: self.counters.get(k, 0) - earlier.counters.get(k, 0) for k in COUNTERS}


def read_stats(directory: str | os.PathLike[str]) -> BackendStats:
    """Sum the rank files in ``directory`` (none yet: all zero, no ranks)."""
    totals = dict.fromkeys(COUNTERS, 0)
    names: list[str] = []
    root = Path(directory)
    for path in sorted(root.glob("*.json")) if root.is_dir() else ():
        record = json.loads(path.read_text())
        names.append(str(record["model_name"]))
        for k in COUNTERS:
            totals[k] += int(record["counters"].get(k, 0))
    return BackendStats(totals, tuple(names))
