"""Server optimizers of the FedAvg family: they turn the clients' averaged update Δ into the next global model.

Δ is the sample-weighted mean of the clients' (θ_k − θ), a pseudo-gradient
pointing downhill. FedAvg: θ ← θ + η Δ (η = 1 is plain model averaging).
FedAvgM: m ← β m + Δ, θ ← θ + η m. FedAdam (Reddi et al., ICLR 2021):
m ← β₁ m + (1 − β₁) Δ, v ← β₂ v + (1 − β₂) Δ², θ ← θ + η m / (√v + τ).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedray.errors import FedrayError

ALGORITHMS = ("fedavg", "fedavgm", "fedadam")


@dataclass
class ServerOptimizer:
    algorithm: str = "fedavg"
    lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise FedrayError(f"unknown server optimizer {self.algorithm!r}; known: {', '.join(ALGORITHMS)}")
        if self.lr <= 0:
            raise FedrayError(f"server learning rate must be > 0, got {self.lr}")

    def step(self, params: dict[str, torch.Tensor], update: dict[str, torch.Tensor]) -> None:
        """Apply the averaged client update ``update`` to ``params`` in place."""
        for name, delta in update.items():
            slot = self.state.setdefault(name, {})
            if self.algorithm == "fedavg":
                params[name] += self.lr * delta
            elif self.algorithm == "fedavgm":
                slot["m"] = self.momentum * slot.get("m", torch.zeros_like(delta)) + delta
                params[name] += self.lr * slot["m"]
            else:
                slot["m"] = self.beta1 * slot.get("m", torch.zeros_like(delta)) + (1 - self.beta1) * delta
                slot["v"] = self.beta2 * slot.get("v", torch.zeros_like(delta)) + (1 - self.beta2) * delta**2
                params[name] += self.lr * slot["m"] / (slot["v"].sqrt() + self.tau)
