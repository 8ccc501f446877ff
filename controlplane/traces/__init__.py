"""Trace loaders: real LLM-serving traces as :class:`~kvprefetch.controlplane.base.types.Trace`
records.

Formats (see each module's docstring for the exact mapping):

* ``claude-code``: multi-turn agentic sessions with sub-agents, one JSON file per session
  (:mod:`.claude_code`); start times from a seeded arrival process (:mod:`.arrivals`);
* ``mooncake``: prefix-hash JSONL without session ids, sessions rebuilt from prefix
  relations with a shared-prefix guard (:mod:`.mooncake`);
* ``azure``: arrivals and lengths only, one request per session (:mod:`.azure`);
* ``journal``: kvprefetch's own event journal, written by :class:`JournalWriter` (the
  package :mod:`kvprefetch.controlplane.journal`; as a trace:
  :mod:`kvprefetch.controlplane.journal.trace`).

Not a file format: ``synthetic:PROFILE[:SESSIONS]`` draws seeded multi-turn sessions from a
parametric model with laws of its own (:mod:`.synthetic`), for traffic no predictor was
trained on; :func:`load_trace` takes it in place of a path.
"""

from kvprefetch.controlplane.journal.file import event_from_dict, event_to_dict
from kvprefetch.controlplane.journal.trace import load_journal, read_journal_events
from kvprefetch.controlplane.journal.writer import JournalWriter
from kvprefetch.controlplane.traces.arrivals import DEFAULT_SESSION_RATE_PER_S, ArrivalOptions
from kvprefetch.controlplane.traces.azure import load_azure
from kvprefetch.controlplane.traces.bundled import BUNDLED_TRACES, bundled_trace_path
from kvprefetch.controlplane.traces.claude_code import load_claude_code
from kvprefetch.controlplane.traces.detect import FORMATS, detect_format
from kvprefetch.controlplane.traces.loader import load_trace
from kvprefetch.controlplane.traces.mooncake import DEFAULT_SHARED_PREFIX_FANOUT, load_mooncake

__all__ = [
    "BUNDLED_TRACES",
    "DEFAULT_SESSION_RATE_PER_S",
    "DEFAULT_SHARED_PREFIX_FANOUT",
    "FORMATS",
    "ArrivalOptions",
    "JournalWriter",
    "bundled_trace_path",
    "detect_format",
    "event_from_dict",
    "event_to_dict",
    "load_azure",
    "load_claude_code",
    "load_journal",
    "load_mooncake",
    "load_trace",
    "read_journal_events",
]
