"""FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization",
NeurIPS 2020) with vanilla local SGD, as a plugin.

    fedray run --method fednova ...

Clients take different numbers of local steps τ_k (τ_k = epochs × ⌈n_k / B⌉
here, so larger clients take more). FedAvg's average of their updates then
weighs the clients by τ_k as well as by their samples, and optimizes another
objective than the federation's. FedNova normalizes: each client's update is
divided by its steps, d_k = (θ_k − θ)/τ_k (for vanilla SGD the norm ‖a_k‖₁ of
the paper's a_k is τ_k), averaged with p_k = n_k / n over the round's
participants, and rescaled by τ_eff = Σ p_k τ_k:

    Δ = τ_eff Σ_k p_k d_k,    θ ← θ + ηΔ (the server optimizer's step; η = 1 is the paper's).

With equal τ_k it is FedAvg's Δ.
"""

from __future__ import annotations

from dataclasses import dataclass

import fedray

STEPS = "local_steps"
"""The upload's entry holding τ_k."""


@dataclass(frozen=True)
class FedNova(fedray.FederatedAlgorithm):
    """FedNova (Wang et al., NeurIPS 2020): each client's update divided by its local steps, rescaled by τ_eff."""

    def upload(self, client: fedray.ClientRound, trained: fedray.Params) -> tuple[fedray.Upload, None]:
        import torch  # where used: reading the options (fedray --help) needs no torch

        steps = float(client.local_steps)
        normalized = {name: (trained[name] - client.start[name]) / steps for name in trained}
        return fedray.Upload({**normalized, STEPS: torch.tensor(steps, dtype=torch.float64)}, client.num_samples), None

    def server_update(self, params: fedray.Params, total: fedray.Aggregate, state: fedray.Params,
                      population: fedray.Population) -> tuple[fedray.Params, fedray.Params]:
        effective_steps = float(total.sums[STEPS]) / total.weight
        return {name: effective_steps * (total.sums[name] / total.weight) for name in params}, state
