"""TCT stage 2 solved in one process over a list of clients: the reference the sharded runtime is tested against.

The in-memory counterparts of :mod:`fedray.runtime.tct_shards`: the normalization round over all clients, the
paper's communication-efficient SCAFFOLD (``scaffold_stage2``) and the closed form (``closed_form_stage2``), on the
maths of :mod:`fedray.methods.tct_stage2` (tests only: the package runs the sharded solvers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from fedray.core.errors import FedrayError
from fedray.methods.tct_stage2 import (
    STD_FLOOR,
    Moments,
    client_loss,
    control_after,
    local_delta,
    normalize,
    solve_stage2,
    stage2_statistics,
    targets,
    with_intercept,
)


@dataclass(frozen=True)
class ClientData:
    """One client's stage-2 data: ``features`` (n_k × p) and integer ``labels`` (n_k,)."""

    features: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.features.dim() != 2 or self.labels.dim() != 1 or len(self.features) != len(self.labels):
            raise FedrayError(
                f"a client needs features (n, p) and labels (n,), got {tuple(self.features.shape)} and {tuple(self.labels.shape)}"
            )
        if len(self.labels) == 0:
            raise FedrayError("a client without samples has no stage-2 loss")


def normalization(clients: Sequence[ClientData], eps: float = STD_FLOOR) -> tuple[torch.Tensor, torch.Tensor]:
    """The global per-coordinate (mean, std) in float64, from one upload per client.

    Client k sends n_k, Σ z and Σ z² (2p + 1 floats); the server forms
    μ = Σ z / N and σ² = Σ z² / N − μ² (the population variance, as scikit-learn's
    ``StandardScaler`` that the TCT code uses) and broadcasts μ and σ (2p floats).
    The sums accumulate in float64 because the variance is a difference of two
    of them. σ is floored at ``eps``: a constant coordinate (a parameter whose
    gradient is always zero, common in eNTK features) is then only centered,
    where dividing by a zero σ would give NaN.
    """
    if not clients:
        raise FedrayError("normalization needs at least one client")
    return sum((Moments.of(client.features) for client in clients[1:]), Moments.of(clients[0].features)).normalization(eps)


def standardize_clients(
    clients: Sequence[ClientData], eps: float = STD_FLOOR
) -> tuple[list[ClientData], torch.Tensor, torch.Tensor]:
    """The normalization round applied: every client's features standardized, and (mean, std) for test features."""
    mean, std = normalization(clients, eps)
    return [ClientData(normalize(client.features, mean, std), client.labels) for client in clients], mean, std


def client_weights(clients: Sequence[ClientData], weighted: bool) -> torch.Tensor:
    """The aggregation weights w_k (float64, summing to 1): n_k / N, or 1/K when not ``weighted``."""
    if weighted:
        sizes = torch.tensor([len(client.labels) for client in clients], dtype=torch.float64)
        return sizes / sizes.sum()
    return torch.full((len(clients),), 1.0 / len(clients), dtype=torch.float64)


@dataclass(frozen=True)
class Stage2Round:
    """One SCAFFOLD round: who took part, the global objective after it, and its traffic in floats."""

    round: int
    clients: tuple[int, ...]
    loss: float
    accuracy: float
    floats_up: int
    floats_down: int
    metrics: dict[str, float] = field(default_factory=dict)


