"""The OpenAI-compatible gateway (:mod:`kvprefetch.controlplane.live.gateway`) as a Ray Serve
application, for a cluster: ``serve.run(gateway_application(config, scheduler="auto"))``.

Each replica builds its own :class:`~kvprefetch.controlplane.live.gateway.Gateway` when Serve starts
it (``__serve_build_asgi_app__``: the constructor does no I/O), connects to the scheduler
(``"auto"``: the named scheduler actor on the same Ray cluster; ``http://...``: its HTTP
API) and, when ``valkey`` names one, to the token store the nodes' agents read. Serve then
routes HTTP requests to the replica's FastAPI app (:func:`~kvprefetch.controlplane.live.gateway.
build_app`); its lifespan opens and closes the upstream client. Several replicas are
independent gateways: each balances by its own in-flight counts when the scheduler is
unreachable.

Ray Serve is imported only here, when an application is built.
"""

from __future__ import annotations

from typing import Any

from kvprefetch.controlplane.live.gateway import GatewayConfig


def gateway_application(config: GatewayConfig, *, scheduler: str | None = None,
                        scheduler_token: str | None = None, valkey: str | None = None,
                        name: str = "kvp-gateway", num_replicas: int = 1) -> Any:
    """A bound Serve application of the gateway (pass it to ``serve.run``).
    ``scheduler``: ``"auto"``, a Ray address or an ``http://`` URL (None: route by load
    only); ``valkey``: ``host:port`` of the token store (None: token ids not stored)."""
    from ray import serve

    if num_replicas < 1:
        raise ValueError("num_replicas must be >= 1")

    @serve.deployment(name=name, num_replicas=num_replicas)
    @serve.ingress()
    class GatewayDeployment:
        """One gateway replica (see the module docstring)."""

        def __init__(self, config_json: dict[str, Any], scheduler: str | None,
                     token: str | None, valkey: str | None) -> None:
            self._config = GatewayConfig.model_validate(config_json)
            self._scheduler, self._token, self._valkey = scheduler, token, valkey
            self._store: Any = None

        def __serve_build_asgi_app__(self) -> Any:
            from kvprefetch.controlplane.live.gateway import Gateway, build_app, store_sink

            client = None
            if self._scheduler:
                from kvprefetch.controlplane.live.batching import EventBatching
                from kvprefetch.controlplane.live.connect import connect

                # Inside the cluster: the actor handle, events batched (HTTP: persistent
                # connections; batching applies to Ray only).
                client = connect(self._scheduler, tenant=self._config.tenant,
                                 token=self._token, batching=EventBatching())
            tokens = None
            if self._valkey:
                from kvprefetch.agents.stores.valkey.store import ValkeyStore, ValkeyStoreConfig

                host, _, port = self._valkey.rpartition(":")
                self._store = ValkeyStore(ValkeyStoreConfig(host=host, port=int(port)))
                self._store.start()
                tokens = store_sink(self._store)
            return build_app(Gateway(self._config, scheduler=client, tokens=tokens))

    deployment: Any = GatewayDeployment  # Serve's decorators make it a Deployment
    return deployment.bind(config.model_dump(), scheduler, scheduler_token, valkey)
