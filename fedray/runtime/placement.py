"""Reserving a set of actors' resources at once, in a placement group."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from fedray.errors import FedrayError

WAIT_S = 60.0


def reserve(bundles: list[dict[str, float]], strategy: str, what: str, hint: str, wait_s: float = WAIT_S) -> PlacementGroup:
    """A ready placement group of ``bundles``, or a clear error after ``wait_s`` seconds.

    All or nothing: a job either gets every bundle or fails with a message
    naming ``what`` it asked for, the cluster's totals and ``hint`` (what to
    lower), instead of running on a partial set or waiting forever.
    """
    group = placement_group(bundles, strategy=strategy)
    if not group.wait(timeout_seconds=wait_s):
        remove_placement_group(group)
        totals = ray.cluster_resources()
        raise FedrayError(
            f"could not reserve {what} in {wait_s:.0f} s (cluster: {totals.get('CPU', 0):.0f} CPU, "
            f"{totals.get('GPU', 0):.0f} GPU); {hint}"
        )
    return group
