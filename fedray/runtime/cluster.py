"""What the Ray cluster this driver is connected to can hold, and whether it can grow.

A request the cluster can never hold (115 one-CPU shards on 2 CPUs, a run
needing more memory than its nodes have) fails at once with the cluster's
resources in the message, unless an autoscaler may add the nodes it needs.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import ray

from fedray.core.errors import FedrayError
from fedray.runtime.footprint import Footprint

GB = 1e9


def alive_nodes() -> list[dict[str, float]]:
    """Each live node's total resources."""
    return [node["Resources"] for node in ray.nodes() if node["Alive"]]


def may_add_nodes() -> bool:
    """Whether an autoscaler may add nodes to this cluster.

    No for the Ray this process started itself (the embedded one,
    ``ray.init(address="local")``); no for a cluster whose autoscaler says it cannot grow: a cluster
    config (autoscaler v2, KubeRay) where no node group may scale up, or Ray's
    read-only autoscaler, the one a cluster started by hand with ``ray start``
    runs (it names every node's type after the node). Yes otherwise, to be safe.
    """
    try:  # Ray's private state API: should it fail (a Ray Client driver, a newer Ray), assume nodes may come
        node = ray._private.worker._global_node
        if node is not None and node.head:
            return False
        config = ray._private.state.state.get_cluster_config()
        if config is not None and config.node_group_configs:
            return any(group.max_count == -1 or group.max_count > group.min_count
                       for group in config.node_group_configs if group.resources and group.max_count != 0)
        return not _read_only_autoscaler()
    except Exception:
        return True


def _read_only_autoscaler() -> bool:
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.autoscaler._private.util import format_readonly_node_type
    from ray.experimental.internal_kv import _internal_kv_get

    status = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
    if not status:
        return False
    types = json.loads(status).get("autoscaler_report", {}).get("node_type_mapping") or {}
    return bool(types) and all(kind == format_readonly_node_type(node) for node, kind in types.items())


def bundles_that_fit(bundle: dict[str, float], nodes: list[dict[str, float]]) -> int:
    """How many copies of ``bundle`` the nodes' total resources hold (exact for equal bundles)."""
    return sum(min(math.floor(node.get(name, 0.0) / amount + 1e-9) for name, amount in bundle.items() if amount > 0)
               for node in nodes)


def describe(nodes: list[dict[str, float]]) -> str:
    """"2 CPU, 0 GPU, 16.4 GB memory on 1 node"."""
    total = {name: sum(node.get(name, 0.0) for node in nodes) for name in ("CPU", "GPU", "memory")}
    return (f"{total['CPU']:g} CPU, {total['GPU']:g} GPU, {total['memory'] / GB:.1f} GB memory on "
            f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}")


def check_bundles_fit(bundles: list[dict[str, float]], what: str, hint: str) -> None:
    """Fail at once when a placement group of ``bundles`` can never be placed and no autoscaler may add nodes: more
    copies of a bundle than the nodes hold (exact for equal bundles), or more of a resource than the cluster has."""
    nodes = alive_nodes()
    copies = Counter(tuple(sorted(bundle.items())) for bundle in bundles)
    too_many = any(bundles_that_fit(dict(bundle), nodes) < count for bundle, count in copies.items())
    names = {name for bundle in bundles for name in bundle}
    beyond = any(sum(bundle.get(name, 0.0) for bundle in bundles) > sum(node.get(name, 0.0) for node in nodes) + 1e-9
                 for name in names)
    if (too_many or beyond) and not may_add_nodes():
        raise FedrayError(f"cannot reserve {what}: the cluster has {describe(nodes)} and no autoscaler to add more; {hint}")


def check_memory(footprint: Footprint, shard_samples: np.ndarray, shard_tests: np.ndarray) -> None:
    """Fail at once when the estimated memory of ``footprint`` on shards of ``shard_samples`` training and
    ``shard_tests`` test rows cannot fit the cluster.

    The largest shard must fit the largest node, and all shards and the driver
    the cluster's total; skipped where an autoscaler may add nodes.
    """
    if may_add_nodes():
        return
    nodes = alive_nodes()
    memory = [node.get("memory", 0.0) for node in nodes]
    shards = [footprint.shard(int(samples), int(tests)) for samples, tests in zip(shard_samples, shard_tests)]
    total = sum(shards) + footprint.driver
    if max(shards) <= max(memory) and total <= sum(memory):
        return
    term = footprint.largest(shard_samples, int(np.sum(shard_tests)))
    raise FedrayError(
        f"{footprint.stage} needs about {total / GB:.1f} GB of memory ({len(shards)} shards of up to {max(shards) / GB:.1f} GB, "
        f"{footprint.driver / GB:.1f} GB on the driver; most of it {term.what}), more than the cluster's "
        f"{sum(memory) / GB:.1f} GB (largest node {max(memory) / GB:.1f} GB): {term.remedy}"
    )
