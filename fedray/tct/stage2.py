"""TCT stage 2 (Yu et al., NeurIPS 2022): the convexified problem and its federated solvers.

Every client k holds eNTK features Z_k (n_k × p) and labels y_k. Stage 2 is the
linear regression with a bias of the paper's Algorithm 2 (ψ = (φ, b),
ŷ = φᵀ z̃ + b)

    min_{W,b}  F(W, b) = Σ_k w_k F_k(W, b),   F_k(W, b) = ‖Z_k W + 1 bᵀ − Y_k‖²_F / (2 n_k),

with targets Y_k = onehot(y_k) − 1/C and aggregation weights w_k = n_k / N
(``weighted=True``: F is the pooled (1/2N) ‖Z W + 1 bᵀ − Y‖²_F) or 1/K. Before
it, the features are standardized across clients with one round of
communication (``normalization``), and ``random_projection`` shrinks p when it
is too large.

The bias is a constant-1 coordinate appended to the standardized features
(``with_intercept``): the model is one (p + 1) × C matrix ψ = [W; bᵀ] acting on
X_k = [Z_k, 1], so F_k(ψ) = ‖X_k ψ − Y_k‖²_F / (2 n_k) and every formula below
(gradients, control variates, XᵀX and XᵀY, the closed form, F from statistics)
is plain least squares in p + 1 coordinates. The paper has the bias; the
authors' code (``mnist/utils.py``: ``scaffold_update``) has none. With features
centered over all clients it carries the class prior (see
``closed_form_stage2``), which a model without it cannot represent.

Two solvers of the same problem:

* ``scaffold_stage2``: the paper's communication-efficient SCAFFOLD, full-batch
  local gradient steps with a drift correction, one model up and down per round;
* ``closed_form_stage2``: the exact minimizer from summed XᵀX and XᵀY, i.e. what a
  Fed3R-style upload of (p + 1)² + (p + 1)·C floats per client gives in one round.

Everything here works on in-memory tensors; the sharded Ray runtime wraps it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from fedray.errors import FedrayError
from fedray.methods.base import gram, single_threaded, spd_solve

STD_FLOOR = 1e-8
"""Smallest standard deviation a coordinate is divided by (see ``normalization``)."""

ROW_BLOCK = 4096
"""Rows widened to float64 at a time: 50,000 eNTK features of p = 100,000 are 40 GB in float64 at once."""


def row_blocks(count: int) -> list[slice]:
    return [slice(first, min(first + ROW_BLOCK, count)) for first in range(0, count, ROW_BLOCK)]


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


@dataclass
class Moments:
    """Normalization uploads summed over clients: sample count, Σ z and Σ z² (float64)."""

    count: int
    sums: torch.Tensor
    squares: torch.Tensor

    @classmethod
    def of(cls, features: torch.Tensor) -> Moments:
        """The moments of ``features``' rows, accumulated in float64 a block of rows at a time."""
        sums = torch.zeros(features.shape[1], dtype=torch.float64, device=features.device)
        squares = torch.zeros_like(sums)
        for rows in row_blocks(len(features)):
            block = features[rows].to(torch.float64)
            sums += block.sum(dim=0)
            squares += block.square().sum(dim=0)
        return cls(len(features), sums, squares)

    def __add__(self, other: Moments) -> Moments:
        return Moments(self.count + other.count, self.sums + other.sums, self.squares + other.squares)

    def normalization(self, eps: float = STD_FLOOR) -> tuple[torch.Tensor, torch.Tensor]:
        """(μ, σ) with σ² the population variance, floored at ``eps`` (see ``normalization``)."""
        mean = self.sums / self.count
        variance = (self.squares / self.count - mean.square()).clamp_min(0.0)
        return mean, variance.sqrt().clamp_min(eps)


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


