"""Eviction of the agents' local tiers: the scheduler's advice reaches ``eviction: predicted``
through the agent (orders' deadlines, evict advice), in the one tier vocabulary
(:mod:`kvprefetch.controlplane.base.tiers`: the largest key goes first)."""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
from kvprefetch.agents.embedded import EmbeddedValkey
from kvprefetch.agents.stores.base import (
    Buffer,
    CancelToken,
    GetResult,
    ObjectStore,
    OpResult,
    PayloadSink,
)
from kvprefetch.agents.stores.eviction import LruPolicy, PredictedNextUsePolicy, make_policy
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.controlplane.base.keys import payload
from kvprefetch.controlplane.base.tiers import Tier, TierEntry
from kvprefetch.controlplane.base.wire import TransferOrder
from kvprefetch.controlplane.core import tiers as core_tiers

KIB = 1024


def entry(key: str, last_use_s: float) -> TierEntry:
    return TierEntry(key, 0, 10, last_use_s)


def eviction_order(policy: PredictedNextUsePolicy | LruPolicy, entries: list[TierEntry]
                   ) -> list[str]:
    """Keys in the order a :class:`Tier` evicts them (largest key first)."""
    tier = Tier("t", 10 * len(entries), policy)
    for e in entries:
        tier.put(e)
    victims = tier.victims_for(tier.capacity_bytes, 0.0)
    assert victims is not None
    return [v.key for v in victims]


def test_core_and_agents_share_one_entry_type_and_lru() -> None:
    assert core_tiers.TierEntry is TierEntry and core_tiers.Tier is Tier
    e = TierEntry("s", 7, 70, 1.0)
    assert e.session_id == e.key == "s"  # the core's books name entries by session
    # LRU: the largest key (the oldest use) goes first, on both sides.
    assert eviction_order(LruPolicy(), [entry("new", 3.0), entry("old", 1.0),
                                        entry("mid", 2.0)]) == ["old", "mid", "new"]


def test_predicted_order_never_then_unadvised_then_furthest_advised() -> None:
    policy = PredictedNextUsePolicy()
    policy.advise({"soon": 10.0, "far": 500.0, "mid": 50.0, "drop-old": math.inf,
                   "drop-new": math.inf})
    entries = [entry("soon", 1.0), entry("far", 9.0), entry("mid", 2.0),
               entry("written-new", 8.0), entry("written-old", 3.0),
               entry("drop-new", 7.0), entry("drop-old", 4.0)]
    assert eviction_order(policy, entries) == [
        "drop-old", "drop-new",          # advised never needed: least recent first
        "written-old", "written-new",    # no advice: least recent first
        "far", "mid", "soon",            # advised: furthest predicted use first
    ]


def test_advice_is_spent_once_the_scheduler_clock_passes_it() -> None:
    policy = PredictedNextUsePolicy()
    policy.advise({"a": 10.0, "b": 500.0})
    assert eviction_order(policy, [entry("a", 1.0), entry("b", 2.0)]) == ["b", "a"]
    # A demand load dispatched at scheduler time 100: a's predicted use (10) has passed,
    # so a no longer outranks keys without advice.
    policy.advise({"c": 100.0}, now_s=100.0)
    assert policy.next_use_s("a") is None and policy.next_use_s("b") == 500.0
    assert eviction_order(policy, [entry("a", 1.0), entry("b", 2.0), entry("c", 3.0)]
                          ) == ["a", "b", "c"]
    policy.forget(["b"])
    assert policy.next_use_s("b") is None


def test_advice_is_bounded() -> None:
    policy = PredictedNextUsePolicy(max_advice=3)
    policy.advise({k: 1.0 for k in "abcde"})
    assert [policy.next_use_s(k) for k in "abcde"] == [None, None, 1.0, 1.0, 1.0]


def test_unknown_policy_is_a_config_error() -> None:
    from kvprefetch.agents.stores.errors import StoreConfigError

    assert make_policy("predicted").name == "predicted"
    with pytest.raises(StoreConfigError):
        make_policy("lfu")


# -- through the agent, with a real valkey-server ---------------------------------------------


