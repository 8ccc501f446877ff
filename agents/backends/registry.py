"""The node backends by name: the one place that knows them.

``agent.backend`` (and the engine emulator's ``backend``) names one of :data:`BACKENDS`;
:func:`backend_spec` gives its entry, whose ``load`` imports the backend's module only when
it is selected (LMCache's and SGLang's clients stay unimported on a ``local`` node). A
config's cross-field rule (each backend needs its own section) is :func:`require_settings`.
What a caller would otherwise decide by a backend's name (whether it keeps a tier, runs a
node server, serves an engine profile) is a field of its :class:`BackendSpec`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from kvprefetch.controlplane.base.errors import ConfigError

if TYPE_CHECKING:
    from kvprefetch.agents.backends.base import BackendContext, NodeBackend

#: Where a node's agent lands orders and its engine finds KV.
BackendName = Literal["local", "lmcache-mp", "sglang"]
#: The backends the engine emulator serves from (SGLang's engine is not emulated).
EngineBackendName = Literal["local", "lmcache-mp"]
#: What a node runs unless its config names a backend, and what ``kvprefetch serve
#: --embedded`` runs in place of a backend whose node server it does not start.
DEFAULT_BACKEND: BackendName = "local"


@dataclass(frozen=True)
class NodeServer:
    """A server each node runs beside its engine, which the backend talks to (LMCache's
    MP server): ``kvprefetch serve check`` probes it, ``serve --embedded`` (which starts
    none) runs :data:`DEFAULT_BACKEND` instead."""

    #: The server's name in messages ("LMCache").
    what: str
    #: The field of the backend's settings that holds the server's URL.
    url_field: str
    #: How a user starts it, for the message that finds none.
    start: str

    def url_of(self, settings: object) -> str:
        """The server's URL in the backend's settings."""
        return str(getattr(settings, self.url_field))


@dataclass(frozen=True)
class BackendSpec:
    """One backend: its name, the class that implements it (``module:Class``, imported on
    :meth:`load`), the config sections it needs and what the engine does with it."""

    name: str
    target: str
    #: Config sections that must be set: (field, what it is), in the order they are named.
    needs: tuple[tuple[str, str], ...]
    #: The config field of the backend's own settings (None: it has none).
    section: str | None
    #: The engine stores its KV through the backend's own server (the agent's write-through
    #: then has nothing to do, and the engine emulator runs that server's client).
    engine_stores_through_server: bool
    #: What ``needs`` says when a section is missing (the message names them).
    needs_text: str
    #: The server each node runs for the backend (None: it needs none).
    server: NodeServer | None = None
    #: Engine profiles (as ``kvprefetch.controlplane.core.engines`` names them) the
    #: backend cannot serve -> why, for the config error.
    refused_engines: Mapping[str, str] = field(default_factory=dict)
    #: What carries out an engine mechanism on this backend's nodes where the deployment's
    #: default does not (mechanism, as ``kvprefetch.controlplane.core.engines.Mechanism``
    #: names it -> the setting or API).
    carried_by: Mapping[str, str] = field(default_factory=dict)

    def load(self) -> type[NodeBackend]:
        module_name, _, cls_name = self.target.partition(":")
        cls: type[NodeBackend] = getattr(importlib.import_module(module_name), cls_name)
        return cls

    def build(self, context: BackendContext) -> NodeBackend:
        """A backend instance (no I/O until its ``start``)."""
        return self.load()(context)  # type: ignore[call-arg]

    @property
    def needs_tier(self) -> bool:
        """Whether the backend keeps the node's local tier (``dram``)."""
        return any(field == "dram" for field, _ in self.needs)

    def settings_of(self, config: object) -> object | None:
        """The backend's own section of ``config`` (an agent or engine config)."""
        return getattr(config, self.section, None) if self.section else None


BACKENDS: dict[str, BackendSpec] = {spec.name: spec for spec in (
    BackendSpec("local", "kvprefetch.agents.backends.local.backend:LocalBackend",
                needs=(("dram", "the node's local tier"),), section=None,
                engine_stores_through_server=False,
                needs_text="'dram' ({dram})"),
    BackendSpec("lmcache-mp", "kvprefetch.agents.backends.lmcache.backend:LMCacheBackend",
                needs=(("lmcache", "the node's LMCache server"),), section="lmcache",
                engine_stores_through_server=True,
                needs_text="'lmcache' ({lmcache})",
                server=NodeServer("LMCache", "http_url", "lmcache server --http-port ..."),
                refused_engines={"sglang-hicache": "SGLang's nodes warm through agent.backend "
                                                   "sglang, not lmcache-mp"},
                carried_by={
                    "demote-on-evict": "lmcache.mp.lazy_offload in vLLM's connector config "
                                       "(vllm_connector)",
                    "queued-load": "lmcache.mp.eager_prefetch in vLLM's connector config "
                                   "(vllm_connector)",
                    "evict-advice": "the agent's evict advice to LMCache's L1"}),
    BackendSpec("sglang", "kvprefetch.agents.backends.sglang.backend:SGLangBackend",
                needs=(("dram", "the tier SGLang's kvprefetch backend reads first"),
                       ("sglang", "model_name, page_size ...")), section="sglang",
                engine_stores_through_server=False,
                needs_text="'dram' ({dram}) and 'sglang' ({sglang})"),
)}
assert set(BACKENDS) == set(get_args(BackendName))
assert not BACKENDS[DEFAULT_BACKEND].server and BACKENDS[DEFAULT_BACKEND].needs_tier


def backend_spec(name: str) -> BackendSpec:
    """The registry's entry for ``name``.

    Raises:
        ConfigError: no backend has that name (the message lists those that do).
    """
    spec = BACKENDS.get(name)
    if spec is None:
        raise ConfigError(f"unknown node backend {name!r}; known: {', '.join(BACKENDS)}")
    return spec


def require_settings(name: str, sections: dict[str, object | None],
                     described: dict[str, str] | None = None) -> None:
    """A config's cross-field rule: backend ``name`` needs its own sections set
    (pydantic validators call it; ``ValueError`` names the missing sections).
    ``described`` overrides what a section is called in the message (by field)."""
    spec = backend_spec(name)
    if all(sections.get(field) is not None for field, _ in spec.needs):
        return
    words = {field: what for field, what in spec.needs} | (described or {})
    raise ValueError(f"backend '{name}' needs " + spec.needs_text.format(**words))
