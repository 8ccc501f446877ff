"""Suffix eviction in the live service: the core cuts a victim back to a prefix, and the
driver advises the node's agent to delete exactly the chunks past it."""

from __future__ import annotations

import pytest

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.core.step import StepOutput
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.ports import Outbox
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
#: One node whose DRAM tier holds 131,072 tokens of 8B KV: two 50k-token sessions and a
#: 31,072-token gap.
ONE_NODE = fleet_from_dict({"nodes": 1, "node": {"hbm_kv_bytes": 4 * GIB,
                                                 "dram_tier_bytes": 16 * GIB}})


def test_a_trim_is_evict_advice_for_the_chunks_past_the_kept_prefix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with SchedulerService(ServiceConfig(fleet=ONE_NODE, policy="predictive")).start() as svc:
        driver = svc.driver
        carried: list[tuple[StepOutput, Outbox]] = []
        real = driver.carry

        def carry(out: StepOutput, box: Outbox) -> None:
            carried.append((out, box))
            real(out, box)

        monkeypatch.setattr(driver, "carry", carry)
        c = connect(service=svc, tenant="t")
        for sid in ("a", "b", "c"):
            node = c.route(sid, input_tokens=49_900, reused_tokens=0).node
            assert node == 0
            c.request_finished(sid, node=0, input_tokens=49_900, output_tokens=100)
        (trim,) = [t for out, _ in carried for t in out.trims]
        assert trim.node == 0 and trim.keep_tokens == 31_072 // 256 * 256
        info = svc.registry.get(SessionKey.parse(trim.session_id))
        assert info is not None
        chunks = svc.registry.keys_of(info, info.context_tokens)
        advised = [keys for _, box in carried for node, _, keys in box.evict if keys]
        assert advised == [tuple(chunks[trim.keep_tokens // 256:])]
        # The books keep the prefix: the session is local up to it.
        assert driver.core.local_tokens(0, trim.session_id) == trim.keep_tokens
