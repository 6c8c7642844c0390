"""A client algorithm in one file: FedProx's proximal term (Li et al., MLSys 2020) written as a plugin.

    fedray run --method fedavg --client-algorithm examples/proximal_client.py:Proximal --option mu=0.1 ...

Every path that trains (heads on features, SphereFed's projection, fine-tuning
on images, TCT's stage 1) runs the client's local SGD by autograd with the
run's client algorithm as hooks: ``loss(output, labels)`` for a batch,
``correct(gradient, value, start, correction)`` for each parameter's gradient
before the step (``start`` is the round's global value, ``correction`` SCAFFOLD's
c − c_i when the method is scaffold) and ``new_control`` for SCAFFOLD's c_i⁺.
Here each gradient gets μ(θ − θ₀), the gradient of (μ/2)‖θ − θ₀‖², so the
plugin trains exactly as ``--method fedprox --prox-mu μ`` does.

The options are the dataclass's own fields with defaults; ``loss`` and
``prox_mu`` are the run's.
"""

from dataclasses import dataclass
from typing import Annotated

import torch

import fedray


@dataclass(frozen=True)
class Proximal(fedray.ClientAlgorithm):
    mu: Annotated[float, "proximal weight μ"] = 0.01

    def correct(self, gradient: torch.Tensor, value: torch.Tensor, start: torch.Tensor,
                correction: torch.Tensor | None) -> None:
        gradient.add_(self.mu * (value - start))
        super().correct(gradient, value, start, correction)