def _agent(tmp_path: Path, valkey: EmbeddedValkey, eviction: str, capacity: int
           ) -> PrefetchAgent:
    remote = RemoteStoreConfig(valkey=valkey.store_config(
        key_prefix=f"evict-{uuid.uuid4().hex[:8]}:", connect_timeout_s=0.5,
        socket_timeout_s=2.0))
    return PrefetchAgent(AgentConfig(
        node=0, remote=remote,
        dram=LocalTierConfig(path=str(tmp_path / eviction), capacity_bytes=capacity,
                             part_bytes=4 * KIB, eviction=eviction)))


def _run(agent: PrefetchAgent, order_id: int, key: str, deadline_s: float, *,
         prefetch: bool = True) -> None:
    agent.execute(TransferOrder(order_id, f"t/{key}", 0, (key,), 1, 1, prefetch, deadline_s))
    report = agent.wait(order_id, timeout_s=10)
    assert report is not None and report.complete, report


@pytest.mark.servers
@pytest.mark.parametrize(("eviction", "victim"), [("lru", "t/a/0"), ("predicted", "t/b/0")])
def test_agent_tier_under_pressure_evicts_what_the_scheduler_predicts_furthest(
        tmp_path: Path, valkey_server: EmbeddedValkey, eviction: str, victim: str) -> None:
    """Orders land a (needed at 100), b (at 5000), c (at 200); d (at 300) overflows the tier.
    LRU evicts a, the oldest; ``predicted`` evicts b, whose predicted use is furthest."""
    keys = ["t/a/0", "t/b/0", "t/c/0", "t/d/0"]
    with _agent(tmp_path, valkey_server, eviction, capacity=1 << 20) as probe:
        assert all(r.ok for r in probe.store.put([(k, payload(k, 16 * KIB)) for k in keys]))
        probe.write_local([("probe", payload("probe", 16 * KIB))])
        object_bytes = probe.tier.used_bytes
        store_config = probe.config.remote
    capacity = 3 * object_bytes + object_bytes // 2  # three objects fit, four do not
    agent = PrefetchAgent(AgentConfig(
        node=0, remote=store_config,
        dram=LocalTierConfig(path=str(tmp_path / f"{eviction}-small"), capacity_bytes=capacity,
                             part_bytes=4 * KIB, eviction=eviction)))
    with agent:
        for i, (key, deadline) in enumerate(zip(keys, [100.0, 5000.0, 200.0, 300.0],
                                                strict=True)):
            _run(agent, i + 1, key, deadline)
        assert sorted(agent.inventory()) == sorted(set(keys) - {victim})
        assert agent.tier.stats().evictions == 1
        agent.store.delete(keys)


@pytest.mark.servers
def test_engine_write_through_goes_before_advised_keys_and_evict_advice_deletes(
        tmp_path: Path, valkey_server: EmbeddedValkey) -> None:
    """Under ``predicted``, KV the engine wrote (no advice) goes before KV the scheduler
    fetched for a predicted use, though the fetched KV is older; evict advice deletes keys
    and their advice."""
    keys = ["t/a/0", "t/b/0"]
    with _agent(tmp_path, valkey_server, "predicted", capacity=1 << 20) as probe:
        assert all(r.ok for r in probe.store.put([(k, payload(k, 16 * KIB)) for k in keys]))
        probe.write_local([("w/0", payload("w/0", 16 * KIB))])
        object_bytes = probe.tier.used_bytes
        store_config = probe.config.remote
    agent = PrefetchAgent(AgentConfig(
        node=0, remote=store_config,
        dram=LocalTierConfig(path=str(tmp_path / "small"), capacity_bytes=int(2.5 * object_bytes),
                             part_bytes=4 * KIB, eviction="predicted")))
    with agent:
        _run(agent, 1, "t/a/0", 100.0)
        assert agent.write_local([("w/0", payload("w/0", 16 * KIB))]) == 1
        _run(agent, 2, "t/b/0", 200.0)  # overflows: the engine's chunk goes, a stays
        assert sorted(agent.inventory()) == ["t/a/0", "t/b/0"]
        assert agent.evict(keys=["t/a/0"]) == 1
        assert agent.inventory() == ("t/b/0",)
        assert isinstance(agent.tier.policy, PredictedNextUsePolicy)
        assert agent.tier.policy.next_use_s("t/a/0") is None
        assert agent.tier.policy.next_use_s("t/b/0") == 200.0
        agent.store.delete(keys)


