"""Predictor registry: built-ins by name, user models by ``module:Class`` or by the entry
point group ``kvprefetch.predictors``. Everything is imported lazily, only when selected.

A spec may carry an artifact path after a colon for trained models: ``gbm:model.kvp``
(the class's ``load(path)`` reads it). Trained models (``empirical``, ``survival``, ``gbm``,
``torch-seq``, ``adaptive``) must be given an artifact: :func:`load` refuses an untrained one
at start-up; :func:`create` builds untrained instances for training and evaluation.
``default`` is the model shipped inside the package (``adaptive``, trained on the train half
of the shared Claude Code set; ``predictors/models/default.kvp``) with the hint layer of
``hinted``, ready to use. ``hinted:SPEC`` wraps any other spec in that layer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from kvprefetch.controlplane.base.errors import KvPrefetchError, PluginError, PredictorError
from kvprefetch.controlplane.base.types import Trace
from kvprefetch.predictors.base import Predictor

#: Built-in predictors: name -> "module:attribute" of a factory or class.
BUILTINS: dict[str, str] = {
    "last-gap": "kvprefetch.predictors.heuristics:LastGapPredictor",
    "ewma": "kvprefetch.predictors.heuristics:EwmaPredictor",
    "oracle": "kvprefetch.predictors.oracle:OraclePredictor",
    "empirical": "kvprefetch.predictors.empirical:EmpiricalPredictor",
    "survival": "kvprefetch.predictors.survival:SurvivalPredictor",
    "gbm": "kvprefetch.predictors.gbm:GbmPredictor",
    "torch-seq": "kvprefetch.predictors.torchseq:TorchSeqPredictor",
    "hinted": "kvprefetch.predictors.hinted:HintedPredictor",
    "adaptive": "kvprefetch.predictors.adaptive:AdaptivePredictor",
    # the shipped model (``adaptive`` trained on half the shared Claude Code set), reading
    # client hints
    "default": "kvprefetch.predictors.hinted:load_default",
}

#: Built-ins that learn from a trace (``fit``) and save/load artifacts.
TRAINABLE = frozenset({"empirical", "survival", "gbm", "torch-seq", "adaptive"})

ENTRY_POINT_GROUP = "kvprefetch.predictors"

#: Predictors that read the future and so need the trace; only the simulator has one.
NEEDS_TRACE = frozenset({"oracle"})


def available() -> list[str]:
    """Names of the built-in and entry-point predictors."""
    names = set(BUILTINS)
    names.update(ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def _import_target(target: str, what: str) -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise PluginError(f"{what}: expected 'module:Class', got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{what}: cannot import module {module_name!r}: {exc}") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        raise PluginError(f"{what}: module {module_name!r} has no attribute {attr!r}") from exc
    if not callable(obj):
        raise PluginError(f"{what}: {target!r} is not a class or factory")
    return obj


def resolve(spec: str) -> tuple[Callable[..., Any], str | None, str]:
    """Split a spec into (factory, artifact path or None, display name)."""
    spec = spec.strip()
    if not spec:
        raise PluginError("empty predictor name; known: " + ", ".join(available()))
    head, sep, tail = spec.partition(":")
    if head in BUILTINS:
        return _import_target(BUILTINS[head], f"predictor {head!r}"), (tail or None), head
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == head:
            try:
                factory = ep.load()
            except Exception as exc:  # a broken plugin must not look like an unknown one
                raise PluginError(f"predictor entry point {head!r} failed to load: {exc}") from exc
            return factory, (tail or None), head
    if (sep and "." in head) or (sep and tail and tail[:1].isidentifier()):
        # module:Class (a user model)
        return _import_target(spec, f"predictor {spec!r}"), None, spec
    raise PluginError(
        f"unknown predictor {spec!r}; known: {', '.join(available())}, or 'module:Class'"
    )


def create(spec: str, *, trace: Trace | None = None) -> Predictor:
    """Build the predictor named by ``spec``, trained or not (for training and evaluation).

    ``trace`` is handed to predictors that read the future (``oracle``); asking for one
    without a trace is an error, since only the simulator can provide it.
    """
    spec = spec.strip()
    if spec and ":" not in spec and spec not in BUILTINS and Path(spec).is_file():
        return load_artifact(spec)
    factory, artifact, name = resolve(spec)
    if name == "hinted" and artifact is not None:
        from kvprefetch.predictors.hinted import with_hints

        return with_hints(create(artifact, trace=trace))  # a spec, or a trained FILE
    try:
        if name in NEEDS_TRACE:
            if trace is None:
                raise PluginError(f"predictor {name!r} reads the future: simulator only")
            predictor = factory(trace)
        elif artifact is not None:
            loader = getattr(factory, "load", None)
            if loader is None:
                raise PluginError(f"predictor {name!r} takes no artifact, got {artifact!r}")
            predictor = loader(artifact)
        else:
            predictor = factory()
    except KvPrefetchError:
        raise
    except Exception as exc:  # a user plugin failing in its constructor
        raise PluginError(f"predictor {spec!r} failed to build: {exc}") from exc
    if not isinstance(predictor, Predictor):
        raise PluginError(
            f"{spec!r} does not implement the Predictor protocol (observe/forecast/forget/name)"
        )
    return predictor


def load(spec: str, *, trace: Trace | None = None) -> Predictor:
    """Build a ready-to-use predictor: like :func:`create`, but a model that still needs
    training (``gbm`` with no artifact) is refused here, at start-up, with how to train it."""
    predictor = create(spec, trace=trace)
    if not getattr(predictor, "fitted", True):
        name = spec.strip().partition(":")[0]
        raise PluginError(
            f"predictor {name!r} must be trained first: kvprefetch train --trace PATH "
            f"--predictor {name} --out FILE, then use '{name}:FILE'"
        )
    return predictor


def load_artifact(path: str | Path) -> Predictor:
    """Load a trained artifact of any built-in kind (the kind is read from its header)."""
    from kvprefetch.predictors.artifacts import read_header

    model = read_header(path).get("model")
    if model not in TRAINABLE:
        raise PredictorError(f"predictor artifact {str(path)!r}: unknown model kind {model!r}")
    factory = _import_target(BUILTINS[str(model)], f"predictor {model!r}")
    predictor: Predictor = factory.load(path)  # type: ignore[attr-defined]
    return predictor
