"""kvprefetch: predict which LLM session comes back, when and on which node, and warm its KV
cache there before the request arrives.

The installed package maps the repository's top-level folders: ``kvprefetch.controlplane``
(config, scheduling core, simulator, live service, CLI), ``kvprefetch.predictors`` (the
models of when a session returns) and ``kvprefetch.agents`` (per-node prefetch agents,
stores, engine integrations). This module is the small public face::

    from kvprefetch import connect, Hint

    client = connect("http://127.0.0.1:8080", tenant="acme", token="...")
    answer = client.route("s1", input_tokens=4096)
    client.request_started("s1", node=answer.node, input_tokens=4096)
    client.request_finished("s1", node=answer.node, output_tokens=300, stop_reason="tool_calls")
    client.hint("s1", Hint(kind="tool_running", eta_s=2.0))

and, for plug-in predictors, the :class:`Predictor` protocol and the registry
(:func:`create_predictor` takes a name, ``module:Class`` or an artifact path).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvprefetch.controlplane import __version__

if TYPE_CHECKING:
    from kvprefetch.controlplane.base.api import Hint, RouteAnswer
    from kvprefetch.controlplane.base.errors import KvPrefetchError
    from kvprefetch.controlplane.base.vocabulary import (
        HINT_KINDS,
        STOP_REASONS,
        canonical_stop_reason,
    )
    from kvprefetch.controlplane.live.client import Client, EventBatching
    from kvprefetch.controlplane.live.connect import connect
    from kvprefetch.predictors.base import Predictor
    from kvprefetch.predictors.registry import available as available_predictors
    from kvprefetch.predictors.registry import create as create_predictor

#: public name -> (module, attribute), imported on first use: importing a subpackage (as
#: LMCache and SGLang do with the plug-ins in kvprefetch.agents) loads none of these.
_PUBLIC: dict[str, tuple[str, str]] = {
    "Hint": ("kvprefetch.controlplane.base.api", "Hint"),
    "RouteAnswer": ("kvprefetch.controlplane.base.api", "RouteAnswer"),
    "KvPrefetchError": ("kvprefetch.controlplane.base.errors", "KvPrefetchError"),
    "HINT_KINDS": ("kvprefetch.controlplane.base.vocabulary", "HINT_KINDS"),
    "STOP_REASONS": ("kvprefetch.controlplane.base.vocabulary", "STOP_REASONS"),
    "canonical_stop_reason": ("kvprefetch.controlplane.base.vocabulary",
                              "canonical_stop_reason"),
    "Client": ("kvprefetch.controlplane.live.client", "Client"),
    "EventBatching": ("kvprefetch.controlplane.live.client", "EventBatching"),
    "connect": ("kvprefetch.controlplane.live.connect", "connect"),
    "Predictor": ("kvprefetch.predictors.base", "Predictor"),
    "available_predictors": ("kvprefetch.predictors.registry", "available"),
    "create_predictor": ("kvprefetch.predictors.registry", "create"),
}

__all__ = [
    "HINT_KINDS",
    "STOP_REASONS",
    "Client",
    "EventBatching",
    "Hint",
    "KvPrefetchError",
    "Predictor",
    "RouteAnswer",
    "__version__",
    "available_predictors",
    "canonical_stop_reason",
    "connect",
    "create_predictor",
]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'kvprefetch' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
