"""Field readers shared by the trace loaders and the journal: each check names the file, line
and field.

The loaders parse untrusted files; every malformed value becomes a
:class:`~kvprefetch.controlplane.base.errors.TraceFormatError` that says *where* (file, 1-based line
when the format is line-based, field path) and *what* was expected, so a user can fix the file.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, TextIO, TypeVar

from kvprefetch.controlplane.base.errors import TraceFormatError

_E = TypeVar("_E", bound=Enum)


class FieldReader:
    """Reads typed fields from one decoded JSON object (or CSV row) at a known place."""

    __slots__ = ("line", "path", "prefix")

    def __init__(self, path: Path, line: int | None = None, prefix: str = "") -> None:
        self.path = path
        self.line = line
        self.prefix = prefix

    def error(self, key: str, message: str) -> TraceFormatError:
        return TraceFormatError(message, path=self.path, line=self.line, field=self.prefix + key)

    def mapping(self, obj: object, what: str = "record") -> Mapping[str, Any]:
        if not isinstance(obj, dict):
            field = self.prefix.rstrip(".") or None
            raise TraceFormatError(
                f"expected a JSON object ({what}), got {type(obj).__name__}",
                path=self.path,
                line=self.line,
                field=field,
            )
        return obj

    def required(self, obj: Mapping[str, Any], key: str) -> Any:
        try:
            return obj[key]
        except KeyError:
            raise self.error(key, "missing required field") from None

    def count(self, obj: Mapping[str, Any], key: str, default: int | None = None) -> int:
        """A non-negative integer (token counts). Floats with an integral value are accepted."""
        value = obj.get(key) if default is not None else self.required(obj, key)
        if value is None:
            if default is None:
                raise self.error(key, "missing required field")
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"expected a non-negative integer, got {value!r}")
        if isinstance(value, float):
            if not value.is_integer():
                raise self.error(key, f"expected a non-negative integer, got {value!r}")
            value = int(value)
        if value < 0:
            raise self.error(key, f"must be non-negative, got {value}")
        return value

    def seconds(self, obj: Mapping[str, Any], key: str, *, optional: bool = False) -> float | None:
        """A non-negative, finite number of seconds (or milliseconds; the caller scales)."""
        value = obj.get(key) if optional else self.required(obj, key)
        if value is None:
            if optional:
                return None
            raise self.error(key, "missing required field")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"expected a number, got {value!r}")
        value = float(value)
        if not value >= 0.0 or value == float("inf"):  # also rejects NaN
            raise self.error(key, f"must be a finite non-negative number, got {value!r}")
        return value

    def number(self, obj: Mapping[str, Any], key: str) -> float:
        """A finite number of any sign (absolute clocks)."""
        value = self.required(obj, key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"expected a number, got {value!r}")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise self.error(key, f"must be finite, got {value!r}")
        return value

    def text(self, obj: Mapping[str, Any], key: str) -> str:
        value = self.required(obj, key)
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {value!r}")
        return value

    def optional_text(self, obj: Mapping[str, Any], key: str) -> str | None:
        return None if obj.get(key) is None else self.text(obj, key)

    def member(self, key: str, text: str, kind: type[_E], what: str) -> _E:
        """``text`` (read from ``key``) as a value of the enum ``kind``; an error names
        ``what`` it is and lists the known values."""
        try:
            return kind(text)
        except ValueError:
            known = ", ".join(m.value for m in kind)
            raise self.error(key, f"unknown {what} {text!r} (known: {known})") from None

    def int_list(self, obj: Mapping[str, Any], key: str) -> list[int]:
        value = self.required(obj, key)
        if not isinstance(value, list):
            raise self.error(key, f"expected a list of integers, got {type(value).__name__}")
        return value


def check_exists(path: Path) -> None:
    if not path.exists():
        raise TraceFormatError("no such file or directory", path=path)


def open_text(path: Path) -> TextIO:
    """Open a text trace file, transparently decompressing ``.gz``."""
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return path.open("r", encoding="utf-8", newline="")


def read_bytes(path: Path) -> bytes:
    """The whole (decompressed) content of a file."""
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return f.read()
    return path.read_bytes()


def numbered_lines(stream: TextIO) -> Iterator[tuple[int, str]]:
    """``(1-based line number, line without its newline)`` for every non-blank line."""
    for number, raw in enumerate(stream, start=1):
        line = raw.rstrip("\r\n")
        if line.strip():
            yield number, line
