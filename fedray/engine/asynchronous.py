"""Training under ``--scheduler fedbuff|fedasync``: the clock's asynchronous plan turned into the training loop's
server steps, each version's clients trained together from that version's model.

The plan (:func:`fedray.clock.asynchronous.plan_async`) says, before any
work, which clients train from each model version and which server step takes
each update. So at version v — after step v, before step v + 1 — the clients
dispatched at v are trained from the model of version v, one batch for each
step that takes their updates, and each batch's summed uploads, scaled by the
staleness weight w(s) of that step (s = its number − 1 − v), waits until its step
(:mod:`~fedray.methods.training.held_updates`: in an actor beside the shards, so that the driver holds one sum at a
time, whatever the staleness). Step v + 1 then takes what waits for it
(only clients dispatched at versions ≤ v) and goes through the same server
update as a synchronous round:

* **fedbuff**: θ ← θ + η_g · Σ u_k·w(s_k)·Δ_k / Σ u_k·w(s_k) (``weighted``, FedScale's) or / Σ u_k (``plain``, the
  FedBuff paper's), the server optimizer stepping on that update as on a round's;
* **fedasync**: one update a step, θ ← (1 − α·w(s))·θ + α·w(s)·θ_k with θ_k = θ_v + Δ_k its model: the step's
  update is α·w(s)·(θ_v + Δ_k − θ), which keeps θ_v while an update trained from it is still to come.

Only the updates a step takes are trained: a client lost or still training at the end costs time, not work.
An asynchronous run writes no checkpoint (the updates waiting for a later step are not in one): it runs whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fedray.clock.asynchronous import AsynchronousRounds
from fedray.core.errors import FedrayError
from fedray.methods.training.backend import Params, RoundUpdate, TrainingBackend
from fedray.methods.training.held_updates import Arrival, HeldUpdates


@dataclass
class AsyncUpdates:
    """What the training loop asks at each server step: the updates it takes, trained at their versions."""

    trained_from: list[dict[int, np.ndarray]]
    """For each version, the clients trained from it, by the step that takes their updates."""
    weight: Callable[[np.ndarray], np.ndarray]
    plain: bool
    mixing_rate: float | None
    """fedasync's α (None: fedbuff)."""
    held: HeldUpdates = field(default_factory=HeldUpdates)
    """The updates waiting for their steps, where the backend cannot hold them."""
    versions: dict[int, Params] = field(default_factory=dict)
    """fedasync: the models that updates still to come were trained from."""
    version_of: dict[int, int] = field(init=False)
    """The version each step's updates were trained from (fedasync: one update a step)."""

    def __post_init__(self) -> None:
        self.version_of = {target: version for version, group in enumerate(self.trained_from) for target in group}

    def step(self, number: int, backend: TrainingBackend, params: Params, broadcast: Params,
             model: Params) -> RoundUpdate | None:
        """Train the clients dispatched at version ``number`` − 1 from ``params``, and the updates step ``number``
        takes (None: none)."""
        version = number - 1
        batches = self._batches(version)
        hold_batches = getattr(backend, "hold_batches", None)
        if hold_batches is not None:
            hold_batches(params, broadcast, batches, number, first=version == 0)
            update = backend.take_held(number)
        else:
            for clients, arrival in batches:
                self.held.hold(backend.train_round(params, broadcast, clients, number), arrival)
            update = self.held.take(number)
        if self.mixing_rate is not None and any(target > number for target in self.trained_from[version]):
            self.versions[version] = {name: value.clone() for name, value in model.items()}
        return update

    def _batches(self, version: int) -> list[tuple[np.ndarray, Arrival]]:
        """The batches of distinct clients trained from ``version``, each with the step that takes it. A client that
        arrived twice from one version (re-dispatched at once, faster than a step) is trained once per arrival, in a
        batch of its own (a round's clients are distinct), on the same mini-batches: its updates are equal."""
        batches = []
        for target, clients in self.trained_from[version].items():
            weight = 1.0 if self.mixing_rate is not None else float(self.weight(np.array([target - version - 1]))[0])
            occurrence = np.zeros(len(clients), dtype=np.int64)
            if len(np.unique(clients)) != len(clients):
                occurrence = np.array([int((clients[:position] == client).sum())
                                       for position, client in enumerate(clients.tolist())])
            last = int(occurrence.max())
            batches += [(clients[occurrence == k], Arrival(target, weight, k == last, self.plain))
                        for k in range(last + 1)]
        return batches

    def mixed(self, number: int, delta: Params, model: Params) -> Params:
        """fedasync's update of step ``number`` (one update, trained from version v) from the algorithm's ``delta``
        (Δ_k): α·w(s)·(θ_v + Δ_k − θ), s = ``number`` − 1 − v."""
        version = self.version_of[number]
        rate = self.mixing_rate * float(self.weight(np.array([number - 1 - version]))[0])
        base = self.versions.get(version, model)
        if number >= max(self.trained_from[version]):  # no later step takes an update trained from it
            self.versions.pop(version, None)
        return {name: rate * (change + base[name] - model[name]) for name, change in delta.items()}


def check_asynchronous(scheduler: AsynchronousRounds, stateful: bool, algorithm: str, postprocessors: bool,
                       synchronous_options: list[str], selector: str) -> None:
    """Refuse in one line, before any work, what asynchronous rounds do not define yet."""
    name = scheduler.flag
    if stateful:
        raise FedrayError(f"{name}: {algorithm} keeps state for each client (control variates, a dual), which no "
                          f"asynchronous rule of its paper updates under staleness; use a stateless algorithm "
                          f"(fedavg, fedprox, fedavgm, fedadam, fedadagrad, fedyogi, fednova)")
    if postprocessors:
        raise FedrayError(f"{name} does not take postprocessors (privacy, secure aggregation): their accounting "
                          f"counts synchronous rounds")
    if synchronous_options:
        raise FedrayError(f"{name}: {', '.join(synchronous_options)} belong to synchronous rounds")
    if selector != "uniform":
        raise FedrayError(f"{name} picks its clients uniformly among the idle online ones; --selector {selector} is "
                          f"for synchronous rounds")
