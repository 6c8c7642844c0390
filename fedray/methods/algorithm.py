"""A federated training algorithm in one class: what a client does, what the server does, and each client's own state.

``fedray.FederatedAlgorithm`` is fedray's counterpart of pfl-research's
``FederatedAlgorithm`` and of Flower's ``Strategy``. One frozen dataclass
holds both halves of an algorithm; its options are its fields with defaults::

    @dataclass(frozen=True)
    class FedDyn(fedray.FederatedAlgorithm):
        alpha: Annotated[float, "α"] = 0.01

        def init_client_state(self, start):                 # ∇L_k(θ_k), zero before the first participation
            return {name: torch.zeros_like(value) for name, value in start.items()}
        def loss(self, output, labels, client):             # L_k(θ) − ⟨∇L_k(θ_k), θ⟩ + (α/2)‖θ − θ⁰‖², by autograd
            ...
        def upload(self, client, trained):                  # θ_k − θ⁰, weight 1; the new ∇L_k(θ_k) stays with the client
            ...
        def server_update(self, params, total, state, population):
            ...

A round, wherever it runs (linear heads on features, SphereFed's projection,
fine-tuning on images):

1. the server sends the model and :meth:`broadcast` (e.g. SCAFFOLD's c);
2. each sampled client starts from the model with its own state (created by
   :meth:`init_client_state` the first time, ``None`` for a stateless
   algorithm) and runs local SGD (the run's learning rate, batch size, epochs,
   weight decay and momentum) on :meth:`loss`, each gradient passed through
   :meth:`correct_gradient` before the step;
3. :meth:`upload` turns the trained model into what the client sends, an
   :class:`Upload` (named tensors and the weight the server averages them with),
   and the client's next state;
4. the uploads are summed where the clients are (inside the shards, then a
   tree of sums): the server sees only their weighted sum, an :class:`Aggregate`;
5. :meth:`server_update` turns the aggregate into Δ, the step the run's server
   optimizer takes (``--server-optimizer``: FedAvg's θ + ηΔ, FedAvgM, FedAdam, FedAdagrad, FedYogi,
   a plugin), and the server's next state.

A client's state lives with the client (in the shard or trainer that holds it),
is created at its first participation and is checkpointed with the run; the
server's state (:meth:`init_server_state`) lives with the server. Both are
named tensors with the shapes the algorithm gives them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from fedray.core.lazy_modules import lazy_module
from fedray.methods.upload_parts import UploadParts

torch = lazy_module("torch", globals())

Params = dict[str, "torch.Tensor"]
Loss = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
"""A batch's mean loss from the model's output and the labels."""


@dataclass(frozen=True)
class ClientRound:
    """What a client knows in a round.

    ``start`` holds the model it received (the parameters it trains), ``broadcast``
    what the server sent besides, ``state`` its own state from its last
    participation (None before its first, or for a stateless algorithm).
    ``local_steps`` is τ_k, the number of SGD steps it takes this round, ``lr`` the
    round's learning rate, ``path_loss`` the loss of the path that trains (e.g.
    cross-entropy at the run's temperature on a linear head). ``start_gradient``
    is the gradient of the path's loss over all the client's samples at the
    model it received, one tensor per trained parameter, when the algorithm
    asks for it (:attr:`FederatedAlgorithm.needs_start_gradient`), else None.
    """

    client: int
    round: int
    num_samples: int
    local_steps: int
    lr: float
    start: Params
    broadcast: Params
    state: Params | None
    path_loss: Loss = field(repr=False)
    start_gradient: Params | None = field(default=None, repr=False)


@dataclass
class Upload:
    """What one client sends: named tensors, averaged by the server with ``weight`` (FedAvg: the client's samples).

    ``parts``: what a closed-form method's statistics are made of (:class:`~fedray.UploadParts`: which tensors are
    sums over samples, counts, per-client rows), as the method declares them; None for a training update."""

    tensors: Params
    weight: float
    parts: UploadParts | None = None


@dataclass
class Aggregate:
    """The round's uploads summed: ``sums[name]`` = Σ_k w_k · tensors_k[name], ``weight`` = Σ_k w_k over ``clients``
    participants (the weights are the clients' :attr:`Upload.weight`)."""

    sums: Params
    weight: float
    clients: int


@dataclass(frozen=True)
class Population:
    """The federation a run trains on: its number of clients and of training samples."""

    clients: int
    samples: int


@dataclass(frozen=True)
class FederatedAlgorithm:
    """FedAvg (McMahan et al., 2017): local SGD on the path's loss, updates averaged with the clients' samples.

    Subclass it for another algorithm (a frozen dataclass whose fields with defaults are its options) and override
    what differs; see the module docstring for the order of the calls.
    """

    name: ClassVar[str] = ""
    """A built-in's ``--method`` name; a plugin is named by its ``module:Class`` or ``file.py:Class``."""
    server_optimizer: ClassVar[str] = "fedavg"
    """The server optimizer it runs with when the run names none (``--server-optimizer``)."""

    # --- the server's half

    def init_server_state(self, params: Params) -> Params:
        """The server's state before the first round (SCAFFOLD's c, FedDyn's h), from the initial model."""
        return {}

    def broadcast(self, params: Params, state: Params) -> Params:
        """What the server sends each round besides the model (SCAFFOLD's c)."""
        return {}

    def server_update(self, params: Params, total: Aggregate, state: Params,
                      population: Population) -> tuple[Params, Params]:
        """(Δ, the server's next state) from the round's summed uploads; Δ is the step the server optimizer takes.

        Default: Δ is the weighted mean of the clients' updates (every uploaded entry named as a parameter of
        ``params``).
        """
        return {name: total.sums[name] / total.weight for name in params if name in total.sums}, state

    # --- the client's half

    def init_client_state(self, start: Params) -> Params | None:
        """A client's state at its first participation, from the model it received; None: the algorithm keeps none."""
        return None

    def loss(self, output: torch.Tensor, labels: torch.Tensor, params: Params, client: ClientRound) -> torch.Tensor:
        """The objective of one local step, differentiated by autograd: the path's loss by default.

        ``params`` are the client's parameters being trained (``client.start`` the model it received).
        """
        return client.path_loss(output, labels)

    def correct_gradient(self, name: str, gradient: torch.Tensor, value: torch.Tensor, client: ClientRound) -> None:
        """Change parameter ``name``'s gradient (of :meth:`loss`) in place before the step; ``value`` is its value."""

    def upload(self, client: ClientRound, trained: Params) -> tuple[Upload, Params | None]:
        """(What the client sends, its next state) after local training; ``trained`` holds the trained parameters."""
        return Upload({name: trained[name] - client.start[name] for name in trained}, client.num_samples), client.state

    @property
    def needs_start_gradient(self) -> bool:
        """Whether each client computes :attr:`ClientRound.start_gradient` before it trains: the gradient of the path's
        loss over all its samples at the model it received (one more backward pass; SCAFFOLD's option I)."""
        return False

    @property
    def stateful(self) -> bool:
        """Whether clients keep a state between participations."""
        return keeps_client_state(type(self))


def keeps_client_state(cls: type[FederatedAlgorithm]) -> bool:
    """Whether the clients of ``cls`` keep a state between participations (it defines ``init_client_state``)."""
    return cls.init_client_state is not FederatedAlgorithm.init_client_state
