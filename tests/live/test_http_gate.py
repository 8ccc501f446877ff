"""The connection gate's books (pure: connections stand in for sockets): which connection
makes room for a new one, when a newcomer is refused, and the ``/healthz`` budget."""

from __future__ import annotations

from typing import Any

from kvprefetch.controlplane.live.http_conn import Connection, ConnectionGate
from kvprefetch.controlplane.live.limits import RequestLimits


class _Socket:
    """Stands in for a connection's protocol: records that the gate closed it."""

    def __init__(self) -> None:
        self.closed = False

    def abort_idle(self) -> None:
        self.closed = True


def _conn(host: str, **flags: Any) -> Connection:
    return Connection(host, _Socket(), **flags)  # type: ignore[arg-type]


def test_the_oldest_idle_unproven_connection_makes_room() -> None:
    gate = ConnectionGate(RequestLimits(max_connections=3, health_connections=1))
    proven, busy, idle = _conn("a", proven=True), _conn("b", busy=True), _conn("c")
    for c in (proven, busy, idle):
        assert gate.admit(c)
    newcomer = _conn("d")
    assert gate.admit(newcomer) and idle.protocol.closed  # type: ignore[attr-defined]
    assert not proven.protocol.closed and not busy.protocol.closed  # type: ignore[attr-defined]
    assert gate.evicted == 1 and list(gate.connections) == [proven, busy, newcomer]
    newcomer.busy = True
    # every slot busy or proven: one more for /healthz only, then refused
    health = _conn("e")
    assert gate.admit(health) and health.reserve
    assert not gate.admit(_conn("f")) and gate.refused == 1
    gate.release(health)
    gate.release(health)  # released once only
    assert gate.reserve == 0 and gate.admit(_conn("g"))


def test_one_address_is_held_to_its_own_cap() -> None:
    gate = ConnectionGate(RequestLimits(max_connections=10, max_connections_per_client=2,
                                        health_connections=0))
    other = _conn("b")
    first, second = _conn("a"), _conn("a")
    for c in (other, first, second):
        assert gate.admit(c)
    third = _conn("a")
    assert gate.admit(third) and first.protocol.closed  # type: ignore[attr-defined]
    assert not other.protocol.closed  # type: ignore[attr-defined]
    second.proven = third.busy = True
    assert not gate.admit(_conn("a"))  # the address's own connections are all in use
    assert gate.admit(_conn("c"))  # others are not held back
    assert gate.per_host == {"a": 2, "b": 1, "c": 1}
