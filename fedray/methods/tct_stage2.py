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

The paper's ablations (§5.4, App. B.7) change this problem or its solver: without
the normalization round the features stay raw (``normalize`` is never applied);
with ``loss="ce"`` the squared loss gives way to softmax cross-entropy on the
scores X_k ψ against onehot(y_k) (``targets``, ``client_loss``,
``local_delta``: still M full-batch steps in float64, no closed form); without
the control variates SCAFFOLD is FedAvg (``correction`` off in the shards).

Two solvers of the same problem: the paper's communication-efficient SCAFFOLD
(full-batch local gradient steps with a drift correction, one model up and down
per round: ``local_delta``, ``control_after``, run by the stage-2 shards of
:mod:`fedray.runtime.tct_shards`), and the exact minimizer from summed XᵀX and
XᵀY (``stage2_statistics``, ``solve_stage2``), what a Fed3R-style upload of
(p + 1)² + (p + 1)·C floats per client gives in one round. Everything here works
on in-memory tensors; the sharded Ray runtime wraps it (the tests hold the same
solvers written for a list of clients in one process).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.core.numeric_options import check_positive
from fedray.core.options import Unset
from fedray.methods.base import gram, single_threaded, spd_solve

torch = lazy_module("torch", globals())

if TYPE_CHECKING:
    from fedray.methods.entk import EntkSpec
    from fedray.methods.training.modes import FineTuning

TCT = "tct"
"""TCT's ``--method`` name: its stage 1 a training algorithm (``--base``), its stage 2 this."""
STD_FLOOR = 1e-8
"""Smallest standard deviation a coordinate is divided by (see ``Moments.normalization``)."""

Loss = Literal["mse", "ce"]
LOSSES: tuple[str, ...] = typing.get_args(Loss)
"""Stage 2's losses: TCT's squared loss on the centered one-hot targets, or softmax cross-entropy (TCT-CE, App. B.7)."""
Solver = Literal["scaffold", "closed_form", "both"]
SOLVERS: tuple[str, ...] = typing.get_args(Solver)
EntkParams = Literal["all", "last_layer"]
ENTK_PARAMS: tuple[str, ...] = typing.get_args(EntkParams)
CLOSED_FORM_MAX_DIM = 10_000
"""Widest stage-2 problem the closed form solves: a 10k × 10k float64 system is 0.8 GB."""


