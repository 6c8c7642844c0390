"""Updates trained before the server step that takes them (asynchronous rounds), each added to that step's sum as it
comes, scaled by its staleness weight: one sum a step ahead, wherever they are held.

A backend that can holds them beside the clients (:meth:`~fedray.runtime.probing.ProbeBackend.hold_batches`: in an
actor of their own, :mod:`~fedray.runtime.update_holder`, so that the driver fetches one sum a step, as in a
synchronous round); otherwise the driver does. Both
add the same terms in the same order: the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedray.methods.training.backend import RoundUpdate


@dataclass(frozen=True)
class Arrival:
    """Where a batch's summed update goes: the server ``step`` that takes it, scaled by its staleness ``weight``.

    A client that arrived twice from one version is trained in a batch of its own, so one step's updates from one
    version may come in several batches: they are added first, and scaled once their group is ``complete``."""

    step: int
    weight: float
    complete: bool = True
    plain: bool = False
    """The FedBuff paper's division: the weight scales the uploads, not their total weight."""


def scaled(update: RoundUpdate, weight: float, plain: bool) -> RoundUpdate:
    """``update``'s uploads times ``weight``, and its total weight too unless ``plain``. A weight of 1 is the update
    itself."""
    if weight == 1.0:
        return update
    return RoundUpdate({name: value * weight for name, value in update.sums.items()},
                       update.weight if plain else update.weight * weight, update.clients, update.loss_sum,
                       update.samples, update.statistics)


@dataclass
class HeldUpdates:
    """The sums waiting for their steps, and the group being added."""

    waiting: dict[int, RoundUpdate] = field(default_factory=dict)
    group: RoundUpdate | None = None

    def hold(self, update: RoundUpdate, arrival: Arrival) -> None:
        self.group = update if self.group is None else self.group + update
        if arrival.complete:
            update, self.group = scaled(self.group, arrival.weight, arrival.plain), None
            held = self.waiting.get(arrival.step)
            self.waiting[arrival.step] = update if held is None else held + update

    def take(self, step: int) -> RoundUpdate | None:
        """The sum of the updates ``step`` takes (None: none), no longer held."""
        return self.waiting.pop(step, None)
