"""Shard actors: each holds the features of many clients and sums their statistics.

A shard is a contiguous range of client numbers, balanced by sample count. Its
features are produced once, inside the actor, by the federation's feature
source. Per block of rounds the driver sends the numbers of the clients that
upload in that block; the shard gathers their rows and computes the block's
statistics in one call (for Fed3R: one GEMM), so Ray's overhead scales with
shards × evaluation points, not with clients or rounds.
"""

from __future__ import annotations

import operator
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup, remove_placement_group

from fedray.data.federation import TRAIN, Federation
from fedray.errors import FedrayError
from fedray.methods.base import ClientBatch, ClosedFormMethod
from fedray.runtime.cluster import check_memory
from fedray.runtime.footprint import Footprint
from fedray.runtime.placement import reserve, start_actors


def peak_memory_bytes() -> int:
    """Peak resident memory of the calling process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def balanced_bounds(client_offsets: np.ndarray, num_shards: int) -> np.ndarray:
    """Client numbers where shards start (plus K at the end), cutting at equal sample counts."""
    num_clients = len(client_offsets) - 1
    num_shards = max(1, min(num_shards, num_clients))
    targets = client_offsets[-1] * np.arange(1, num_shards) / num_shards
    inner = np.searchsorted(client_offsets, targets, side="left")
    bounds = np.unique(np.clip(np.concatenate([[0], inner, [num_clients]]), 0, num_clients))
    return bounds


def gather_rows(offsets: np.ndarray, local_clients: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of the given clients' samples, concatenated, and their new offsets."""
    starts, stops = offsets[local_clients], offsets[local_clients + 1]
    lengths = stops - starts
    new_offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows = np.arange(new_offsets[-1]) + np.repeat(starts - new_offsets[:-1], lengths)
    return rows, new_offsets


@ray.remote(max_restarts=3, max_task_retries=3)
class ShardActor:
    """Holds clients ``first_client .. end_client-1`` of a federation.

    Its state is a pure function of its constructor arguments and its calls are
    pure functions of their arguments, so Ray can restart a failed shard and
    retry its calls with bitwise the same results.
    """

    def __init__(self, federation: Federation, first_client: int, end_client: int, threads: int) -> None:
        torch.set_num_threads(threads)
        sample_ids, labels, self.offsets = federation.train_arrays(first_client, end_client)
        self.first_client = first_client
        self.features = federation.source.features(TRAIN, sample_ids)
        self.labels = torch.from_numpy(labels.astype(np.int64))

    def num_samples(self) -> int:
        return len(self.labels)

    def peak_memory_bytes(self) -> int:
        """Peak resident memory of this actor's process."""
        return peak_memory_bytes()

    def _batch(self, clients: np.ndarray) -> ClientBatch:
        """The samples of ``clients`` (global numbers), client after client in the given order."""
        rows, offsets = gather_rows(self.offsets, clients - self.first_client)
        index = torch.from_numpy(rows)
        return ClientBatch(self.features[index], self.labels[index], offsets, clients)

    def statistics(self, method: ClosedFormMethod, clients: np.ndarray) -> Any:
        """Statistics summed over ``clients`` (global numbers, in upload order); None if there are none."""
        return method.client_statistics(self._batch(clients)) if len(clients) else None

    def local_train(self, trainer: Any, head: Any, clients: np.ndarray, round_number: int, client_state: Any = None) -> Any:
        """Local training of ``clients`` from ``head``, summed as ``trainer.train`` defines; None if there are none.

        ``client_state`` is what the driver keeps for these clients between
        rounds (SCAFFOLD's control variates), so the shard itself stays stateless.
        """
        if not len(clients):
            return None
        return trainer.train(self._batch(clients), head, round_number, client_state)

    def combine(self, method: ClosedFormMethod, a: Any, b: Any) -> Any:
        return combine_partials(a, b, method.combine)


