"""``kvprefetch init DIR``: write the example configs the package ships (the serve config,
a fleet config, a custom predictor, the Grafana dashboard, the Prometheus alert rules, the
deployment script and the Ray and KubeRay cluster files) into DIR, to edit and deploy.

Existing files are left alone unless ``--force``; each file is written atomically."""

from __future__ import annotations

import argparse
import logging
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from kvprefetch.controlplane.base.atomic import created_mode, write_atomic
from kvprefetch.controlplane.base.errors import ConfigError

log = logging.getLogger(__name__)

#: Not copied: caches and compiled files.
SKIP = ("__pycache__", ".pyc")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="where to write the examples (created)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite files that exist (default: leave them, say so)")


def bundled_examples() -> Traversable:
    """The examples folder inside the installed package."""
    return resources.files("kvprefetch.controlplane") / "data" / "examples"


def _files(root: Traversable, prefix: Path = Path()) -> list[tuple[Path, Traversable]]:
    out: list[tuple[Path, Traversable]] = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if any(entry.name.endswith(s) for s in SKIP):
            continue
        if entry.is_dir():
            out.extend(_files(entry, prefix / entry.name))
        else:
            out.append((prefix / entry.name, entry))
    return out


def run(args: argparse.Namespace) -> int:
    root = bundled_examples()
    if not root.is_dir():
        raise ConfigError(f"the package's examples are missing ({root}); reinstall kvprefetch")
    target: Path = args.dir
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{target}: exists and is not a directory")
    written = kept = 0
    for rel, entry in _files(root):
        dest = target / rel
        if dest.exists() and not args.force:
            print(f"kept     {dest} (exists; --force overwrites)")
            kept += 1
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        mode = created_mode()
        if rel.suffix == ".sh":  # executable by whoever may read it
            mode |= (mode & 0o444) >> 2
        write_atomic(dest, [entry.read_bytes()], mode=mode)
        print(f"wrote    {dest}")
        written += 1
    print(f"{written} files written, {kept} kept, in {target}")
    return 0