def normalize(features: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(z − μ) / σ per coordinate, computed in float64 and returned in ``dtype`` (default: the features')."""
    return ((features.to(torch.float64) - mean) / std).to(dtype or features.dtype)


def standardize_clients(
    clients: Sequence[ClientData], eps: float = STD_FLOOR
) -> tuple[list[ClientData], torch.Tensor, torch.Tensor]:
    """The normalization round applied: every client's features standardized, and (mean, std) for test features."""
    mean, std = normalization(clients, eps)
    return [ClientData(normalize(client.features, mean, std), client.labels) for client in clients], mean, std


def targets(labels: torch.Tensor, num_classes: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The regression targets onehot(labels) − 1/C (n × C), TCT's centered one-hot encoding."""
    return torch.nn.functional.one_hot(labels.long(), num_classes).to(dtype) - 1.0 / num_classes


PROJECTION_BLOCK = 4096
"""Rows of the projection matrix drawn at a time: a p × D matrix is never held whole (100k × 10k is 8 GB)."""


def random_projection(features: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
    """``features`` (n × p) times a seeded Gaussian p × D matrix with N(0, 1/D) entries.

    For eNTK features too wide for stage 2: E‖Rᵀz‖² = ‖z‖² and inner products
    are kept up to O(1/√D) (Johnson–Lindenstrauss). The matrix depends only on
    (p, D, seed): it is drawn in float64 on the CPU, ``PROJECTION_BLOCK`` rows
    at a time from one generator, so every client rebuilds the same one from
    the shared seed with no communication. Project the raw features, then
    standardize the projected ones.
    """
    if dim < 1:
        raise FedrayError(f"the projection dimension must be >= 1, got {dim}")
    generator = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(dim)
    projected = torch.zeros(features.shape[0], dim, dtype=torch.float64, device=features.device)
    for first in range(0, features.shape[1], PROJECTION_BLOCK):
        block = features[:, first : first + PROJECTION_BLOCK].to(torch.float64)
        matrix = torch.randn(block.shape[1], dim, generator=generator, dtype=torch.float64) * scale
        projected += block @ matrix.to(features.device)
    return projected.to(features.dtype)


def with_intercept(features: torch.Tensor) -> torch.Tensor:
    """X = [Z, 1]: ``features`` (n × p) with a constant-1 coordinate appended, whose row of ψ is the bias b.

    Applied to standardized features (the constant is not standardized: it has
    no variance), by every place that fits or scores a stage-2 model ψ.
    """
    return torch.cat([features, torch.ones(len(features), 1, dtype=features.dtype, device=features.device)], dim=1)


def split_model(model: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, b) of a stage-2 model ψ = [W; bᵀ] ((p + 1) × C): the p × C weights and the C biases."""
    return model[:-1], model[-1]


def client_weights(clients: Sequence[ClientData], weighted: bool) -> torch.Tensor:
    """The aggregation weights w_k (float64, summing to 1): n_k / N, or 1/K when not ``weighted``."""
    if weighted:
        sizes = torch.tensor([len(client.labels) for client in clients], dtype=torch.float64)
        return sizes / sizes.sum()
    return torch.full((len(clients),), 1.0 / len(clients), dtype=torch.float64)


def _gradient(features: torch.Tensor, target: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """∇F_k(ψ) = X_kᵀ (X_k ψ − Y_k) / n_k (``features`` = X_k, the design with the intercept)."""
    return features.T @ (features @ model - target) / len(features)


def client_loss(features: torch.Tensor, target: torch.Tensor, model: torch.Tensor) -> float:
    """F_k(ψ) = ‖X_k ψ − Y_k‖²_F / (2 n_k) (``features`` = X_k = [Z_k, 1]), on one thread (``single_threaded``): the
    loss a row reports has the same bits whatever the threads of the process computing it."""
    with single_threaded():
        return float((features @ model - target).square().sum()) / (2 * len(target))


def local_delta(features: torch.Tensor, target: torch.Tensor, model: torch.Tensor, correction: torch.Tensor,
                steps: int, lr: float) -> torch.Tensor:
    """A client's y_K − ψ after K = ``steps`` full-batch steps y ← y − η (∇F_k(y) − h_k) from y_0 = ψ (h_k = ``correction``)."""
    local = model
    for _ in range(steps):
        local = local - lr * (_gradient(features, target, local) - correction)
    return local - model


def control_after(own: torch.Tensor, control: torch.Tensor, delta: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    """A participant's new control variate c_k⁺ = c_k − c − Δ_k / (Kη) (see ``ScaffoldStage2``)."""
    return own - control - delta / (steps * lr)


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


def stage2_statistics(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """XᵀX and XᵀY of X = [Z, 1] (``with_intercept``) and Y = onehot − 1/C, in float64: a client's (or a shard's summed)
    closed-form upload, (p + 1)² + (p + 1)·C floats for standardized features Z (n × p)."""
    features = with_intercept(features.to(torch.float64))
    return gram(features), features.T @ targets(labels, num_classes).to(features.device)


def objective_from_statistics(matrix: torch.Tensor, rhs: torch.Tensor, count: int, num_classes: int, model: torch.Tensor) -> float:
    """F(ψ) = ‖X ψ − Y‖²_F / (2N) from XᵀX, XᵀY and N alone: (tr ψᵀXᵀXψ − 2 tr ψᵀXᵀY + ‖Y‖²) / (2N),
    with ‖Y‖² = N (1 − 1/C) for the targets onehot − 1/C (X = [Z, 1], see ``stage2_statistics``).

    At the minimizer F is a difference of nearly equal terms (~1e-17 when the
    features fit the targets): computed on one thread (``single_threaded``), so
    its rounding does not depend on the threads of the driver computing it."""
    model = model.to(torch.float64)
    with single_threaded():
        quadratic = float((model * (matrix @ model)).sum()) - 2.0 * float((model * rhs).sum())
    return (quadratic + count * (1.0 - 1.0 / num_classes)) / (2 * count)


def solve_stage2(matrix: torch.Tensor, rhs: torch.Tensor, count: int, lam: float = 0.0) -> torch.Tensor:
    """ψ solving (XᵀX + λ N D) ψ = XᵀY, D = diag(1, …, 1, 0), from summed statistics (``count`` = N samples).

    See ``closed_form_stage2``. λ is fedray's extension (the paper's objective
    has no regularizer) against an ill-conditioned ZᵀZ; it does not penalize
    the bias, the last coordinate: that would pull predictions toward 0 rather
    than the class prior, and b needs no help (its curvature is 1, and with
    λ > 0 the matrix is positive definite all the same).
    """
    if lam < 0:
        raise FedrayError(f"lam must be >= 0, got {lam}")
    penalty = torch.ones(len(matrix), dtype=torch.float64, device=matrix.device)
    penalty[-1] = 0.0
    return spd_solve(matrix + lam * count * torch.diag(penalty), rhs)
