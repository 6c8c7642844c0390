"""What the federated training loop needs from whatever trains the clients.

The loop (:mod:`fedray.gradient.training`) owns sampling, the server
optimizer, evaluation points, checkpoints and divergence; a backend owns the
clients' data and their local training. Linear probing on features
(:class:`~fedray.gradient.probing.ProbeBackend`) and fine-tuning on images
(:mod:`fedray.finetune`) are the two backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from fedray.accounting import PaperCosts
from fedray.methods.base import Classifier

Params = dict[str, torch.Tensor]


@dataclass
class RoundUpdate:
    """The sums a round's clients send, already reduced over shards.

    ``delta`` holds Σ_k n_k (θ_k − θ) per parameter, ``weight`` Σ_k n_k, so the
    sample-weighted mean update is ``delta / weight``. ``loss_sum`` is the
    cross-entropy of the round's starting model summed over the ``samples``
    training samples of the round's clients (the loss FL papers plot).
    """

    delta: Params
    weight: float
    loss_sum: float
    samples: int


class TrainingBackend(Protocol):
    statistics_names: frozenset[str]
    """Entries of the update that are statistics (BatchNorm running means), averaged as they are, not stepped."""

    def train_round(self, params: Params, clients: np.ndarray, round_number: int) -> RoundUpdate:
        """Local training of ``clients`` (distinct global numbers) from ``params``; ``params`` is not modified."""
        ...

    def accuracy(self, params: Params) -> float:
        """Top-1 accuracy of ``params`` on the federation's test split."""
        ...

    def traffic_floats(self) -> tuple[int, int]:
        """Floats one participating client downloads and uploads in a round."""
        ...

    def client_flops(self, sizes: np.ndarray) -> np.ndarray:
        """Training FLOPs of one participation of clients with ``sizes`` samples."""
        ...

    def paper_costs(self, sizes: np.ndarray) -> PaperCosts:
        """One participation of clients with ``sizes`` samples as the papers count it (:mod:`fedray.accounting`); ``PaperCosts()`` where undefined."""
        ...

    def state_dict(self) -> dict:
        """Backend state a checkpoint must hold to resume bitwise (e.g. SCAFFOLD's control variates)."""
        ...

    def load_state_dict(self, state: dict) -> None:
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
