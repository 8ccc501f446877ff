"""The Ray actors' names live in the base layer: plain strings both sides of a lookup share
(the scheduler starts its shards under them, the client, agents and engines look them up),
importable without Ray."""

from __future__ import annotations

import subprocess
import sys

from kvprefetch.controlplane.base.actors import (
    NAMESPACE,
    SCHEDULER_NAME,
    agent_name,
    engine_name,
    node_resource,
    scheduler_name,
)


def test_shard_zero_keeps_the_unsharded_name_and_shards_are_distinct() -> None:
    assert scheduler_name() == scheduler_name(0) == SCHEDULER_NAME == "kvprefetch-scheduler"
    names = [scheduler_name(i) for i in range(16)]
    assert len(set(names)) == 16
    assert scheduler_name(3, base="other") == "other-3"


def test_per_node_names_are_distinct_across_kinds_and_nodes() -> None:
    names = [f(n) for f in (agent_name, engine_name, node_resource) for n in range(8)]
    assert len(set(names)) == len(names)
    assert NAMESPACE == "kvprefetch"


def test_the_names_import_without_ray() -> None:
    code = ("import sys; import kvprefetch.controlplane.base.actors; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_the_client_and_the_agents_share_the_base_names() -> None:
    """The agents' Ray entry and the service's wiring use the base layer's names: no
    second definition of a name a lookup depends on."""
    from kvprefetch.agents import ray_entry
    from kvprefetch.controlplane.live import ray_app

    assert ray_entry.SCHEDULER_NAME is SCHEDULER_NAME
    assert ray_app.scheduler_name is scheduler_name
    assert ray_app.agent_name is agent_name
