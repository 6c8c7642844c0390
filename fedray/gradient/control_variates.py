"""SCAFFOLD's control variates (Karimireddy et al., ICML 2020, option II), kept by the driver (fine-tuning, and SphereFed on features).

The server's c and every client's c_i have the shapes of the trained
parameters. A client's c_i is created (as zeros) by its first participation
and then kept for the rest of the run, so the driver holds 4 bytes × (trained
parameters) per client that ever participated: 9 MB per client for a fully
fine-tuned MobileNetV2, i.e. tens of GB over a federation of thousands of
clients. The server variate is kept as the sample-weighted mean of all clients'
c_i, c = Σ_i (n_i / N) c_i (N the federation's training samples), so a round
updates it by Σ_{i∈S} n_i Δc_i / N.
"""

from __future__ import annotations

import torch

from fedray.errors import FedrayError
from fedray.gradient.backend import Params


class ControlVariates:
    def __init__(self, shapes: dict[str, torch.Size], total_samples: int) -> None:
        self.total_samples = total_samples
        self.control: Params = {name: torch.zeros(shape) for name, shape in shapes.items()}
        self.clients: dict[int, Params] = {}

    def of(self, client: int) -> Params | None:
        """Client ``client``'s c_i, or ``None`` (zeros) before its first participation."""
        return self.clients.get(client)

    def update(self, new: dict[int, Params], sizes: dict[int, int]) -> None:
        """Store the round's new c_i and move c by Σ n_i (c_i⁺ − c_i) / N (clients in sorted order: reproducible)."""
        control = dict(self.control)
        for client in sorted(new):
            old = self.clients.get(client)
            weight = sizes[client] / self.total_samples
            for name, value in new[client].items():
                change = value if old is None else value - old[name]
                control[name] = control[name] + weight * change
            self.clients[client] = new[client]
        self.control = control

    def state_dict(self) -> dict:
        return {"control": dict(self.control), "clients": dict(self.clients)}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"control", "clients"} or set(state["control"]) != set(self.control):
            raise FedrayError("not a SCAFFOLD state of this model (expected the control variates of its trained parameters)")
        self.control = {name: tensor.clone() for name, tensor in state["control"].items()}
        self.clients = {int(client): {name: tensor.clone() for name, tensor in values.items()} for client, values in state["clients"].items()}
