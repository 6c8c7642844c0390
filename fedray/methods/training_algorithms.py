"""The built-in training algorithms: FedAvg and its server-optimizer variants, FedProx, SCAFFOLD.

FedAvgM, FedAdam, FedAdagrad and FedYogi are FedAvg with another server optimizer: registry entries
(:data:`ALIASES`), not classes of their own.

FedDyn and FedNova are built in too, but written as plugins against the public
interface only (``fedray/algorithms/``): the package registers them by name
(:data:`ENTRY_POINTS`), and they are loaded on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fedray.core.lazy_modules import lazy_module
from fedray.methods.algorithm import Aggregate, ClientRound, FederatedAlgorithm, Params, Population, Upload
from fedray.core.options import Unset
from fedray.core.plugins import load_class, registered

torch = lazy_module("torch", globals())

CONTROL = "control."
"""Prefix of SCAFFOLD's control variates among the entries of its uploads, aggregates, broadcasts and states."""

DEFAULT_PROX_MU = 0.01
"""Li et al.'s usual μ (Fed3R's was not at hand)."""


@dataclass(frozen=True)
class FedAvg(FederatedAlgorithm):
    """FedAvg (McMahan et al., 2017): local SGD, updates averaged with the clients' samples; server θ + ηΔ."""

    name = "fedavg"


@dataclass(frozen=True)
class Alias:
    """A ``--method`` name for a training algorithm with another server optimizer than its own."""

    algorithm: type[FederatedAlgorithm]
    server_optimizer: str
    summary: str
    """What ``fedray methods`` says of it."""


@dataclass(frozen=True)
class FedProx(FederatedAlgorithm):
    """FedProx (Li et al., MLSys 2020): local SGD on the loss + (μ/2)‖θ − θ⁰‖², θ⁰ the model received."""

    name = "fedprox"
    prox_mu: Annotated[float, "proximal weight μ", Unset(f"{DEFAULT_PROX_MU} with fedprox")] = DEFAULT_PROX_MU

    def correct_gradient(self, name: str, gradient: torch.Tensor, value: torch.Tensor, client: ClientRound) -> None:
        """+ μ(θ − θ⁰), rounded before it is added, as autograd adds the gradient of the term written in the loss."""
        gradient.add_(self.prox_mu * (value - client.start[name]))


@dataclass(frozen=True)
class Scaffold(FederatedAlgorithm):
    """SCAFFOLD (Karimireddy et al., ICML 2020): every local gradient corrected by c − c_i.

    The server keeps c, the sample-weighted mean of all clients' c_i
    (c = Σ_i n_i c_i / N over the federation, c_i zero before a client's first
    participation), and sends it with the model; a client uploads its update
    and Δc_i = c_i⁺ − c_i, both weighted by its samples, and c moves by
    Σ n_i Δc_i / N. ``variant`` is the paper's choice of c_i⁺, the same on every
    path: I, the gradient of the client's loss over all its samples at the model
    it received (one more backward pass by autograd; free in the dual form of
    linear heads, which stores it compactly, :mod:`fedray.methods.training.local`),
    or II, c_i − c + (θ⁰ − θ_i) / (τ_i η) from the model's change (by autograd
    on every path: its c_i is a dense copy of the model per client).
    """

    name = "scaffold"
    variant: Annotated[str, "c_i⁺: I (the gradient of the client's loss at the model it received) or II (from the "
                            "model's change, c_i − c + (θ⁰ − θ_i)/(τη))"] = "I"

    def __post_init__(self) -> None:
        if self.variant not in ("I", "II"):
            raise ValueError(f"option variant must be I or II (Karimireddy et al.'s options), got {self.variant!r}")

    @property
    def needs_start_gradient(self) -> bool:
        return self.variant == "I"

    def init_server_state(self, params: Params) -> Params:
        return {CONTROL + name: torch.zeros_like(value) for name, value in params.items()}

    def broadcast(self, params: Params, state: Params) -> Params:
        return state

    def init_client_state(self, start: Params) -> Params:
        return {CONTROL + name: torch.zeros_like(value) for name, value in start.items()}

    def correct_gradient(self, name: str, gradient: torch.Tensor, value: torch.Tensor, client: ClientRound) -> None:
        gradient.add_(client.broadcast[CONTROL + name] - client.state[CONTROL + name])

    def upload(self, client: ClientRound, trained: Params) -> tuple[Upload, Params]:
        update, _ = super().upload(client, trained)
        if self.variant == "I":
            new = {key: client.start_gradient[key[len(CONTROL):]] for key in client.state}
        else:
            scale = 1.0 / (client.local_steps * client.lr)
            new = {key: own - client.broadcast[key] + scale * (client.start[key[len(CONTROL):]] - trained[key[len(CONTROL):]])
                   for key, own in client.state.items()}
        changes = {key: new[key] - own for key, own in client.state.items()}
        return Upload({**update.tensors, **changes}, update.weight), new

    def server_update(self, params: Params, total: Aggregate, state: Params,
                      population: Population) -> tuple[Params, Params]:
        delta, _ = super().server_update(params, total, state, population)
        return delta, {key: control + total.sums[key] / float(population.samples) for key, control in state.items()}


