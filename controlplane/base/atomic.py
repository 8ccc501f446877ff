"""Atomic file publishes: readers see the old file or the whole new one, never a part.

Every file kvprefetch writes for users (reports, benchmark JSON, model artifacts) goes
through :func:`write_atomic`: a temporary file in the same directory, fsynced, then
renamed over the target; on any error the temporary file is removed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def created_mode() -> int:
    """The permission bits ``open()`` gives a new file here: 0666 less the process's umask
    (read from ``/proc`` where there is one; else set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: str | Path, chunks: Iterable[bytes], *, mode: int | None = None) -> Path:
    """Write ``chunks`` to ``path`` atomically (a temporary file beside it, fsynced, renamed
    over it); ``mode``: the file's permission bits (default: a new file's under the umask,
    :func:`created_mode`, as any other program's output; not the temporary file's 0600).
    Returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), created_mode() if mode is None else mode)
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def write_json_atomic(path: str | Path, data: Any, *, sort_keys: bool = True) -> Path:
    """Pretty JSON, atomically (see :func:`write_atomic`)."""
    text = json.dumps(data, indent=2, sort_keys=sort_keys) + "\n"
    return write_atomic(path, [text.encode()])


def save_figure_atomic(fig: Any, path: str | Path, *, dpi: int = 110) -> Path:
    """A matplotlib figure as PNG, atomically (a temporary file beside it, then renamed),
    and closed. The caller imports matplotlib; this module does not."""
    import matplotlib.pyplot as plt

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi)
    finally:
        plt.close(fig)
    os.replace(tmp, p)
    return p