class ScaffoldStage2:
    """TCT's communication-efficient SCAFFOLD on F, one ``step`` per round, over ψ = [W; bᵀ] ((p + 1) × C).

    ``clients`` hold standardized features Z_k; the solver works on their designs
    X_k = [Z_k, 1] (``with_intercept``, kept as ``self.clients``), so W_t below
    stands for the whole ψ_t, bias included (Algorithm 2 runs SCAFFOLD over
    ψ = (φ, b)).

    Round t, with global model W_t and sampled clients S (all by default). Client
    k starts from y_0 = W_t and runs K = ``local_steps`` full-batch steps

        y_{j+1} = y_j − η (∇F_k(y_j) − h_k),   h_k = c_k − c,

    and sends back its delta Δ_k = y_K − W_t; the server moves to
    W_{t+1} = W_t + Σ_{k∈S} w_k Δ_k / Σ_{k∈S} w_k. The control variates are
    SCAFFOLD's option II: c_k estimates ∇F_k, c = Σ_k w_k c_k over *all* clients
    (zeros at the start), so Σ_k w_k h_k = 0 always. At a round's start, the
    corrected local gradient is ∇F(W_t) up to the control error, and the local
    model no longer drifts to client k's own minimizer.

    Derivation of the one-model-per-round bookkeeping. Summing the K local
    steps, Δ_k = −Kη (mean_j ∇F_k(y_j) − c_k + c), so a participant's new control
    variate, the mean gradient along its own trajectory, needs no extra upload:

        c_k⁺ = mean_j ∇F_k(y_j) = c_k − c − Δ_k / (Kη),

    and the server, knowing c and Δ_k, keeps c = Σ_k w_k c_k exact with
    c⁺ = c + Σ_{k∈S} w_k (c_k⁺ − c_k). With full participation Σ_k w_k = 1 and
    Σ_k w_k c_k = c give c⁺ = (W_t − W_{t+1}) / (Kη): every client derives c⁺ from
    the two last global models it received, hence
    h_k⁺ = h_k + (W_{t+1} − y_K) / (Kη), the update of the TCT code. Per round
    and participant that is (p + 1)·C floats up (Δ_k) and (p + 1)·C down
    (W_{t+1}). When clients are sampled, a client that skipped rounds cannot
    derive c, so the server sends it with the model: 2·(p + 1)·C down.

    With full participation and K = 1 the round is exactly full-batch gradient
    descent on F: W_{t+1} = W_t − η Σ_k w_k (∇F_k(W_t) − h_k) = W_t − η ∇F(W_t).

    ``correction=False`` keeps h_k = 0: FedAvg with full-batch local steps, the
    baseline whose fixed point under label skew is not the minimizer of F.
    Computation runs in the features' dtype; the weights are float64.
    """

    def __init__(
        self,
        clients: Sequence[ClientData],
        num_classes: int,
        local_steps: int = 500,
        lr: float = 5e-5,
        clients_per_round: int | None = None,
        seed: int = 0,
        weighted: bool = True,
        correction: bool = True,
    ) -> None:
        if not clients:
            raise FedrayError("stage 2 needs at least one client")
        if local_steps < 1 or not lr > 0:
            raise FedrayError(f"stage 2 needs local_steps >= 1 and lr > 0, got {local_steps} and {lr}")
        if clients_per_round is not None and clients_per_round < 1:
            raise FedrayError(f"clients_per_round must be >= 1, got {clients_per_round}")
        dims = {client.features.shape[1] for client in clients}
        dtypes = {client.features.dtype for client in clients}
        if len(dims) != 1 or len(dtypes) != 1:
            raise FedrayError(f"all clients need features of one width and dtype, got widths {sorted(dims)} and {len(dtypes)} dtypes")
        self.clients = [ClientData(with_intercept(client.features), client.labels) for client in clients]
        self.num_classes = num_classes
        self.local_steps = local_steps
        self.lr = lr
        self.correction = correction
        self.dtype = dtypes.pop()
        self.targets = [targets(client.labels, num_classes, self.dtype) for client in self.clients]
        self.weights = client_weights(self.clients, weighted)
        self.sample_size = len(self.clients) if clients_per_round is None else min(clients_per_round, len(self.clients))
        self.generator = torch.Generator().manual_seed(seed)
        shape = (dims.pop() + 1, num_classes)
        device = self.clients[0].features.device
        self.model = torch.zeros(shape, dtype=self.dtype, device=device)
        self.client_controls = torch.zeros((len(self.clients), *shape), dtype=self.dtype, device=device)
        self.control = torch.zeros(shape, dtype=self.dtype, device=device)
        self.round = 0

    def corrections(self) -> torch.Tensor:
        """All clients' h_k = c_k − c (K × (p + 1) × C); Σ_k w_k h_k = 0."""
        return self.client_controls - self.control

    def sample(self) -> list[int]:
        """The round's participants: everyone, or ``clients_per_round`` drawn uniformly without replacement."""
        if self.sample_size == len(self.clients):
            return list(range(len(self.clients)))
        return sorted(torch.randperm(len(self.clients), generator=self.generator)[: self.sample_size].tolist())

    def local_update(self, client: int) -> torch.Tensor:
        """Client ``client``'s delta y_K − W_t after K corrected full-batch steps from the global model."""
        correction = self.client_controls[client] - self.control
        return local_delta(self.clients[client].features, self.targets[client], self.model, correction, self.local_steps, self.lr)

    def loss_and_accuracy(self, model: torch.Tensor) -> tuple[float, float]:
        """F(model) and the pooled training accuracy of argmax(Z W + 1 bᵀ)."""
        loss = 0.0
        correct = 0
        for weight, client, target in zip(self.weights.tolist(), self.clients, self.targets):
            loss += weight * client_loss(client.features, target, model)
            correct += int(((client.features @ model).argmax(dim=1) == client.labels).sum())
        return loss, correct / sum(len(client.labels) for client in self.clients)

    def step(self, participants: Sequence[int] | None = None) -> Stage2Round:
        """One round (of ``participants``, else a ``sample()``); the server's and the participants' control variates are updated in place."""
        participants = self.sample() if participants is None else sorted(participants)
        weights = self.weights[participants]
        shares = (weights / weights.sum()).to(self.dtype)
        deltas = [self.local_update(client) for client in participants]
        self.model = self.model + sum(share * delta for share, delta in zip(shares, deltas))
        if self.correction:
            control_change = torch.zeros_like(self.control)
            for client, weight, delta in zip(participants, weights.tolist(), deltas):
                updated = control_after(self.client_controls[client], self.control, delta, self.local_steps, self.lr)
                control_change += weight * (updated - self.client_controls[client])
                self.client_controls[client] = updated
            self.control = self.control + control_change
        self.round += 1
        loss, accuracy = self.loss_and_accuracy(self.model)
        floats = self.model.numel()
        full = len(participants) == len(self.clients)
        return Stage2Round(
            round=self.round,
            clients=tuple(participants),
            loss=loss,
            accuracy=accuracy,
            floats_up=len(participants) * floats,
            floats_down=len(participants) * floats * (1 if full or not self.correction else 2),
        )


