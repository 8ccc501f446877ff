"""The predictor options, one definition for every sub-command that has them.

Where only one predictor makes sense (``train``, ``sim``, ``sim-grid``) ``--predictor SPEC``
takes one spec; giving the flag twice is a usage error that says so, rather than argparse's
default of silently keeping the last one. Where several do (``eval-predictor``) the plural
``--predictors A,B`` collects them all, in order, repeated or not; ``--predictor a b`` is
accepted there too, as an alias kept out of ``--help``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


class _OnePredictor(argparse.Action):
    """Stores one spec; a second one (the flag repeated) is a usage error."""

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


class _PredictorList(argparse.Action):
    """Appends the comma-separated specs of each use of the flag, in order."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        given = [values] if isinstance(values, str) else list(values or ())
        specs = [s.strip() for text in given for s in text.split(",") if s.strip()]
        if not specs:
            parser.error(f"{option_string}: give at least one predictor")
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *specs])


def add_predictor_option(
    parser: argparse.ArgumentParser,
    *,
    several: bool,
    help: str,
    default: str | None = None,
    required: bool = False,
) -> None:
    """With ``several``, ``--predictors A,B`` (dest ``predictors``, a list of specs, empty
    when not given); else ``--predictor SPEC`` (dest ``predictor``, one spec, ``default``
    when not given)."""
    if several:
        parser.add_argument("--predictors", action=_PredictorList, default=[],
                            metavar="SPEC[,SPEC...]", required=required, help=help)
        parser.add_argument("--predictor", dest="predictors", action=_PredictorList,
                            nargs="+", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    else:
        parser.add_argument("--predictor", action=_OnePredictor, default=default,
                            metavar="SPEC", required=required, help=help)
