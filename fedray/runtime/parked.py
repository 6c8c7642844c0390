"""Actor groups parked between the runs of one process, to be taken again by the next run that fits them.

Starting a pool's actors costs seconds (a process each, torch imported, the
rows loaded): paid by every run of a sweep's trials, every method of the
quickstart, every ``fedray.run`` in a notebook. A run that ends cleanly may
park its actors here instead of killing them, and the next run asking for
the same actors takes them back and reloads them. A parked group keeps its
placement group, and so its CPUs: anything else of this process that
reserves resources calls :func:`make_room` first (the longest parked give
way until what it asks fits, :func:`~fedray.runtime.placement.reserve`) or
:func:`release` (a sweep's trials), so that parked actors never stand in its
way. Groups of several layouts may stay parked side by side (one run on one
shard, the next on two, each taking its own again).

Parking is only for a Ray this process started itself (an embedded one):
on a cluster other jobs would wait for the CPUs a parked group holds. And
in a Tune trial's own bundles: a sweep keeps a finished trial's process,
with its placement group, for its next trial of the same resources (Tune's
actor reuse), so its shards wait for nobody else's CPUs, are taken by that
next trial, and end with the process.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

import ray

from fedray.runtime.ray_start import started_embedded_ray


class Parkable(Protocol):
    def end(self) -> None:
        """Kill the actors and free their resources (never park them again)."""

    def reserved(self) -> dict[str, float]:
        """The resources the group holds (each actor's bundle times the actors)."""


_parked: dict[Hashable, Parkable] = {}


def allowed() -> bool:
    """Whether actors may be parked: a Ray is running and this process started it (its head node is ours)."""
    return started_embedded_ray()


def _session() -> str:
    """The running Ray's identity (its head node's id, new with every ``ray.init``)."""
    return ray.get_runtime_context().get_node_id()


def park(key: Hashable, group: Parkable) -> None:
    """Keep ``group`` under ``key`` for :func:`take`, shutting down one parked before under the same key."""
    previous = _parked.pop((_session(), key), None)
    _parked[(_session(), key)] = group
    if previous is not None:
        previous.end()


def take(key: Hashable) -> Parkable | None:
    """The group parked under ``key`` in the running Ray, no longer parked; None if there is none. Groups parked in
    an earlier Ray (ended since) are forgotten: their actors ended with it."""
    session = _session()
    for stale in [entry for entry in _parked if entry[0] != session]:
        del _parked[stale]
    return _parked.pop((session, key), None)


def make_room(needed: dict[str, float]) -> None:
    """Shut down parked groups of the running Ray, the longest parked first, until ``needed`` (a resource's amount by
    name) fits in what Ray reports free plus what the groups shut down held; every one if it never fits."""
    if not _parked:
        return
    free = ray.available_resources()
    session = _session()
    for entry in list(_parked):
        if all(free.get(name, 0.0) >= amount - 1e-9 for name, amount in needed.items()):
            return
        group = _parked.pop(entry)
        if entry[0] == session:
            for name, amount in group.reserved().items():
                free[name] = free.get(name, 0.0) + amount
            group.end()


def any_parked() -> bool:
    """Whether a group is parked (in the running Ray or an earlier one)."""
    return bool(_parked)


def release() -> None:
    """Shut down every parked group of the running Ray (their CPUs free again), forgetting those of an earlier one."""
    parked = list(_parked.items())
    _parked.clear()
    if not ray.is_initialized():
        return
    session = _session()
    for (parked_in, _), group in parked:
        if parked_in == session:
            group.end()
