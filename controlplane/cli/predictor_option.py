"""The ``--predictor`` option, one definition for every sub-command that has it.

Where several predictors make sense (``eval-predictor``) both ``--predictor a b`` and
``--predictor a --predictor b`` collect them all, in order. Where only one does (``train``,
``sim``) giving several, in either form, is a usage error that says so, rather than argparse's
default of silently keeping the last one.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


class _OnePredictor(argparse.Action):
    """Stores one spec; a second one (repeated flag or several values) is a usage error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        given = [values] if isinstance(values, str) else list(values or ())
        seen_flag = f"_{self.dest}_given"
        earlier: list[str] = getattr(namespace, seen_flag, [])
        specs = [*earlier, *given]
        if len(specs) > 1:
            parser.error(f"{option_string or '--predictor'} takes one predictor here, got "
                         f"{len(specs)}: {' '.join(specs)}")
        setattr(namespace, seen_flag, specs)
        setattr(namespace, self.dest, specs[0])


def add_predictor_option(
    parser: argparse.ArgumentParser,
    *,
    several: bool,
    help: str,
    default: str | None = None,
    required: bool = False,
) -> None:
    """Add ``--predictor`` (dest ``predictor``): a list of specs when ``several``, else one
    spec (a str, ``default`` when not given)."""
    if several:
        parser.add_argument("--predictor", action="extend", nargs="+", default=[],
                            metavar="SPEC", required=required, help=help)
    else:
        parser.add_argument("--predictor", action=_OnePredictor, nargs="+", default=default,
                            metavar="SPEC", required=required, help=help)