@dataclass(frozen=True)
class TctStage2Options:
    """TCT's stage 2 (``--method tct``): the eNTK features it is solved on and its solver, as the paper and its
    ablations (§5.4, App. B.7) choose them."""

    entk_dim: Annotated[int, "eNTK coordinates p drawn from the parameters"] = 100_000
    entk_fp16: Annotated[bool, "store the eNTK features as float16 (half the memory)"] = False
    entk_chunk: Annotated[int, "samples per batched per-sample-gradient call"] = 32
    tct_rounds: Annotated[int, "stage-2 SCAFFOLD rounds"] = 100
    tct_local_steps: Annotated[int, "stage-2 full-batch local steps M"] = 500
    tct_lr: Annotated[float, "stage-2 learning rate η"] = 5e-5
    tct_solver: Annotated[Solver, "stage 2: scaffold (TCT's), closed_form (exact, one round) or both"] = "scaffold"
    tct_projection: Annotated[int | None, "stage 2 on a seeded random projection of the eNTK features to D coordinates",
                              Unset("no projection")] = None
    tct_lam: Annotated[float, "ridge λ of the closed-form stage 2 (0: the least-squares solution)"] = 0.0
    tct_fedavg: Annotated[bool, "ablation: stage 2 by FedAvg, SCAFFOLD without its control variates (TCT §5.4's "
                                "TCT-FedAvg)"] = False
    tct_no_normalization: Annotated[bool, "ablation: stage 2 on the raw eNTK features, without the normalization "
                                          "round's standardization (TCT §5.4's woN)"] = False
    tct_loss: Annotated[Loss, "stage-2 loss: mse (TCT's squared loss on onehot − 1/C) or ce (softmax cross-entropy, "
                              "the ablation TCT-CE; scaffold only)"] = "mse"
    entk_params: Annotated[EntkParams, "eNTK gradient w.r.t. all parameters, or last_layer: the last layer's weights "
                                       "only, the penultimate features (the ablation TCT-last-layer)"] = "all"

    def __post_init__(self) -> None:
        check_positive({"entk_dim": self.entk_dim, "entk_chunk": self.entk_chunk, "tct_rounds": self.tct_rounds,
                        "tct_local_steps": self.tct_local_steps, "tct_lr": self.tct_lr,
                        "tct_projection": self.tct_projection})
        if self.tct_solver not in SOLVERS:
            raise FedrayError(f"--tct-solver must be one of {', '.join(SOLVERS)}, got {self.tct_solver!r}")
        if self.tct_lam < 0:
            raise FedrayError(f"--tct-lam must be ≥ 0, got {self.tct_lam}")
        if self.tct_loss not in LOSSES:
            raise FedrayError(f"--tct-loss must be one of {', '.join(LOSSES)}, got {self.tct_loss!r}")
        if self.entk_params not in ENTK_PARAMS:
            raise FedrayError(f"--entk-params must be one of {', '.join(ENTK_PARAMS)}, got {self.entk_params!r}")
        if self.tct_loss == "ce" and self.tct_solver != "scaffold":
            raise FedrayError(f"--tct-loss ce has no closed form: it takes --tct-solver scaffold, "
                              f"not {self.tct_solver}")
        if self.tct_fedavg and self.tct_solver == "closed_form":
            raise FedrayError("--tct-fedavg turns off the control variates of stage 2's iterative solver: it takes "
                              "--tct-solver scaffold or both, not closed_form")

    def check_fits(self, network: "FineTuning") -> None:
        """A closed-form stage 2 (``tct_solver`` closed_form or both) on the eNTK features of the ``network`` stage 1
        fine-tunes solves a system at most :data:`CLOSED_FORM_MAX_DIM` wide."""
        if self.tct_solver == "scaffold":
            return
        sampled = self.entk_dim
        if self.entk_params == "last_layer":  # p of the d head weights: at most the penultimate width
            from fedray.data.images.backbones import get_backbone  # torchvision loads only for runs on images

            sampled = min(sampled, get_backbone(network.backbone).dim)
        width = self.tct_projection or sampled
        if width > CLOSED_FORM_MAX_DIM:
            raise FedrayError(f"the closed-form stage 2 solves a {width} × {width} system: give --tct-projection D "
                              f"≤ {CLOSED_FORM_MAX_DIM} (or --entk-dim ≤ {CLOSED_FORM_MAX_DIM})")

    # What the engine's stage 2 (fedray.engine.tct) asks of these options: it names none of them.

    @property
    def rounds(self) -> int:
        """The iterative solver's rounds."""
        return self.tct_rounds

    @property
    def solves_closed_form(self) -> bool:
        return self.tct_solver in ("closed_form", "both")

    @property
    def solves_iteratively(self) -> bool:
        """SCAFFOLD's rounds (FedAvg's with ``tct_fedavg``)."""
        return self.tct_solver in ("scaffold", "both")

    @property
    def normalized(self) -> bool:
        """Whether a normalization round standardizes the features first (else stage 2 runs on the raw ones)."""
        return not self.tct_no_normalization

    @property
    def corrected(self) -> bool:
        """Whether the iterative solver keeps SCAFFOLD's control variates."""
        return not self.tct_fedavg

    @property
    def entk_passes(self) -> float:
        """Forward passes a sample's eNTK features cost: a forward and a backward pass (~3), or only the forward pass
        whose penultimate features they are (the last layer's)."""
        return 1.0 if self.entk_params == "last_layer" else 3.0

    def entk_spec(self, head: range, num_parameters: int, seed: int) -> EntkSpec:
        """The eNTK features to compute: ``entk_dim`` coordinates drawn from ``seed`` among the network's
        ``num_parameters`` (the last layer's: its ``head`` coordinates), ``entk_chunk`` samples at a time."""
        from fedray.methods.entk import EntkSpec, sample_coordinates  # torch.func, only where eNTK features are made

        coordinates = head if self.entk_params == "last_layer" else range(num_parameters)
        index = sample_coordinates(coordinates, self.entk_dim, seed)
        return EntkSpec(seed, index, self.entk_chunk, torch.float16 if self.entk_fp16 else torch.float32)

    def solve(self, matrix: torch.Tensor, rhs: torch.Tensor, count: int) -> torch.Tensor:
        """The closed-form stage 2 from the summed XᵀX and XᵀY of ``count`` samples (:func:`solve_stage2`)."""
        return solve_stage2(matrix, rhs, count, self.tct_lam)

