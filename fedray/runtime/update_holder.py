"""Asynchronous rounds' updates waiting for their server steps, held by an actor of their own beside the shards.

Each batch's tree is finished where its sum waits (the last pair merged, the root taken, the sum scaled and added to
its step's: :class:`~fedray.methods.training.held_updates.HeldUpdates`), so that the driver fetches one sum a step,
whatever the staleness, and the shards train on while it adds: it asks for no CPU, its work being the few additions
a batch the driver would otherwise do. It runs its calls in the order they were made: the sums are added in the
order the driver submits the batches, the bits the driver would add.
"""

from __future__ import annotations

from typing import Any

import ray

from fedray.methods.training.backend import RoundUpdate
from fedray.methods.training.held_updates import Arrival, HeldUpdates
from fedray.runtime import tensor_transfer
from fedray.runtime.actor_group import Reduction
from fedray.runtime.fixed_tree import TreeSum, merge_with, root_of


@ray.remote(num_cpus=0)
class UpdateHolder:
    def __init__(self) -> None:
        tensor_transfer.register()
        self.held = HeldUpdates()

    def hold(self, trainer: Any, num_leaves: int, arrival: Arrival, *partials: TreeSum) -> None:
        """Hold a batch's sum over all ``num_leaves`` leaves until its step, from the one or two ``partials`` of its
        tree: :meth:`Reduction.result <fedray.runtime.actor_group.Reduction.result>` on them, as the driver would."""
        reduction = Reduction(partials, merge_with(trainer.combine), root_of(num_leaves, trainer.combine))
        self.held.hold(reduction.result(get=list), arrival)

    def take(self, step: int) -> RoundUpdate | None:
        return self.held.take(step)
