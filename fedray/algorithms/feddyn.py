"""FedDyn (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021), Algorithm 1, as a plugin.

    fedray run --method feddyn --option alpha=0.1 ...

Client k, sampled in round t, starts from θ^{t−1} with its own ∇L_k(θ_k^{t−1})
(zero before its first participation) and minimizes by local SGD

    L_k(θ) − ⟨∇L_k(θ_k^{t−1}), θ⟩ + (α/2)‖θ − θ^{t−1}‖²,

then keeps ∇L_k(θ_k^t) = ∇L_k(θ_k^{t−1}) − α(θ_k^t − θ^{t−1}) and uploads
θ_k^t − θ^{t−1}. The server averages the participants' models uniformly and
keeps h: h ← h − α (1/m) Σ_k (θ_k^t − θ^{t−1}) over the m clients of the
federation, θ^t = (1/|P_t|) Σ_k θ_k^t − h/α. The server optimizer takes
Δ = mean(θ_k^t − θ^{t−1}) − h/α, so FedAvg's θ + ηΔ at η = 1 is the paper's step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import fedray

if TYPE_CHECKING:
    import torch

GRADIENT = "dyn."
"""Prefix of a client's ∇L_k(θ_k) and of the server's h, per parameter."""


@dataclass(frozen=True)
class FedDyn(fedray.FederatedAlgorithm):
    """FedDyn (Acar et al., ICLR 2021): dynamic regularization, each client keeping ∇L_k of its last model."""

    alpha: Annotated[float, "regularization α (> 0)"] = 0.01

    def __post_init__(self) -> None:
        if not self.alpha > 0:
            raise ValueError(f"option alpha must be > 0, got {self.alpha}")

    def init_server_state(self, params: fedray.Params) -> fedray.Params:
        import torch  # where used: reading the options (fedray --help) needs no torch

        return {GRADIENT + name: torch.zeros_like(value) for name, value in params.items()}

    def init_client_state(self, start: fedray.Params) -> fedray.Params:
        import torch  # where used: reading the options (fedray --help) needs no torch

        return {GRADIENT + name: torch.zeros_like(value) for name, value in start.items()}

    def loss(self, output: torch.Tensor, labels: torch.Tensor, params: fedray.Params,
             client: fedray.ClientRound) -> torch.Tensor:
        loss = client.path_loss(output, labels)
        for name, value in params.items():
            loss = loss - (client.state[GRADIENT + name] * value).sum() \
                + self.alpha / 2 * ((value - client.start[name]) ** 2).sum()
        return loss

    def upload(self, client: fedray.ClientRound, trained: fedray.Params) -> tuple[fedray.Upload, fedray.Params]:
        change = {name: trained[name] - client.start[name] for name in trained}
        state = {key: gradient - self.alpha * change[key[len(GRADIENT):]] for key, gradient in client.state.items()}
        return fedray.Upload(change, 1.0), state

    def server_update(self, params: fedray.Params, total: fedray.Aggregate, state: fedray.Params,
                      population: fedray.Population) -> tuple[fedray.Params, fedray.Params]:
        h = {key: value - self.alpha * total.sums[key[len(GRADIENT):]] / population.clients for key, value in state.items()}
        delta = {name: total.sums[name] / total.weight - h[GRADIENT + name] / self.alpha for name in params}
        return delta, h
