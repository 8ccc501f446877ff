"""A Ray cluster of raylets in one machine (``ray.cluster_utils.Cluster``), as the tests
of nodes that join and leave use it: a head for the scheduler, GPU-node raylets (the
``gpu_node`` resource) for the agents, and a wait that outlasts actors starting."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

MIB = 1 << 20
#: Each raylet's object store (the smallest Ray accepts, about).
OBJECT_STORE_BYTES = 80 * MIB


def add_gpu_node(cluster: Any) -> Any:
    """A raylet with no CPU for tasks and one ``gpu_node`` (where agents are placed)."""
    return cluster.add_node(num_cpus=0, object_store_memory=OBJECT_STORE_BYTES,
                            resources={"gpu_node": 1})


@contextmanager
def gpu_cluster() -> Iterator[tuple[Any, Any]]:
    """A head and one GPU-node raylet, this process connected (namespace ``kvprefetch``):
    ``(cluster, first GPU node)``; Ray and the cluster are shut down on exit."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False})
    try:
        first = add_gpu_node(cluster)
        ray.init(address=cluster.address, namespace="kvprefetch", log_to_driver=False)
        yield cluster, first
    finally:
        ray.shutdown()
        cluster.shutdown()


def wait_for(pred: Callable[[], Any], timeout_s: float) -> bool:
    """Whether ``pred()`` turns true within ``timeout_s``; an error counts as not yet (an
    actor starting answers with one for a while)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if pred():
                return True
        except Exception:
            pass
        time.sleep(0.2)
    return False
