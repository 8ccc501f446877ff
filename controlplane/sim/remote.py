"""The simulated remote token store: Valkey (LRU-bounded by the fleet's
``valkey_capacity_bytes``) in front of S3 (unbounded, durable).

The simulation writes a session's whole context after each of its responses
(:meth:`RemoteStore.write`) and touches it again when a transfer reads it (a read promotes
into Valkey, as the tiered store does); :meth:`RemoteStore.source` says where the next
read of a session comes from and at what cost per byte."""

from __future__ import annotations

from collections import OrderedDict

from kvprefetch.controlplane.base.config import FleetConfig


class RemoteStore:
    """Which sessions Valkey holds, in LRU order, and each tier's read cost."""

    def __init__(self, fleet: FleetConfig) -> None:
        self._remote = fleet.remote
        self._bpt = fleet.model.kv_bytes_per_token
        nic = fleet.node.nic_bytes_per_s
        self._valkey_s_per_byte = 1.0 / min(nic, self._remote.valkey_gbyte_s_per_node * 1e9)
        self._s3_s_per_byte = 1.0 / min(
            nic, self._remote.s3_gbyte_s_per_connection * 1e9 * self._remote.s3_connections)
        #: Tokens of each session's stored context.
        self._tokens: dict[str, int] = {}
        #: Bytes in Valkey per session, least recently used first.
        self._valkey: OrderedDict[str, int] = OrderedDict()
        self._valkey_bytes = 0

    def source(self, session_id: str) -> tuple[float, float, bool]:
        """(seconds per byte, first-byte latency, from S3?) of the session's remote copy."""
        if session_id in self._valkey:
            return self._valkey_s_per_byte, self._remote.valkey_latency_s, False
        return self._s3_s_per_byte, self._remote.s3_first_byte_s, True

    def write(self, session_id: str, tokens: int) -> None:
        """The session's context of ``tokens`` is stored (Valkey and S3)."""
        self._tokens[session_id] = tokens
        self.touch(session_id)

    def touch(self, session_id: str) -> None:
        """Write or promote the session's object into Valkey (LRU beyond its capacity)."""
        cap = self._remote.valkey_capacity_bytes
        nbytes = self._tokens.get(session_id, 0) * self._bpt
        old = self._valkey.pop(session_id, None)
        if old is not None:
            self._valkey_bytes -= old
        if nbytes > cap:
            return
        self._valkey[session_id] = nbytes
        self._valkey_bytes += nbytes
        while self._valkey_bytes > cap:
            _, b = self._valkey.popitem(last=False)
            self._valkey_bytes -= b
