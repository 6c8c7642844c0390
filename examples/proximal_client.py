"""A client's own objective in one file: FedProx's proximal term (Li et al., MLSys 2020) written as a plugin.

    fedray run --method examples/proximal_client.py:Proximal --option mu=0.1 ...

A training algorithm is a ``fedray.FederatedAlgorithm`` subclass; one that
changes only what a client does overrides the client's hooks and keeps
FedAvg's server half. Every path that trains (heads on features, SphereFed's
projection, fine-tuning on images, TCT's stage 1) runs the client's local SGD
by autograd with the algorithm's ``loss(output, labels, params, client)`` for a
batch and ``correct_gradient(name, gradient, value, client)`` for each
parameter's gradient before the step (``client.start`` holds the model the
client received). Here each gradient gets μ(θ − θ₀), the gradient of
(μ/2)‖θ − θ₀‖², so the plugin trains exactly as ``--method fedprox --prox-mu μ``
does.

Its options are the dataclass's own fields with defaults (``--option mu=0.1``;
``--option Proximal.mu=0.1`` when another class of the run declares a ``mu``).
"""

from dataclasses import dataclass
from typing import Annotated

import torch

import fedray


@dataclass(frozen=True)
class Proximal(fedray.FederatedAlgorithm):
    """FedAvg's clients with FedProx's proximal term (μ/2)‖θ − θ₀‖² added to their loss."""

    mu: Annotated[float, "proximal weight μ"] = 0.01

    def correct_gradient(self, name: str, gradient: torch.Tensor, value: torch.Tensor,
                         client: fedray.ClientRound) -> None:
        gradient.add_(self.mu * (value - client.start[name]))
