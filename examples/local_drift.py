"""A training algorithm with per-client state in one file: FedDC's local drift (Gao et al., CVPR 2022), written as a
researcher would write their own, against fedray's public interface only.

    fedray run --method examples/local_drift.py:LocalDrift --option drift_alpha=0.1 ...

Each client keeps h_i, the drift between its local model and the global one,
starting at zero. In a round it trains θ from the global θ⁰ on its loss plus
(α/2)‖θ + h_i − θ⁰‖², then moves its drift, h_i ← h_i + (θ_i − θ⁰), and
uploads its drift-corrected model, θ_i + h_i − θ⁰ (weighted by its samples,
averaged by the server as FedAvg's updates are). FedDC also corrects each local
gradient with a SCAFFOLD-like term; that part is left out here. h_i stays with
the client: in the shard that holds it, checkpointed with the run.
"""

from dataclasses import dataclass
from typing import Annotated

import torch

import fedray

DRIFT = "drift."


@dataclass(frozen=True)
class LocalDrift(fedray.FederatedAlgorithm):
    """FedDC's local drift variable h_i (Gao et al., CVPR 2022), without its gradient correction."""

    drift_alpha: Annotated[float, "weight α of the drift penalty"] = 0.01

    def init_client_state(self, start: fedray.Params) -> fedray.Params:
        return {DRIFT + name: torch.zeros_like(value) for name, value in start.items()}

    def loss(self, output: torch.Tensor, labels: torch.Tensor, params: fedray.Params,
             client: fedray.ClientRound) -> torch.Tensor:
        penalty = sum(((value + client.state[DRIFT + name] - client.start[name]) ** 2).sum() for name, value in params.items())
        return client.path_loss(output, labels) + self.drift_alpha / 2 * penalty

    def upload(self, client: fedray.ClientRound, trained: fedray.Params) -> tuple[fedray.Upload, fedray.Params]:
        drift = {key: value + trained[key[len(DRIFT):]] - client.start[key[len(DRIFT):]] for key, value in client.state.items()}
        corrected = {name: trained[name] + drift[DRIFT + name] - client.start[name] for name in trained}
        return fedray.Upload(corrected, client.num_samples), drift
