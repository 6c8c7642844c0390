"""A server optimizer in one file: FedYogi (Reddi et al., "Adaptive Federated Optimization", ICLR 2021).

    fedray run --method fedavg --server-optimizer examples/fedyogi.py:FedYogi --server-lr 0.01 ...
    fedray run --method scaffold --server-optimizer examples/fedyogi.py:FedYogi --option yogi_tau=1e-4 ...

Δ is the sample-weighted mean client change (a pseudo-gradient pointing
downhill). Yogi's second moment moves additively, by at most (1 − β₂)Δ²:

    m ← β₁ m + (1 − β₁) Δ
    v ← v − (1 − β₂) Δ² sign(v − Δ²)
    θ ← θ + η m / (√v + τ)

with m starting at 0 and v at τ² (their v₋₁ ≥ τ²).
"""

from typing import Annotated

import torch

import fedray


class FedYogi(fedray.ServerOptimizer):
    default_lr = 0.01

    def __init__(self, server_lr: Annotated[float | None, "server learning rate η (default 0.01)"] = None,
                 yogi_beta1: Annotated[float, "β₁"] = 0.9, yogi_beta2: Annotated[float, "β₂"] = 0.99,
                 yogi_tau: Annotated[float, "τ, the adaptivity floor"] = 1e-3) -> None:
        super().__init__(server_lr)
        self.beta1, self.beta2, self.tau = yogi_beta1, yogi_beta2, yogi_tau

    def step(self, params: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, change in delta.items():
            square = change**2
            m = self.remember(name, "m", self.beta1 * self.slot(name, "m", change) + (1 - self.beta1) * change)
            previous = self.state.get(name, {}).get("v", torch.full_like(change, self.tau**2))
            v = self.remember(name, "v", previous - (1 - self.beta2) * square * torch.sign(previous - square))
            out[name] = params[name] + self.server_lr * m / (v.sqrt() + self.tau)
        return out
