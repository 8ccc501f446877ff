"""The names under which kvprefetch's Ray actors meet: the namespace, the scheduler (one per
shard), the agent and the engine of each node, and the custom resource that places a node's
actors. The scheduler side starts actors under these names and the client, the agents and
the engines look them up by them, so they live here, below both. Plain strings: no Ray."""

from __future__ import annotations

#: The Ray namespace every kvprefetch actor lives in (``serve.ray.namespace`` overrides it).
NAMESPACE = "kvprefetch"
#: The named actor of the scheduler, and of its shard 0.
SCHEDULER_NAME = "kvprefetch-scheduler"


def scheduler_name(shard: int = 0, base: str = SCHEDULER_NAME) -> str:
    """The named actor of scheduler shard ``shard`` (shard 0 keeps the unsharded name)."""
    return base if shard == 0 else f"{base}-{shard}"


def agent_name(node: int) -> str:
    """The named actor of node ``node``'s prefetch agent."""
    return f"kvprefetch-agent-{node}"


def engine_name(node: int) -> str:
    """The named actor of node ``node``'s engine."""
    return f"kvprefetch-engine-{node}"


def node_resource(node: int) -> str:
    """The custom resource that marks logical node ``node`` (one machine, many nodes)."""
    return f"kvprefetch_node_{node}"