class _GatedStore:
    """The real store, except that reads of ``gated`` wait for ``gate`` (a transfer that is
    still running when evict advice arrives)."""

    def __init__(self, inner: ObjectStore, gated: str) -> None:
        self._inner = inner
        self.name = inner.name
        self.gated = gated
        self.gate = threading.Event()

    def start(self) -> None:
        self._inner.start()

    def close(self) -> None:
        self._inner.close()

    def exists(self, keys: Sequence[str], *, cancel: CancelToken | None = None
               ) -> list[OpResult]:
        return self._inner.exists(keys, cancel=cancel)

    def get(self, keys: Sequence[str], *, sink: PayloadSink | None = None,
            cancel: CancelToken | None = None) -> list[GetResult]:
        if self.gated in keys:
            assert self.gate.wait(10)
        return self._inner.get(keys, sink=sink, cancel=cancel)

    def put(self, items: Sequence[tuple[str, Buffer]], *, ttl_s: float | None = None,
            cancel: CancelToken | None = None) -> list[OpResult]:
        return self._inner.put(items, ttl_s=ttl_s, cancel=cancel)

    def delete(self, keys: Sequence[str], *, cancel: CancelToken | None = None
               ) -> list[OpResult]:
        return self._inner.delete(keys, cancel=cancel)


@pytest.mark.servers
def test_evict_advice_for_a_running_transfer_makes_its_keys_first_to_go(
        tmp_path: Path, valkey_server: EmbeddedValkey) -> None:
    """Evict advice cannot delete the key of a running transfer; under ``predicted`` the
    key lands advised as never needed, and is the first to go (LRU would pick a)."""
    keys = ["t/a/0", "t/b/0", "t/c/0", "t/d/0"]
    with _agent(tmp_path, valkey_server, "predicted", capacity=1 << 20) as probe:
        assert all(r.ok for r in probe.store.put([(k, payload(k, 16 * KIB)) for k in keys]))
        probe.write_local([("probe", payload("probe", 16 * KIB))])
        object_bytes = probe.tier.used_bytes
        remote = probe.config.remote
    store = _GatedStore(remote.build(), gated="t/c/0")
    agent = PrefetchAgent(AgentConfig(
        node=0, remote=remote,
        dram=LocalTierConfig(path=str(tmp_path / "small"), capacity_bytes=int(3.5 * object_bytes),
                             part_bytes=4 * KIB, eviction="predicted")), store=store)
    with agent:
        _run(agent, 1, "t/a/0", 100.0)
        _run(agent, 2, "t/b/0", 5000.0)
        agent.execute(TransferOrder(3, "t/c", 0, ("t/c/0",), 1, 1, True, 200.0))
        assert agent.evict(keys=["t/c/0"]) == 0  # still moving: kept, advised never needed
        store.gate.set()
        report = agent.wait(3, timeout_s=10)
        assert report is not None and report.complete
        _run(agent, 4, "t/d/0", 300.0)  # overflows the tier
        assert sorted(agent.inventory()) == ["t/a/0", "t/b/0", "t/d/0"]
        agent.store.delete(keys)


@pytest.mark.servers
def test_evict_advice_that_arrives_while_an_order_starts_keeps_the_keys_it_found_present(
        tmp_path: Path, valkey_server: EmbeddedValkey, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray runs an agent's calls on many threads: evict advice for a session can land after
    a new order for it has found a key present (and will not load it) but before the
    transfer is registered. The key must stay: the order reports it delivered."""
    key = "t/a/0"
    with _agent(tmp_path, valkey_server, "predicted", capacity=1 << 20) as agent:
        assert all(r.ok for r in agent.store.put([(key, payload(key, 16 * KIB))]))
        _run(agent, 1, key, 100.0)
        assert agent.inventory() == (key,)
        backend = agent.backend
        real_warm = backend.warm
        deleted: list[int] = []

        def warm_then_evict(order: TransferOrder) -> object:
            handle = real_warm(order)
            racer = threading.Thread(target=lambda: deleted.append(agent.evict(keys=[key])))
            racer.start()
            racer.join(5)
            return handle

        monkeypatch.setattr(backend, "warm", warm_then_evict)
        agent.execute(TransferOrder(2, "t/a", 0, (key,), 1, 1, True, 200.0))
        report = agent.wait(2, timeout_s=10)
        assert report is not None and report.complete
        assert deleted == [0] and agent.inventory() == (key,)
        agent.store.delete([key])
