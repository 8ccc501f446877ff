"""``load_trace``: one entry point over every trace format."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvprefetch.controlplane.base.errors import UnknownFormatError
from kvprefetch.controlplane.base.types import Trace
from kvprefetch.controlplane.journal.trace import load_journal
from kvprefetch.controlplane.traces.arrivals import ArrivalOptions, scale_clock
from kvprefetch.controlplane.traces.azure import load_azure
from kvprefetch.controlplane.traces.claude_code import load_claude_code
from kvprefetch.controlplane.traces.detect import FORMATS, detect_format, known_formats_text
from kvprefetch.controlplane.traces.mooncake import load_mooncake
from kvprefetch.controlplane.traces.synthetic import is_synthetic, load_synthetic


def _claude_code(
    path: Path, arrivals: ArrivalOptions | None, seed: int, limit: int | None, progress: bool
) -> Trace:
    return load_claude_code(
        path, arrivals=arrivals, seed=seed, limit_sessions=limit, progress=progress
    )


def _mooncake(
    path: Path, arrivals: ArrivalOptions | None, seed: int, limit: int | None, progress: bool
) -> Trace:
    return load_mooncake(path, limit_sessions=limit, progress=progress)


def _azure(
    path: Path, arrivals: ArrivalOptions | None, seed: int, limit: int | None, progress: bool
) -> Trace:
    return load_azure(path, limit_sessions=limit, progress=progress)


def _journal(
    path: Path, arrivals: ArrivalOptions | None, seed: int, limit: int | None, progress: bool
) -> Trace:
    return load_journal(path, limit_sessions=limit, progress=progress)


_Loader = Callable[[Path, ArrivalOptions | None, int, int | None, bool], Trace]
_LOADERS: dict[str, _Loader] = {
    "claude-code": _claude_code,
    "mooncake": _mooncake,
    "azure": _azure,
    "journal": _journal,
}
assert tuple(_LOADERS) == FORMATS
#: Formats whose sessions share no clock: ``arrivals`` places them (and ``load`` scales the
#: arrival process); every other format keeps its timestamps, ``load`` scaling the clock.
PLACED_BY_ARRIVALS = frozenset({"claude-code"})


def load_trace(
    path: str | Path,
    fmt: str = "auto",
    *,
    arrivals: ArrivalOptions | None = None,
    seed: int = 0,
    limit_sessions: int | None = None,
    progress: bool = False,
) -> Trace:
    """Load a trace of any known format as a :class:`~kvprefetch.controlplane.base.types.Trace`.

    ``fmt`` is one of :data:`FORMATS` or ``"auto"`` (guess from the name and first line).
    ``arrivals`` and ``seed`` place sessions on the replay clock for formats without a shared
    clock (claude-code); the others keep their timestamps (0 = first one), on a clock
    scaled by ``arrivals.load`` (:func:`~kvprefetch.controlplane.traces.arrivals.scale_clock`).
    Sessions come sorted by ``(start_s, session_id)``. ``limit_sessions`` keeps the first N
    sessions: by file name before start times are drawn for claude-code (so the choice does
    not depend on the seed; their sub-agents come along), by start time otherwise.

    ``path`` may also name synthetic traffic, ``synthetic:NAME[:SESSIONS]``
    (:mod:`~kvprefetch.controlplane.traces.synthetic`): drawn from ``seed``, placed like
    claude-code.

    Raises :class:`~kvprefetch.controlplane.base.errors.UnknownFormatError` for an unknown ``fmt``,
    an undetectable file or an unknown synthetic profile,
    :class:`~kvprefetch.controlplane.base.errors.TraceFormatError` for a missing path,
    an empty trace or a malformed record (naming file, line and field).
    """
    if is_synthetic(path):
        return load_synthetic(path, seed=seed, arrivals=arrivals, limit_sessions=limit_sessions)
    source = Path(path)
    name = detect_format(source) if fmt == "auto" else fmt
    loader = _LOADERS.get(name)
    if loader is None:
        raise UnknownFormatError(
            f"unknown trace format {fmt!r}; known formats: {known_formats_text()} (or 'auto')"
        )
    trace = loader(source, arrivals, seed, limit_sessions, progress)
    if name not in PLACED_BY_ARRIVALS and arrivals is not None:
        trace = scale_clock(trace, arrivals.load)
    return trace
