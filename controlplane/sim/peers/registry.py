"""The peers' HBM retention strategies by name (``PolicySpec.hbm_retention``): a factory
each, which imports its strategy's module only when called."""

from __future__ import annotations

from collections.abc import Callable

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.sim.peers.hbm_retention import HbmRetention

__all__ = ["HBM_RETENTIONS", "make_hbm_retention"]


def _continuum(fleet: FleetConfig) -> HbmRetention:
    from kvprefetch.controlplane.sim.peers.continuum import ContinuumTtl

    return ContinuumTtl(fleet)


def _mori(fleet: FleetConfig) -> HbmRetention:
    from kvprefetch.controlplane.sim.peers.mori import MoriIdleness

    return MoriIdleness(fleet)


#: Retention strategies by name: a factory each, which imports its module when called.
HBM_RETENTIONS: dict[str, Callable[[FleetConfig], HbmRetention]] = {
    "continuum": _continuum,
    "mori": _mori,
}


def make_hbm_retention(name: str, fleet: FleetConfig) -> HbmRetention:
    """The retention strategy ``name`` (a key of :data:`HBM_RETENTIONS`) for ``fleet``."""
    factory = HBM_RETENTIONS.get(name)
    if factory is None:
        raise ConfigError(f"unknown HBM retention {name!r}; known: {', '.join(HBM_RETENTIONS)}")
    return factory(fleet)
