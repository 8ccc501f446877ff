"""Loader for Claude Code session traces (kv-cache-tester format).

Input: a directory of ``trace_NNNN.json[.gz]`` files, or one such file. Each file is one
conversation: ``id``, ``block_size`` (tokens per hash block, 64) and ``requests[]`` with
``t`` (seconds since the session started), ``type`` (``"n"``, ``"s"`` or ``"subagent"``),
``in`` / ``out`` (tokens), ``hash_ids`` (one id per block of the input; equal leading ids are
a reusable prefix), ``stop``, ``api_time`` and ``think_time`` (seconds, sometimes absent).

Mapping to :class:`~kvprefetch.controlplane.base.types.TraceSession`:

* one session per file, ``session_id`` = the file's ``id``;
* a ``"subagent"`` entry is not a request: its own ``requests[]`` (``t`` relative to the
  entry's ``t``) become a child session ``<id>/<agent_id>`` whose ``parent_id`` is the file's
  session and whose ``start_s`` is the parent's start plus the entry's ``t``;
* request ``i >= 1``: ``gap_s`` = ``think_time`` when present, else
  ``max(0, t_i - t_{i-1} - api_time_{i-1})``; ``reused_tokens`` = common leading hash ids with
  the previous request of the same session times ``block_size``, capped at that request's
  ``in + out`` and at this request's ``in``. The first request has ``gap_s=None`` and no reuse.

Each file has its own clock, so session start times come from an arrival process
(:mod:`kvprefetch.controlplane.traces.arrivals`). Element types inside ``hash_ids`` are not checked
one by one (tens of millions of ids); the list itself is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic_core
from tqdm import tqdm

from kvprefetch.controlplane.base.errors import TraceFormatError
from kvprefetch.controlplane.base.fields import FieldReader, check_exists, read_bytes
from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession
from kvprefetch.controlplane.base.vocabulary import stop_reason_or_none
from kvprefetch.controlplane.traces.arrivals import ArrivalOptions, assign_start_times

FORMAT_NAME = "claude-code"
DEFAULT_BLOCK_TOKENS = 64
_SUFFIXES = (".json", ".json.gz")


@dataclass(frozen=True, slots=True)
class _ParsedSession:
    """A session before it is placed on the replay clock."""

    session_id: str
    parent_id: str | None
    offset_in_root_s: float  # 0 for the file's own session, the entry's t for a sub-agent
    requests: tuple[TraceRequest, ...]
    end_s: float  # last request's t + api_time, relative to this session's own start


@dataclass(frozen=True, slots=True)
class _ParsedFile:
    sessions: tuple[_ParsedSession, ...]  # the root first, then its sub-agents in file order
    block_tokens: int

    @property
    def duration_s(self) -> float:
        """How long the file's session is live, sub-agents included."""
        return max(s.offset_in_root_s + s.end_s for s in self.sessions)


def is_trace_file(path: Path) -> bool:
    return path.is_file() and path.name.endswith(_SUFFIXES)


def trace_files(path: Path) -> list[Path]:
    """The trace files at ``path`` (a file or a directory), sorted by file name."""
    check_exists(path)
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if is_trace_file(p)), key=lambda p: p.name)
        if not files:
            raise TraceFormatError(
                f"no Claude Code trace files ({', '.join('*' + s for s in _SUFFIXES)}) here",
                path=path,
            )
        return files
    return [path]


def load_claude_code(
    path: str | Path,
    *,
    arrivals: ArrivalOptions | None = None,
    seed: int = 0,
    limit_sessions: int | None = None,
    progress: bool = False,
) -> Trace:
    """Load a Claude Code trace directory (or file); see the module docstring."""
    root = Path(path)
    files = trace_files(root)
    if limit_sessions is not None:
        files = files[: max(0, limit_sessions)]
    parsed = [
        parse_file(f)
        for f in tqdm(files, desc="claude-code traces", unit="file", disable=not progress)
    ]
    if not any(s.requests for p in parsed for s in p.sessions):
        raise TraceFormatError("trace has no requests", path=root)
    starts = assign_start_times([p.duration_s for p in parsed], arrivals or ArrivalOptions(), seed)
    sessions = [
        TraceSession(
            session_id=s.session_id,
            start_s=start + s.offset_in_root_s,
            requests=s.requests,
            parent_id=s.parent_id,
        )
        for p, start in zip(parsed, starts, strict=True)
        for s in p.sessions
        if s.requests
    ]
    sessions.sort(key=lambda s: (s.start_s, s.session_id))
    block_tokens = parsed[0].block_tokens if parsed else DEFAULT_BLOCK_TOKENS
    name = root.name.removesuffix(".gz").removesuffix(".json")
    return Trace(name, tuple(sessions), FORMAT_NAME, block_tokens)


