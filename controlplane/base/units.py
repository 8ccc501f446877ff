"""Sizes with units, as config files and flags give them: ``4096`` (bytes), ``1.5GB``
(decimal: kB, MB, GB, TB), ``512MiB`` or ``64GiB`` (binary: KiB, MiB, GiB, TiB); units are
case-insensitive. Config fields whose names end in ``_bytes`` take either an integer or such
a string (:data:`ByteSize`)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

#: Size units and their bytes.
SIZE_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30,
    "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes from a size with an optional unit; a fractional byte count rounds to the
    nearest byte. ValueError (saying what is accepted) for anything else."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size: give bytes (4096) or a number with a unit, "
                         "e.g. 512MiB, 64GiB, 1.5GB (units: B, kB, MB, GB, TB, KiB, MiB, GiB, "
                         "TiB)")
    return round(float(match.group(1)) * SIZE_UNITS[unit])


def _size(value: Any) -> Any:
    return parse_size(value) if isinstance(value, str) else value


#: An integer number of bytes that a config file may also write as ``64GiB``.
ByteSize = Annotated[int, BeforeValidator(_size)]