@dataclass
class ShardPool:
    """The shard actors of one federation, reusable across runs of different methods.

    The shards' CPUs are reserved at once in a placement group (one bundle per
    shard, spread over the nodes), so a run either gets all its shards or fails
    with a clear message instead of waiting forever for a partial set. The
    pool holds the reference to the federation (a split table and a feature
    source, not features) that the shards were built from: Ray frees an
    actor's constructor arguments once nothing refers to them, and a restarted
    shard needs them again.
    """

    federation: Federation
    actors: list
    bounds: np.ndarray
    group: PlacementGroup
    federation_ref: ray.ObjectRef
    owns_group: bool = True

    @classmethod
    def start(
        cls,
        federation: Federation,
        num_shards: int | None = None,
        cpus_per_shard: float = 1,
        trial_group: PlacementGroup | None = None,
        footprints: Sequence[Footprint] = (),
    ) -> "ShardPool":
        """Start the shards in a placement group of their own, or in bundles 1.. of ``trial_group``.

        ``trial_group`` is the placement group a Tune trial runs in (bundle 0
        is the trial's driver), reserved by the sweep with one bundle per
        shard, so trials never compete with each other for shard CPUs.
        ``footprints`` (the run's estimated memory, stage by stage) must fit
        the cluster before any shard starts.
        """
        federation.require_features()
        if trial_group is not None:
            num_shards = len(trial_group.bundle_specs) - 1
        elif num_shards is None:
            num_shards = max(1, int(ray.available_resources().get("CPU", 1) // cpus_per_shard))
        if num_shards < 1:
            raise FedrayError(f"--num-shards must be ≥ 1, got {num_shards}")
        bounds = balanced_bounds(federation.client_offsets, num_shards)
        shards = len(bounds) - 1
        bundle = {"CPU": cpus_per_shard}
        if trial_group is None:
            cut = f" (--num-shards {num_shards} cut at equal sample counts over {federation.num_clients} clients)" if shards < num_shards else ""
            group = reserve(bundle, shards, "SPREAD", f"{shards} shard{'s' if shards > 1 else ''}{cut} × {cpus_per_shard:g} CPU",
                            "lower --num-shards or --cpus-per-shard")
            first_bundle = 0
        else:
            group, first_bundle = trial_group, 1
        try:
            for footprint in footprints:
                check_memory(footprint, np.diff(federation.client_offsets[bounds]))
        except FedrayError:
            if trial_group is None:
                remove_placement_group(group)
            raise
        federation_ref = ray.put(federation)
        threads = max(1, int(cpus_per_shard))
        arguments = [(federation_ref, int(a), int(b), threads) for a, b in zip(bounds[:-1], bounds[1:])]
        actors = start_actors(ShardActor, group, bundle, arguments, first_bundle)
        ray.get([actor.num_samples.remote() for actor in actors])
        return cls(federation, actors, bounds, group, federation_ref, owns_group=trial_group is None)

    @property
    def num_shards(self) -> int:
        return len(self.actors)

    def statistics(self, method: ray.ObjectRef, clients: np.ndarray) -> ray.ObjectRef:
        """Submit the statistics of ``clients`` to their shards and tree-reduce the partial sums.

        ``method`` is the method put in the object store once per run.
        """
        shard_of = np.searchsorted(self.bounds, clients, side="right") - 1
        partials = [
            (actor.statistics.remote(method, clients[shard_of == s]), actor) for s, actor in enumerate(self.actors)
        ]
        return tree_reduce(method, partials)

    def split_clients(self, clients: np.ndarray) -> list[np.ndarray]:
        """``clients`` (global numbers) by shard, each in the given order."""
        shard_of = np.searchsorted(self.bounds, clients, side="right") - 1
        return [clients[shard_of == s] for s in range(self.num_shards)]

    def local_train(
        self, trainer: ray.ObjectRef, head: ray.ObjectRef, clients: np.ndarray, round_number: int,
        client_states: list | None = None,
    ) -> ray.ObjectRef:
        """Submit one round of local training of ``clients`` to their shards and tree-reduce the shards' sums.

        ``client_states[s]`` goes with shard ``s``'s clients (see :meth:`split_clients`).
        """
        states = client_states or [None] * self.num_shards
        partials = [
            (actor.local_train.remote(trainer, head, local, round_number, state), actor)
            for actor, local, state in zip(self.actors, self.split_clients(clients), states)
        ]
        return tree_reduce(trainer, partials)

    def peak_memory_bytes(self) -> list[int]:
        return ray.get([actor.peak_memory_bytes.remote() for actor in self.actors])

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        if self.owns_group:
            remove_placement_group(self.group)


def combine_partials(a: Any, b: Any, add: Callable[[Any, Any], Any] = operator.add) -> Any:
    """``add(a, b)``, where None stands for an actor with nothing to add this time (no sampled clients)."""
    if a is None or b is None:
        return b if a is None else a
    return add(a, b)


def tree_reduce(method: ray.ObjectRef, partials: list[tuple[ray.ObjectRef, Any]]) -> ray.ObjectRef:
    """Pairwise sums through object refs, in a fixed order, O(log shards) deep.

    Each pair is combined by the actor that produced its left operand, so the
    reduction needs no resources beyond the shards' own.
    """
    level = partials
    while len(level) > 1:
        paired = [
            (left[1].combine.remote(method, left[0], right[0]), left[1]) for left, right in zip(level[::2], level[1::2])
        ]
        level = paired + ([level[-1]] if len(level) % 2 else [])
    return level[0][0]
