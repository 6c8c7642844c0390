"""What the federated training loop needs from whatever trains the clients.

The loop (:mod:`fedray.engine.training`) owns sampling, the server
optimizer, evaluation points, checkpoints and divergence; a backend owns the
clients' data and their local training. Linear probing on features
(:class:`~fedray.runtime.probing.ProbeBackend`) and fine-tuning on images
(:mod:`fedray.runtime.finetune`) are the two backends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fedray.core.accounting import PaperCosts
from fedray.methods.algorithm import Aggregate, FederatedAlgorithm, Params
from fedray.methods.base import Classifier


@dataclass(frozen=True)
class ClientLosses:
    """Each of ``clients``' sum over its training samples of the squared loss at the round's starting model
    (``squares``, float64): what Oort's statistical utility |B_k| · sqrt(Σ loss² / |B_k|) is made of, measured only
    where a run asks for it (a clock's selector that reads the clients' utility)."""

    clients: np.ndarray
    squares: np.ndarray

    def __add__(self, other: ClientLosses) -> ClientLosses:
        return ClientLosses(np.concatenate((self.clients, other.clients)),
                            np.concatenate((self.squares, other.squares)))


@dataclass
class RoundUpdate:
    """A round's uploads summed over the clients (inside each shard or trainer, then over them), and their loss.

    ``sums[name]`` = Σ_k w_k · upload_k[name] with w_k the uploads' weights,
    ``weight`` = Σ_k w_k, over ``clients`` participants; ``loss_sum`` is the
    path's loss of the round's starting model summed over the ``samples``
    training samples of the round's clients (the loss FL papers plot).
    ``statistics`` are what a path averages besides the algorithm's uploads
    (a network's BatchNorm running statistics): Σ_k n_k (s_k − s), averaged
    with the clients' samples as plain FedAvg does, never stepped. ``client_losses``: each client's squared losses,
    where the backend was asked to measure them (None: not measured).
    """

    sums: Params
    weight: float
    clients: int
    loss_sum: float
    samples: int
    statistics: Params = field(default_factory=dict)
    client_losses: ClientLosses | None = None

    def __add__(self, other: RoundUpdate) -> RoundUpdate:
        losses = self.client_losses if other.client_losses is None else \
            other.client_losses if self.client_losses is None else self.client_losses + other.client_losses
        return RoundUpdate(_added(self.sums, other.sums), self.weight + other.weight, self.clients + other.clients,
                           self.loss_sum + other.loss_sum, self.samples + other.samples,
                           _added(self.statistics, other.statistics), losses)

    def aggregate(self) -> Aggregate:
        return Aggregate(self.sums, self.weight, self.clients)


def _added(a: Params, b: Params) -> Params:
    return {name: value + b[name] for name, value in a.items()}


class TrainingBackend(Protocol):
    algorithm: FederatedAlgorithm
    """The training algorithm its clients run."""
    trained_names: frozenset[str] | None
    """The parameters the clients train and the algorithm sees (None: all of them)."""
    pool: Any
    """The actors holding the clients (an :class:`~fedray.runtime.actor_group.ActorGroup`), which keep their states."""

    def train_round(self, params: Params, broadcast: Params, clients: np.ndarray, round_number: int,
                    steps: np.ndarray | None = None) -> RoundUpdate:
        """Local training of ``clients`` (distinct global numbers) from ``params`` with the algorithm's ``broadcast``;
        neither is modified. ``steps[i]`` (≥ 1) is the most local SGD steps ``clients[i]`` takes (a straggler's
        partial work, :mod:`~fedray.methods.training.budgets`); None: every client all of :meth:`local_steps`. A
        backend made to measure the clients' losses returns them in :attr:`RoundUpdate.client_losses`."""
        ...

    def local_steps(self, clients: np.ndarray) -> np.ndarray:
        """Each of ``clients``' local SGD steps in a full round (int64): what a budget of :meth:`train_round` cuts."""
        ...

    def client_state_layout(self) -> dict[str, tuple[int, ...]] | None:
        """The shapes of a client's state, -1 where a size is the client's number of samples; None: not known (a
        state read back is then only checked to be like the others)."""
        ...

    def model_floats(self) -> int:
        """Floats of the model a participating client receives (what it trains and sends back, buffers included)."""
        ...

    def accuracy(self, params: Params) -> float:
        """Top-1 accuracy of ``params`` on the federation's test split."""
        ...

    def client_flops(self, sizes: np.ndarray) -> np.ndarray:
        """Training FLOPs of one participation of clients with ``sizes`` samples."""
        ...

    def paper_costs(self, sizes: np.ndarray) -> PaperCosts:
        """One participation of clients with ``sizes`` samples as the papers count it (:mod:`fedray.core.accounting`); ``PaperCosts()`` where undefined."""
        ...


    def initial_params(self, seed: int) -> Params:
        """The parameters training starts from without a closed-form stage (random head from ``seed``)."""
        ...

    def head(self, params: Params) -> Classifier:
        """The classifier ``params`` evaluate on the features, copied: the softmax head (SphereFed: its fixed classifier)."""
        ...

    def with_head(self, params: Params, head: Params) -> Params:
        """``params`` with the softmax head set from a closed-form stage's ``{"weight": d × C, "bias": C}``."""
        ...

    def calibration_map(self, params: Params) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """SphereFed: the projection (P, q) its FFC calibrates on normalize(P x + q); (None, None): on normalize(x)."""
        ...

    def sphere_arrays(self, params: Params) -> dict[str, np.ndarray]:
        """SphereFed: what ``classifier.npz`` holds besides the calibrated classifier."""
        ...
