"""The gradient-based methods, by name: which server optimizer and which client extras each uses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    server: str
    default_server_lr: float
    proximal: bool = False
    scaffold: bool = False


ALGORITHMS = {
    "fedavg": Algorithm("fedavg", 1.0),
    "fedavgm": Algorithm("fedavgm", 1.0),
    "fedadam": Algorithm("fedadam", 0.01),
    "fedprox": Algorithm("fedavg", 1.0, proximal=True),
    "scaffold": Algorithm("fedavg", 1.0, scaffold=True),
}
"""FedAdam's server lr 0.01 and FedProx's μ 0.01 are Reddi et al.'s / Li et al.'s usual values, not Fed3R's (not at hand)."""

DEFAULT_PROX_MU = 0.01
INITS = ("random", "fedncm", "fed3r", "fedcof")
FINETUNE_MODES = ("ft", "ftlp", "ftfeat")
"""Fine-tuning on images: backbone and head, head only (linear probing on images), backbone only."""
