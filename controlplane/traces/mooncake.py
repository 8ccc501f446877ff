"""Loader for Mooncake-style prefix-hash traces (JSONL), with session reconstruction.

Input: one JSON object per line with ``timestamp`` (milliseconds), ``input_length``,
``output_length`` and ``hash_ids`` (one id per 512-token block of the input, the last one
possibly partial). There are no session ids; sessions are rebuilt from prefix relations.

Block ids are *chained*: an id names the whole prefix up to and including its block, so it
always sits at the same position after the same predecessor. (Checked on the FAST'25
``synthetic_trace.jsonl``: over its 3,993 requests no id ever appears at two positions or
after two different predecessors.) Hence request ``R`` contains all of request ``E``'s
full blocks exactly when ``R`` contains ``E``'s *anchor*, the id of its last full block
(``hash_ids[input_length // 512 - 1]``), at the same position.

Session rule (two passes over the requests, in timestamp order):

1. *Shared prefixes.* For every block id, collect the distinct ids that follow it in any
   request (the next block, full or partial). A block with at least ``shared_prefix_fanout``
   (default 3) distinct continuations is a shared prefix (a system prompt, a common
   document, a few-shot template) and never links requests: many users diverge from it.
   A single conversation has at most two continuations at any of its anchors (the partial
   tail of the request that ends there, and the next turn's block), so it is never cut.
2. *Linking.* Request ``R`` continues an earlier request ``E`` (by timestamp, then line)
   whose anchor ``R`` contains and is not shared: the one with the *deepest* anchor, i.e. the
   longest full-block prefix in common, and the latest among those with that same anchor.
   ``R`` joins ``E``'s session; otherwise it starts a new one. (Taking merely the latest
   request whose blocks ``R`` extends would let a shallow match, such as a short request on
   the same system prompt, steal a conversation's next turn.)

Replay: open-loop (``gap_s=None``). ``start_s`` = the session's first timestamp minus the
trace's first timestamp, in seconds; ``offset_s`` is relative to the session's first
request. ``reused_tokens`` = ``E``'s full blocks times 512, capped at ``E``'s input plus
output and at ``R``'s input. Session ids are ``s000000``, ``s000001``... in order of first
request. The rule uses only the schema, so it applies to any trace in this format (real
arrival timelines included).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pydantic_core
from tqdm import tqdm

from kvprefetch.controlplane.base.errors import TraceFormatError
from kvprefetch.controlplane.base.fields import (
    FieldReader,
    check_exists,
    numbered_lines,
    open_text,
)
from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession

FORMAT_NAME = "mooncake"
BLOCK_TOKENS = 512
DEFAULT_SHARED_PREFIX_FANOUT = 3


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    """One line of the file, validated."""

    line: int
    timestamp_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]

    @property
    def full_blocks(self) -> int:
        return min(self.input_tokens // BLOCK_TOKENS, len(self.hash_ids))

    @property
    def anchor(self) -> int | None:
        """Id of the last full block (names the whole full-block prefix); None if none."""
        k = self.full_blocks
        return self.hash_ids[k - 1] if k > 0 else None


def load_mooncake(
    path: str | Path,
    *,
    shared_prefix_fanout: int = DEFAULT_SHARED_PREFIX_FANOUT,
    limit_sessions: int | None = None,
    progress: bool = False,
) -> Trace:
    """Load a Mooncake JSONL trace and rebuild its sessions; see the module docstring."""
    if shared_prefix_fanout < 2:
        raise ValueError("shared_prefix_fanout must be at least 2")
    source = Path(path)
    records = read_records(source, progress=progress)
    if not records:
        raise TraceFormatError("trace has no requests", path=source)
    parents = link_sessions(records, shared_prefix_fanout)
    trace = _build_trace(source, records, parents)
    return trace.limit_sessions(limit_sessions)


def read_records(path: Path, *, progress: bool = False) -> list[MooncakeRecord]:
    """Validated records sorted by (timestamp, line)."""
    check_exists(path)
    records: list[MooncakeRecord] = []
    with open_text(path) as stream:
        lines = tqdm(numbered_lines(stream), desc="mooncake", unit="line", disable=not progress)
        for number, text in lines:
            records.append(_parse_line(path, number, text))
    records.sort(key=lambda r: (r.timestamp_ms, r.line))
    return records


def _parse_line(path: Path, number: int, text: str) -> MooncakeRecord:
    try:
        obj = pydantic_core.from_json(text)
    except ValueError as exc:
        raise TraceFormatError(f"invalid JSON: {exc}", path=path, line=number) from None
    reader = FieldReader(path, number)
    row = reader.mapping(obj)
    timestamp_ms = reader.seconds(row, "timestamp")
    assert timestamp_ms is not None
    hash_ids = reader.int_list(row, "hash_ids")
    if not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
        raise reader.error("hash_ids", "expected a list of integers")
    return MooncakeRecord(
        line=number,
        timestamp_ms=timestamp_ms,
        input_tokens=reader.count(row, "input_length"),
        output_tokens=reader.count(row, "output_length"),
        hash_ids=tuple(hash_ids),
    )


def shared_prefix_blocks(records: list[MooncakeRecord], fanout: int) -> set[int]:
    """Block ids followed by at least ``fanout`` distinct next blocks across the trace."""
    continuations: defaultdict[int, set[int]] = defaultdict(set)
    for record in records:
        ids = record.hash_ids
        for i in range(len(ids) - 1):
            continuations[ids[i]].add(ids[i + 1])
    return {block for block, nexts in continuations.items() if len(nexts) >= fanout}


def link_sessions(records: list[MooncakeRecord], fanout: int) -> list[int | None]:
    """For each record (by index), the index of the earlier record it continues, or None.

    One pass: ``latest_with_anchor`` maps each unshared anchor to the latest record ending
    its full blocks there; a record looks its blocks up from the deepest one down.
    """
    shared = shared_prefix_blocks(records, fanout)
    latest_with_anchor: dict[int, int] = {}  # anchor block id -> latest record index
    parents: list[int | None] = []
    for index, record in enumerate(records):
        parent: int | None = None
        for block in reversed(record.hash_ids):  # deepest anchor first
            parent = latest_with_anchor.get(block)
            if parent is not None:
                break
        parents.append(parent)
        anchor = record.anchor
        if anchor is not None and anchor not in shared:
            latest_with_anchor[anchor] = index
    return parents


def _build_trace(source: Path, records: list[MooncakeRecord], parents: list[int | None]) -> Trace:
    session_of: list[int] = []
    members: list[list[int]] = []
    for index, parent in enumerate(parents):
        if parent is None:
            session_of.append(len(members))
            members.append([index])
        else:
            session = session_of[parent]
            session_of.append(session)
            members[session].append(index)

    t0_ms = records[0].timestamp_ms
    sessions: list[TraceSession] = []
    for number, indices in enumerate(members):
        session_id = f"s{number:06d}"
        first_ms = records[indices[0]].timestamp_ms
        requests = []
        for turn, index in enumerate(indices):
            record = records[index]
            parent = parents[index]
            reused = 0
            if parent is not None:
                previous = records[parent]
                reused = min(
                    previous.full_blocks * BLOCK_TOKENS,
                    previous.input_tokens + previous.output_tokens,
                    record.input_tokens,
                )
            requests.append(
                TraceRequest(
                    session_id=session_id,
                    turn=turn,
                    offset_s=(record.timestamp_ms - first_ms) / 1000.0,
                    input_tokens=record.input_tokens,
                    output_tokens=record.output_tokens,
                    reused_tokens=reused,
                )
            )
        sessions.append(TraceSession(session_id, (first_ms - t0_ms) / 1000.0, tuple(requests)))
    sessions.sort(key=lambda s: (s.start_s, s.session_id))
    name = source.name.removesuffix(".gz").removesuffix(".jsonl")
    return Trace(name, tuple(sessions), FORMAT_NAME, BLOCK_TOKENS)
