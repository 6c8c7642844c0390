"""Reserving a set of actors' resources at once, in a placement group."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fedray.core.errors import FedrayError
from fedray.runtime import parked
from fedray.runtime.cluster import check_bundles_fit

WAIT_S = 60.0
ROOM_WAIT_S = 2.0
"""How long a reservation that parked groups seemed to leave room for waits before they all give way: Ray's report
of the free resources lags a placement group created or removed a moment ago."""


def reserve(bundle: dict[str, float], count: int, strategy: str, what: str, hint: str, wait_s: float = WAIT_S) -> PlacementGroup:
    """A ready placement group of ``count`` copies of ``bundle``, or a clear error.

    All or nothing: a job either gets every bundle or fails with a message
    naming ``what`` it asked for, the cluster's totals and ``hint`` (what to
    lower), instead of running on a partial set or waiting forever: at once
    when the cluster can never hold them and no autoscaler may add nodes, else
    after ``wait_s`` seconds (other jobs may free resources, an autoscaler add
    nodes). Shards parked by an earlier run give way where they stand in its way (:mod:`fedray.runtime.parked`).
    """
    check_bundles_fit([bundle] * count, what, hint)
    parked.make_room({name: amount * count for name, amount in bundle.items()})
    group = placement_group([bundle] * count, strategy=strategy)
    if parked.any_parked() and not group.wait(timeout_seconds=min(ROOM_WAIT_S, wait_s)):
        parked.release()
    if not group.wait(timeout_seconds=wait_s):
        remove_placement_group(group)
        totals = ray.cluster_resources()
        raise FedrayError(
            f"could not reserve {what} in {wait_s:.0f} s (cluster: {totals.get('CPU', 0):.0f} CPU, "
            f"{totals.get('GPU', 0):.0f} GPU); {hint}"
        )
    return group


def default_count(cpus_per_actor: float) -> int:
    """How many actors of ``cpus_per_actor`` CPUs a run starts when not told: the cluster's total CPUs over that, at least one.

    The cluster's total, not the CPUs free at that moment: those vary with the machine's load (and other jobs), and the
    number of actors decides how clients are summed, so the same command must give the same count (and the same bits).
    """
    return max(1, int(ray.cluster_resources().get("CPU", 1) // cpus_per_actor))


def start_actors(
    actor_class: type, group: PlacementGroup, bundle: dict[str, float], arguments: list[tuple], first_bundle: int = 0,
    **options: object,
) -> list:
    """Actor ``i`` is ``actor_class(*arguments[i])`` in bundle ``first_bundle + i`` of ``group``, using ``bundle``'s resources.

    ``options`` are further actor options (e.g. ``max_restarts``).
    """
    return [
        actor_class.options(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=first_bundle + index),
            **options,
        ).remote(*args)
        for index, args in enumerate(arguments)
    ]


def trial_bundles(trial_group: PlacementGroup) -> tuple[int, dict[str, float]]:
    """A Tune trial's actor bundles: how many (bundle 0, the trial's driver, aside) and the resources of each.

    A trial's placement group (see :attr:`~fedray.app.sweeps.spec.SweepSpec.bundles`) has one bundle for its driver,
    then identical bundles for the actors of its run.
    """
    specs = trial_group.bundle_specs
    return len(specs) - 1, {key: float(value) for key, value in specs[1].items() if key in ("CPU", "GPU")}


def gpu_share(gpus: int, replicas: int) -> float:
    """The GPU a replica's bundle asks for: a whole one, or an equal share of the cluster's ``gpus`` when more
    ``replicas`` than GPUs were asked for (two trainers on a one-GPU workstation share it), rounded down to Ray's
    resource precision (1e-4) so that the shares fit."""
    return 1.0 if replicas <= gpus else int(gpus / replicas * 10_000) / 10_000