def parse_file(path: Path) -> _ParsedFile:
    """Parse one trace file into its session and sub-agent sessions (no start times yet)."""
    document = _decode(path)
    reader = FieldReader(path)
    top = reader.mapping(document, "trace file")
    block_tokens = reader.count(top, "block_size", default=DEFAULT_BLOCK_TOKENS)
    if block_tokens == 0:
        raise reader.error("block_size", "must be positive")
    session_id = reader.optional_text(top, "id") or path.name.split(".")[0]
    entries = reader.required(top, "requests")
    if not isinstance(entries, list):
        raise reader.error("requests", "expected a list")

    own: list[tuple[Mapping[str, Any], FieldReader]] = []
    children: list[_ParsedSession] = []
    for index, raw in enumerate(entries):
        entry_reader = FieldReader(path, prefix=f"requests[{index}].")
        entry = entry_reader.mapping(raw, "request")
        if entry.get("type") == "subagent":
            children.append(
                _parse_subagent(entry, entry_reader, session_id, block_tokens, len(children))
            )
        else:
            own.append((entry, entry_reader))
    requests, end_s = _build_requests(session_id, own, block_tokens)
    root = _ParsedSession(session_id, None, 0.0, requests, end_s)
    return _ParsedFile((root, *children), block_tokens)


def _decode(path: Path) -> object:
    content = read_bytes(path)
    try:
        return pydantic_core.from_json(content)
    except ValueError:
        pass
    # Slow path, only for broken files: the stdlib decoder says where the problem is.
    try:
        return json.loads(content)
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"not UTF-8 text: {exc}", path=path) from None
    except json.JSONDecodeError as exc:
        raise TraceFormatError(
            f"invalid JSON: {exc.msg} (column {exc.colno})", path=path, line=exc.lineno
        ) from None


def _parse_subagent(
    entry: Mapping[str, Any],
    reader: FieldReader,
    parent_id: str,
    block_tokens: int,
    ordinal: int,
) -> _ParsedSession:
    offset_s = reader.seconds(entry, "t")
    assert offset_s is not None
    agent_id = reader.optional_text(entry, "agent_id") or f"agent_{ordinal + 1:03d}"
    session_id = f"{parent_id}/{agent_id}"
    raw_requests = reader.required(entry, "requests")
    if not isinstance(raw_requests, list):
        raise reader.error("requests", "expected a list")
    own: list[tuple[Mapping[str, Any], FieldReader]] = []
    for index, raw in enumerate(raw_requests):
        sub_reader = FieldReader(reader.path, prefix=f"{reader.prefix}requests[{index}].")
        sub = sub_reader.mapping(raw, "request")
        if sub.get("type") == "subagent":
            raise sub_reader.error("type", "nested sub-agents are not supported")
        own.append((sub, sub_reader))
    requests, end_s = _build_requests(session_id, own, block_tokens)
    return _ParsedSession(session_id, parent_id, offset_s, requests, end_s)


def _build_requests(
    session_id: str,
    entries: Sequence[tuple[Mapping[str, Any], FieldReader]],
    block_tokens: int,
) -> tuple[tuple[TraceRequest, ...], float]:
    requests: list[TraceRequest] = []
    prev_t = prev_api = 0.0
    prev_hashes: list[int] = []
    prev_context = 0
    end_s = 0.0
    for turn, (entry, reader) in enumerate(entries):
        t = reader.seconds(entry, "t")
        assert t is not None
        input_tokens = reader.count(entry, "in")
        output_tokens = reader.count(entry, "out")
        hashes = reader.int_list(entry, "hash_ids")
        api_time_s = reader.seconds(entry, "api_time", optional=True)
        think_time_s = reader.seconds(entry, "think_time", optional=True)
        # Anthropic stop reasons; the canonical names (an unknown one carries no signal)
        stop = stop_reason_or_none(reader.optional_text(entry, "stop") or None)
        if turn == 0:
            gap_s: float | None = None
            reused = 0
        else:
            if t < prev_t:
                raise reader.error("t", f"goes backwards ({t} after {prev_t})")
            gap_s = think_time_s if think_time_s is not None else max(0.0, t - prev_t - prev_api)
            shared_blocks = common_prefix_length(prev_hashes, hashes)
            reused = min(shared_blocks * block_tokens, prev_context, input_tokens)
        requests.append(
            TraceRequest(
                session_id=session_id,
                turn=turn,
                offset_s=t,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                reused_tokens=reused,
                gap_s=gap_s,
                stop_reason=stop,
                api_time_s=api_time_s,
            )
        )
        prev_t, prev_api = t, api_time_s or 0.0
        prev_hashes, prev_context = hashes, input_tokens + output_tokens
        end_s = max(end_s, t + prev_api)
    return tuple(requests), end_s


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common leading run of ``a`` and ``b``.

    Uses C-level slice comparison (the common case, ``b`` extends ``a``, is one comparison)
    and a binary search otherwise: much faster than an element loop on long contexts.
    """
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