ENTRY_POINTS = "fedray.training_algorithms"
"""The entry-point group of the training algorithms installed packages register by ``--method`` name: fedray's own
plugins (FedDyn, FedNova) in its pyproject.toml, and a researcher's package's the same way."""

ALIASES = {
    "fedavgm": Alias(FedAvg, "fedavgm", "FedAvg with server momentum (Hsu et al., 2019): m ← βm + Δ, θ ← θ + ηm."),
    "fedadam": Alias(FedAvg, "fedadam", "FedAvg's clients with Adam on the server (Reddi et al., ICLR 2021)."),
    "fedadagrad": Alias(FedAvg, "fedadagrad", "FedAvg's clients with Adagrad on the server (Reddi et al., ICLR 2021)."),
    "fedyogi": Alias(FedAvg, "fedyogi", "FedAvg's clients with Yogi on the server (Reddi et al., ICLR 2021)."),
}
"""FedAvg's variants by ``--method`` name: FedAvg with their server optimizer (its options are theirs)."""

BUILT_IN: dict[str, type[FederatedAlgorithm] | Alias | str] = {
    FedAvg.name: FedAvg, **ALIASES, FedProx.name: FedProx, Scaffold.name: Scaffold, **registered(ENTRY_POINTS),
}
"""Every built-in training algorithm by ``--method`` name: a class, an :class:`Alias`, or for those registered as
plugins (FedDyn, FedNova) their ``module:Class``."""


def algorithm_class(spec: str) -> type[FederatedAlgorithm]:
    """The training algorithm ``spec`` names (an alias's algorithm): a built-in, ``module:Class`` or
    ``path/to/file.py:Class``."""
    builtin = BUILT_IN.get(spec)
    if isinstance(builtin, Alias):
        return builtin.algorithm
    if isinstance(builtin, str):
        return load_class(builtin, FederatedAlgorithm, {}, "training algorithm")
    return load_class(spec, FederatedAlgorithm, {name: cls for name, cls in BUILT_IN.items() if isinstance(cls, type)},
                      "training algorithm")


def own_server_optimizer(spec: str) -> str:
    """The server optimizer of the training algorithm ``spec`` names: an alias's, else its class's own."""
    builtin = BUILT_IN.get(spec)
    return builtin.server_optimizer if isinstance(builtin, Alias) else algorithm_class(spec).server_optimizer


def paper_family(algorithm: FederatedAlgorithm) -> str | None:
    """How the papers count an algorithm's training costs: ``fedavg`` (FedAvg, with any server optimizer, and FedProx:
    the head each way), ``scaffold`` (twice that), None for the algorithms they do not count."""
    if type(algorithm) is Scaffold:
        return "scaffold"
    return "fedavg" if type(algorithm) in (FedAvg, FedProx) else None