def scaffold_stage2(
    clients: Sequence[ClientData],
    num_classes: int,
    rounds: int = 100,
    local_steps: int = 500,
    lr: float = 5e-5,
    clients_per_round: int | None = None,
    seed: int = 0,
    weighted: bool = True,
    correction: bool = True,
    evaluate: Callable[[torch.Tensor], dict[str, float]] | None = None,
) -> tuple[torch.Tensor, list[Stage2Round]]:
    """Stage 2 by ``rounds`` rounds of ``ScaffoldStage2`` from ψ = 0; returns ψ = [W; bᵀ] ((p + 1) × C) and the rounds.

    The defaults are the TCT paper's (100 rounds of 500 local steps at η = 5e-5).
    ``clients`` should already be standardized (``standardize_clients``).
    ``evaluate(ψ)``, when given, is called after every round and its result is
    stored as the round's ``metrics`` (e.g. test accuracy).
    """
    solver = ScaffoldStage2(clients, num_classes, local_steps, lr, clients_per_round, seed, weighted, correction)
    history = []
    for _ in range(rounds):
        record = solver.step()
        if evaluate is not None:
            record = replace(record, metrics=evaluate(solver.model))
        history.append(record)
    return solver.model, history


def closed_form_stage2(clients: Sequence[ClientData], num_classes: int, lam: float = 0.0) -> torch.Tensor:
    """The exact minimizer ψ = [W; bᵀ] of (1/2N) ‖Z W + 1 bᵀ − Y‖²_F + (λ/2) ‖W‖²_F in float64 ((p + 1) × C).

    Solves (Σ_k X_kᵀX_k + λ N D) ψ = Σ_k X_kᵀY_k, X_k = [Z_k, 1] and
    D = diag(1, …, 1, 0), from the clients' summed statistics ((p + 1)² +
    (p + 1)·C floats up per client, one round) by Cholesky. ``lam`` regularizes
    an ill-conditioned or rank-deficient ZᵀZ (p close to or above N) and leaves
    b alone (see ``solve_stage2``); with ``lam = 0`` and a singular XᵀX the
    solve falls back to least squares, which gives the minimum-norm minimizer.
    It is the pooled (``weighted=True``) objective; ``clients`` should already
    be standardized.

    Standardized over all clients, the features sum to zero (Σ z̃ = 0), so the
    system decouples: W is the minimizer without a bias and b = Ȳ, the class
    frequencies minus 1/C, nonzero when the classes are imbalanced.
    """
    if not clients:
        raise FedrayError("stage 2 needs at least one client")
    dim = clients[0].features.shape[1] + 1
    matrix = torch.zeros(dim, dim, dtype=torch.float64)
    rhs = torch.zeros(dim, num_classes, dtype=torch.float64)
    for client in clients:
        client_matrix, client_rhs = stage2_statistics(client.features, client.labels, num_classes)
        matrix += client_matrix
        rhs += client_rhs
    return solve_stage2(matrix, rhs, sum(len(client.labels) for client in clients), lam)