ROW_BLOCK = 4096
"""Rows widened to float64 at a time: 50,000 eNTK features of p = 100,000 are 40 GB in float64 at once."""


def row_blocks(count: int) -> list[slice]:
    return [slice(first, min(first + ROW_BLOCK, count)) for first in range(0, count, ROW_BLOCK)]


@dataclass
class Moments:
    """Normalization uploads summed over clients: sample count, Σ z and Σ z² (float64; the count a 0-d tensor on the
    CPU, an upload's tensor like the others)."""

    count: torch.Tensor
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
        return cls(torch.tensor(float(len(features)), dtype=torch.float64), sums, squares)

    def __add__(self, other: Moments) -> Moments:
        return Moments(self.count + other.count, self.sums + other.sums, self.squares + other.squares)

    def normalization(self, eps: float = STD_FLOOR) -> tuple[torch.Tensor, torch.Tensor]:
        """(μ, σ) with σ² the population variance, floored at ``eps`` (see ``Moments.normalization``)."""
        mean = self.sums / self.count
        variance = (self.squares / self.count - mean.square()).clamp_min(0.0)
        return mean, variance.sqrt().clamp_min(eps)


def normalize(features: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(z − μ) / σ per coordinate, computed in float64 and returned in ``dtype`` (default: the features')."""
    return ((features.to(torch.float64) - mean) / std).to(dtype or features.dtype)


def targets(labels: torch.Tensor, num_classes: int, dtype: torch.dtype | None = None,
            loss: str = "mse") -> torch.Tensor:
    """The targets Y (n × C, in ``dtype``: float64 unless given) of ``loss``: onehot(labels) − 1/C, TCT's centered
    one-hot encoding, for the squared loss; onehot(labels) for cross-entropy (whose gradient softmax − Y needs rows
    that sum to 1)."""
    onehot = torch.nn.functional.one_hot(labels.long(), num_classes).to(dtype or torch.float64)
    return onehot if loss == "ce" else onehot - 1.0 / num_classes


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


def _gradient(features: torch.Tensor, target: torch.Tensor, model: torch.Tensor, loss: str = "mse") -> torch.Tensor:
    """∇F_k(ψ) = X_kᵀ (X_k ψ − Y_k) / n_k for the squared loss, X_kᵀ (softmax(X_k ψ) − Y_k) / n_k for cross-entropy
    (``features`` = X_k, the design with the intercept; ``target`` = Y_k of ``targets`` for that loss)."""
    scores = features @ model
    residual = torch.softmax(scores, dim=1) - target if loss == "ce" else scores - target
    return features.T @ residual / len(features)


def client_loss(features: torch.Tensor, target: torch.Tensor, model: torch.Tensor, loss: str = "mse") -> float:
    """F_k(ψ) = ‖X_k ψ − Y_k‖²_F / (2 n_k), or for cross-entropy the mean of logsumexp(x_i ψ) − ⟨x_i ψ, y_i⟩
    (``features`` = X_k = [Z_k, 1]), on one thread (``single_threaded``): the loss a row reports has the same bits
    whatever the threads of the process computing it."""
    with single_threaded():
        scores = features @ model
        if loss == "ce":
            return float((torch.logsumexp(scores, dim=1) - (scores * target).sum(dim=1)).sum()) / len(target)
        return float((scores - target).square().sum()) / (2 * len(target))


def local_delta(features: torch.Tensor, target: torch.Tensor, model: torch.Tensor, correction: torch.Tensor,
                steps: int, lr: float, loss: str = "mse") -> torch.Tensor:
    """A client's y_K − ψ after K = ``steps`` full-batch steps y ← y − η (∇F_k(y) − h_k) from y_0 = ψ (h_k = ``correction``)."""
    local = model
    for _ in range(steps):
        local = local - lr * (_gradient(features, target, local, loss) - correction)
    return local - model


def control_after(own: torch.Tensor, control: torch.Tensor, delta: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    """A participant's new control variate c_k⁺ = c_k − c − Δ_k / (Kη) (see ``ScaffoldStage2``)."""
    return own - control - delta / (steps * lr)


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
