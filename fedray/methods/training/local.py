"""Local training of many clients' softmax heads at once (linear probing on frozen features).

Every client sampled in a round starts from the global head (W₀, b₀) and runs
``epochs`` epochs of mini-batch SGD on its own n samples X (n × d). Every
gradient of the cross-entropy with respect to W is Xᵀ(something), and weight
decay and FedProx's pull only rescale W and W − W₀, so after any number of
steps

    W = β W₀ + Xᵀ A        with a scalar β and A of shape (n, C).

Training therefore runs in this "dual" form: one GEMM gives the logits X W₀,
one gives the Gram matrix X Xᵀ, and each step then costs b · n · C (a batch of b
rows against the client's n samples) instead of touching the d × C weights.
Clients are stacked (padded) and trained together, largest first, so a step
computes only the clients that still have mini-batches. A client's padding
and every product it takes part in have shapes fixed by its own size alone
(:func:`size_groups`, :func:`~fedray.methods.row_blocks.rowwise_matmul`), so
its head comes out in the same bits whichever clients share its shard or its
batch. The summed update of a group of clients, Σ n_k (W_k − W₀), is one
more GEMM over their concatenated samples (:meth:`TrainedHeads.weighted_update`,
per part of the clients). SGD momentum keeps the form: the momentum buffer is a sum of such
gradients, ν W₀ + Xᵀ V. The result equals training each client alone with
``torch.optim.SGD`` (with or without momentum) on the same mini-batches
(tested to float64 round-off). It trains the built-in algorithms' clients only
(cross-entropy, FedProx, SCAFFOLD); :mod:`fedray.methods.training.heads` picks it or
autograd (:func:`~fedray.methods.training.client_sgd.local_sgd`) per algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from fedray.core.lazy_modules import lazy_module
from fedray.methods.base import Classifier
from fedray.methods.row_blocks import rowwise_matmul
from fedray.methods.training.budgets import budgeted
from fedray.methods.training.schedule import LrSchedule

torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class LocalSGD:
    """Client optimizer; defaults are Fed3R Appendix C's (lr 0.1, weight decay 4e-5, batch 50, 5 epochs, no momentum).

    ``prox_mu`` > 0 adds FedProx's (μ/2)‖θ − θ_global‖² (weights and bias) in the dual form
    (:class:`~fedray.methods.training_algorithms.FedProx` sets it; autograd takes it from the algorithm); logits are divided by ``temperature`` (a closed-form initialization wants 0.1).
    ``momentum`` is ``torch.optim.SGD``'s (heavy ball, no dampening); every
    client starts every round with a zero momentum buffer, as a client that
    creates its optimizer when the round's model arrives (SphereFed trains
    each participation afresh; TCT's code keeps one optimizer per client but
    without momentum, so it holds no state). ``schedule`` sets ``lr`` per
    round (:mod:`fedray.methods.training.schedule`); :meth:`for_round` applies it.
    """

    lr: float = 0.1
    weight_decay: float = 4e-5
    batch_size: int = 50
    epochs: int = 5
    prox_mu: float = 0.0
    temperature: float = 1.0
    momentum: float = 0.0
    schedule: LrSchedule = LrSchedule()

    def for_round(self, round_number: int) -> "LocalSGD":
        """This optimizer at training round ``round_number``'s learning rate (itself when the rate is constant)."""
        if self.schedule.kind == "constant":
            return self
        return replace(self, lr=self.lr * self.schedule.factor(round_number), schedule=LrSchedule())


def random_head(dim: int, num_classes: int, seed: int) -> dict[str, torch.Tensor]:
    """``nn.Linear``'s initialization, U(−1/√d, 1/√d) for weight (d, C) and bias (C,), from a generator seeded by ``seed``.

    Every random head of a run starts here (linear probing, the fine-tuning
    head transposed, SphereFed's projection), so the same seed gives the same
    draws whichever path trains them.
    """
    generator = torch.Generator().manual_seed(seed)
    bound = 1 / math.sqrt(dim)
    weight = torch.empty(dim, num_classes).uniform_(-bound, bound, generator=generator)
    return {"weight": weight, "bias": torch.empty(num_classes).uniform_(-bound, bound, generator=generator)}


def classifier_head(classifier: Classifier) -> dict[str, torch.Tensor]:
    """A closed-form classifier as the head training starts from (``--init``): :func:`random_head`'s weight (d, C) and
    bias (C,) in float32, the bias zero where the classifier has none."""
    weight = classifier.weight.to(torch.float32)
    bias = torch.zeros(weight.shape[1]) if classifier.bias is None else classifier.bias.to(torch.float32)
    return {"weight": weight, "bias": bias}


def minibatches(size: int, batch_size: int, epochs: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A client's mini-batches (indices into its samples) for all epochs: a fresh permutation per epoch."""
    batches = []
    for _ in range(epochs):
        order = rng.permutation(size)
        batches += [order[start : start + batch_size] for start in range(0, size, batch_size)]
    return batches


def client_rng(seed: int, round_number: int, client: int) -> np.random.Generator:
    """A client's mini-batch order in a round depends on nothing else (not on shards or co-sampled clients)."""
    return np.random.default_rng((seed, round_number, client))


@dataclass(frozen=True)
class Control:
    """SCAFFOLD's control variates in dual form.

    The server's c is (``weight`` (d, C), ``bias`` (C,)); a client's c_i is the
    gradient of its loss at the server model of its last participation
    (option I of Karimireddy et al.), X_iᵀ G_i and 1ᵀ G_i, so it is stored as
    the n_i × C matrix G_i: ``rows`` holds G of the given clients' samples,
    aligned with their features.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    rows: torch.Tensor


@dataclass
class TrainedHeads:
    """Every client's trained head in dual form: W_k = β_k W₀ + X_kᵀ A_k + γ_k c, bias c_k.

    Per-client values are in the order the clients were given; ``coefficients``
    (rows, C) holds every A_k, row-aligned with ``features`` (client after
    client, ``offsets`` delimiting them). ``start_losses`` is the cross-entropy of
    the starting head on each of those samples; ``gradient_rows`` is G of each
    sample at the starting head (the new SCAFFOLD control variates),
    ``control`` the one trained with (or None), ``loss_squares`` each client's
    sum of its samples' squared cross-entropy at the starting head, in float64
    (None: not measured).
    """

    weight: torch.Tensor
    scale: torch.Tensor
    coefficients: torch.Tensor
    control_scale: torch.Tensor
    bias: torch.Tensor
    features: torch.Tensor
    offsets: np.ndarray
    start_losses: torch.Tensor
    gradient_rows: torch.Tensor
    control: Control | None
    loss_squares: torch.Tensor | None = None

    @property
    def sizes(self) -> torch.Tensor:
        return torch.from_numpy(np.diff(self.offsets)).to(self.weight.dtype)

    def _row_sizes(self, part: slice) -> torch.Tensor:
        """Each sample's client size, row-aligned with the rows of the clients ``part``."""
        sizes = self.sizes[part]
        return torch.repeat_interleave(sizes, sizes.long())[:, None]

    def _rows(self, part: slice) -> slice:
        """The rows of the clients ``part`` (a range of them)."""
        first, end, _ = part.indices(len(self.scale))
        return slice(int(self.offsets[first]), int(self.offsets[end]))

    def start_loss(self, part: slice = slice(None)) -> float:
        """The starting head's cross-entropy summed over the samples of the clients ``part`` (a range of them)."""
        return float(self.start_losses[self._rows(part)].sum())

    def weights(self) -> torch.Tensor:
        """The heads themselves, (clients, d, C); for checks — aggregation never forms them."""
        heads = []
        for k in range(len(self.scale)):
            rows = slice(self.offsets[k], self.offsets[k + 1])
            head = self.scale[k] * self.weight + self.features[rows].T @ self.coefficients[rows]
            if self.control is not None:
                head += self.control_scale[k] * self.control.weight
            heads.append(head)
        return torch.stack(heads)

    def weighted_update(self, global_bias: torch.Tensor, part: slice = slice(None)
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Σ n_k (W_k − W₀), Σ n_k (c_k − b₀), Σ n_k) over the clients ``part`` (a range of them; default all): what
        FedAvg-style aggregation sums. Its bits depend on those clients' heads alone."""
        n, rows = self.sizes[part], self._rows(part)
        delta_w = torch.addmm(self.weight, self.features[rows].T, self._row_sizes(part) * self.coefficients[rows],
                              beta=float((n * (self.scale[part] - 1)).sum()))
        if self.control is not None:
            delta_w += (n * self.control_scale[part]).sum() * self.control.weight
        delta_b = (n[:, None] * (self.bias[part] - global_bias)).sum(dim=0)
        return delta_w, delta_b, n.sum()

    def client_update(self, k: int, global_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_k − W₀, c_k − b₀): client ``k``'s own update, for a postprocessor that sees each upload."""
        rows = slice(self.offsets[k], self.offsets[k + 1])
        delta_w = torch.addmm(self.weight, self.features[rows].T, self.coefficients[rows], beta=float(self.scale[k] - 1))
        if self.control is not None:
            delta_w += self.control_scale[k] * self.control.weight
        return delta_w, self.bias[k] - global_bias

    def client_control_change(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_k⁺ − c_k for the weights, the same for the bias): client ``k``'s own SCAFFOLD upload."""
        rows = slice(self.offsets[k], self.offsets[k + 1])
        change = self.gradient_rows[rows] - self.control.rows[rows]
        return self.features[rows].T @ change, change.sum(dim=0)

    def control_update(self, part: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ n_k (c_k⁺ − c_k) for the weights, the same for the bias) over the clients ``part`` (a range of them;
        default all): SCAFFOLD's server-side sum."""
        rows = self._rows(part)
        return control_change(self.features[rows], self._row_sizes(part), self.gradient_rows[rows],
                              self.control.rows[rows])


def control_change(features: torch.Tensor, row_sizes: torch.Tensor, gradient_rows: torch.Tensor,
                   control_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ n_k (c_k⁺ − c_k) for the weights and the bias, from the new and old G rows (``row_sizes``: each row's n_k)."""
    change = row_sizes * (gradient_rows - control_rows)
    return features.T @ change, change.sum(dim=0)


SMALLEST_WIDTH = 4
"""The padded width of the smallest clients (a group each of the widths 4, 8, 16, 32, 64)."""
WIDTH_STEP = 32
"""Beyond 64 samples, a client is padded to the next multiple of this: a large client's padding stays small (its steps
and its Gram dominate a round's work), as a power of two's would not."""


def padded_width(size: int) -> int:
    """The width a client of ``size`` samples is padded to: the smallest power of two ≥ its size, at least
    :data:`SMALLEST_WIDTH`, up to 64; beyond, the next multiple of :data:`WIDTH_STEP`. Fixed by the client's own size,
    so that every product of its steps has the same shapes whichever clients train beside it (a product's bits follow
    its shapes: a wider padding sums the same terms in another order)."""
    if size > 64:
        return -(-int(size) // WIDTH_STEP) * WIDTH_STEP
    return max(SMALLEST_WIDTH, 1 << (int(size) - 1).bit_length())


def size_groups(sizes: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Client indices grouped by :func:`padded_width`, widest first, with that width: padding to it at most doubles a
    member's size (beyond the smallest width), so that a 2,500-sample client's step never makes a 2-sample one's cost
    as much (bench_lp's clients: grouped by powers of two alone, the large ones' padding cost a fifth of its speed)."""
    widths = np.array([padded_width(size) for size in sizes], dtype=np.int64)
    order = np.argsort(-widths, kind="stable")
    starts = np.flatnonzero(np.diff(widths[order], prepend=-1))
    return [(int(widths[order[start]]), group) for start, group in zip(starts, np.split(order, starts[1:]))]


def train_heads(
    features: torch.Tensor,
    labels: torch.Tensor,
    offsets: np.ndarray,
    clients: np.ndarray,
    weight: torch.Tensor,
    bias: torch.Tensor,
    sgd: LocalSGD,
    seed: int,
    round_number: int,
    control: Control | None = None,
    steps: np.ndarray | None = None,
    loss_squares: bool = False,
) -> TrainedHeads:
    """Train every client's head from (``weight`` (d, C), ``bias`` (C,)) on its own samples.

    ``features`` / ``labels`` hold the clients' samples concatenated in the
    order of ``clients`` (client ``k`` owns rows ``offsets[k]:offsets[k+1]``).
    With ``control`` every step follows SCAFFOLD's g + c − c_i (the correction
    is part of the gradient, so momentum accumulates it too). Everything
    that depends only on the starting head is computed once for all rows;
    the steps run per group of similar sizes (:func:`size_groups`).
    ``steps[k]`` (≥ 1; None: no budget) is the most steps client ``k`` takes,
    the first of its mini-batches (:mod:`~fedray.methods.training.budgets`): a
    slot leaves the batched steps when its plan ends, as a smaller client's does. With ``loss_squares`` each
    client's squared losses at the starting head are summed too (one segment sum over the rows).
    """
    count, dtype = len(clients), weight.dtype
    sgd = sgd.for_round(round_number)
    sizes = np.diff(offsets)
    base = rowwise_matmul(features, weight)
    start_logits = base + bias
    losses = torch.nn.functional.cross_entropy(start_logits / sgd.temperature, labels, reduction="none")
    squares = None
    if loss_squares:
        owners = torch.repeat_interleave(torch.arange(count), torch.from_numpy(sizes))
        squares = torch.zeros(count, dtype=torch.float64).index_add_(0, owners, losses.double() ** 2)
    row_sizes = torch.repeat_interleave(torch.from_numpy(sizes).to(dtype), torch.from_numpy(sizes))
    gradient = torch.softmax(start_logits / sgd.temperature, dim=-1)
    gradient[torch.arange(len(labels)), labels] -= 1
    gradient /= (row_sizes * sgd.temperature)[:, None]
    state = _Steps(
        base=base,
        control_logits=None if control is None else rowwise_matmul(features, control.weight),
        coefficients=torch.zeros_like(start_logits),
        scale=torch.ones(count, dtype=dtype),
        control_scale=torch.zeros(count, dtype=dtype),
        biases=bias.expand(count, -1).clone(),
    )
    for width, group in size_groups(sizes):
        _train_group(state, width, group, features, labels, offsets, clients, bias, sgd, seed, round_number, control,
                     steps)
    return TrainedHeads(weight, state.scale, state.coefficients, state.control_scale, state.biases, features, offsets,
                        losses, gradient, control, squares)


@dataclass
class _Steps:
    """What the groups' training reads (``base``: X W₀, ``control_logits``: X c) and writes (the rest)."""

    base: torch.Tensor
    control_logits: torch.Tensor | None
    coefficients: torch.Tensor
    scale: torch.Tensor
    control_scale: torch.Tensor
    biases: torch.Tensor


def _train_group(
    state: _Steps, width: int, group: np.ndarray, features: torch.Tensor, labels: torch.Tensor, offsets: np.ndarray,
    clients: np.ndarray, bias: torch.Tensor, sgd: LocalSGD, seed: int, round_number: int, control: Control | None,
    steps: np.ndarray | None,
) -> None:
    """All steps of the clients ``group`` (indices into ``clients``), padded to ``width`` samples.

    Slots are the group's clients ordered by number of steps (within their budgets ``steps``), largest first,
    so step ``t`` computes only the first ``active`` slots.
    """
    count, dtype = len(group), state.base.dtype
    sizes = np.diff(offsets)[group]
    plans = [budgeted(minibatches(int(sizes[i]), sgd.batch_size, sgd.epochs,
                                  client_rng(seed, round_number, int(clients[k]))),
                      None if steps is None else int(steps[k]))
             for i, k in enumerate(group)]
    order = np.argsort([-len(plan) for plan in plans], kind="stable")
    slot_client = group[order]

    padded_rows = torch.full((count, width), -1, dtype=torch.long)
    gram = torch.zeros(count, width, width, dtype=dtype)
    for slot, k in enumerate(slot_client):
        n = offsets[k + 1] - offsets[k]
        padded_rows[slot, :n] = torch.arange(offsets[k], offsets[k + 1])
        block = features[offsets[k] : offsets[k + 1]]
        gram[slot, :n, :n] = block @ block.T
    real = padded_rows >= 0
    rows = padded_rows.clamp(min=0)
    client_rows = None if control is None else control.rows[rows] * real[..., None]
    layout = _Layout([plans[i] for i in order], np.array([len(plans[i]) for i in order]), gram, rows, labels, client_rows,
                     min(sgd.batch_size, width))
    steps = _momentum_steps if sgd.momentum else _plain_steps
    coefficients, scale, control_scale, biases = steps(state, layout, bias, sgd, control)
    state.coefficients[padded_rows[real]] = coefficients[real]
    targets = torch.from_numpy(slot_client)
    state.scale[targets], state.control_scale[targets], state.biases[targets] = scale, control_scale, biases


@dataclass
class _Layout:
    """A group's slots: their mini-batch plans (most steps first), Gram matrices, rows (padded with row 0) and G rows."""

    plans: list[list[np.ndarray]]
    counts: np.ndarray
    """Steps of each slot (non-increasing)."""
    gram: torch.Tensor
    rows: torch.Tensor
    labels: torch.Tensor
    client_rows: torch.Tensor | None
    batch_width: int

    @property
    def steps(self) -> int:
        return int(self.counts[0])

    def batch(self, step: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(active slots, their slot numbers, batch positions in each slot, which are real samples, their rows)."""
        active = int((self.counts > step).sum())
        index = torch.full((active, self.batch_width), -1, dtype=torch.long)
        for slot in range(active):
            batch = self.plans[slot][step]
            index[slot, : len(batch)] = torch.from_numpy(batch)
        present = (index >= 0).to(self.gram.dtype)
        taken = index.clamp(min=0)
        slots = torch.arange(active)[:, None]
        return active, slots, taken, present, self.rows[slots, taken]

    def error(self, logits: torch.Tensor, batch_rows: torch.Tensor, present: torch.Tensor, temperature: float) -> torch.Tensor:
        """∂(mean cross-entropy of each slot's batch)/∂logits, zero on padding."""
        active = logits.shape[0]
        error = torch.softmax(logits / temperature, dim=-1)
        error.scatter_add_(2, self.labels[batch_rows][..., None], torch.full((active, self.batch_width, 1), -1.0, dtype=logits.dtype))
        error *= (present / (present.sum(1, keepdim=True) * temperature))[..., None]
        return error


def _plain_steps(state: _Steps, layout: _Layout, bias: torch.Tensor, sgd: LocalSGD,
                 control: Control | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGD without momentum; returns the slots' (A, β, γ, bias)."""
    count, width = layout.gram.shape[:2]
    num_classes, dtype = state.base.shape[1], state.base.dtype
    scale = torch.ones(count, dtype=dtype)
    # A = factor · scaled + drift · G: shrinking A each step rescales one number per client, not n × C of them.
    factor = torch.ones(count, dtype=dtype)
    scaled = torch.zeros(count, width, num_classes, dtype=dtype)
    drift = torch.zeros(count, dtype=dtype)
    control_scale = torch.zeros(count, dtype=dtype)
    biases = bias.expand(count, -1).clone()
    if control is not None:
        gram_rows = torch.bmm(layout.gram, layout.client_rows)
        bias_pull = control.bias - layout.client_rows.sum(dim=1)
    shrink = 1 - sgd.lr * (sgd.weight_decay + sgd.prox_mu)
    for step in range(layout.steps):
        active, slots, taken, present, batch_rows = layout.batch(step)
        logits = torch.baddbmm(torch.addcmul(biases[:active, None, :], scale[:active, None, None], state.base[batch_rows]),
                               factor[:active, None, None] * layout.gram[slots, taken], scaled[:active])
        if control is not None:
            logits += (drift[:active, None, None] * gram_rows[slots, taken]
                       + control_scale[:active, None, None] * state.control_logits[batch_rows])
        error = layout.error(logits, batch_rows, present, sgd.temperature)
        scale[:active] = shrink * scale[:active] + sgd.lr * sgd.prox_mu
        factor[:active] *= shrink
        step_update = -sgd.lr * error / factor[:active, None, None]
        scaled[:active].index_put_((slots.expand_as(taken), taken), step_update, accumulate=True)
        bias_gradient = error.sum(dim=1) + sgd.weight_decay * biases[:active] + sgd.prox_mu * (biases[:active] - bias)
        if control is not None:
            drift[:active] = shrink * drift[:active] + sgd.lr
            control_scale[:active] = shrink * control_scale[:active] - sgd.lr
            bias_gradient += bias_pull[:active]
        biases[:active] -= sgd.lr * bias_gradient

    coefficients = factor[:, None, None] * scaled
    if control is not None:
        coefficients += drift[:, None, None] * layout.client_rows
    return coefficients, scale, control_scale, biases


def _momentum_steps(state: _Steps, layout: _Layout, bias: torch.Tensor, sgd: LocalSGD,
                    control: Control | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGD with heavy-ball momentum μ as ``torch.optim.SGD`` (no dampening, not Nesterov); returns the slots' (A, β, γ, bias).

    The momentum buffer v is a gradient sum, so it keeps the dual form too:
    v = ν W₀ + Xᵀ V + δ c with scalars ν, δ and V (n × C). A step adds the
    gradient g = (s β − μ_prox) W₀ + Xᵀ(E + s A − G_i) + (s γ + 1) c, with
    s = weight decay + μ_prox and E the batch's error rows, then moves
    (β, A, γ) by −lr (ν, V, δ). A and V are updated densely (n × C per step,
    less than the step's b × n × C logits). Buffers start at zero.
    """
    count, width = layout.gram.shape[:2]
    num_classes, dtype = state.base.shape[1], state.base.dtype
    decay = sgd.weight_decay + sgd.prox_mu
    scale, scale_velocity = torch.ones(count, dtype=dtype), torch.zeros(count, dtype=dtype)
    coefficients, velocity = (torch.zeros(count, width, num_classes, dtype=dtype) for _ in range(2))
    control_scale, control_velocity = torch.zeros(count, dtype=dtype), torch.zeros(count, dtype=dtype)
    biases = bias.expand(count, -1).clone()
    bias_velocity = torch.zeros_like(biases)
    if control is not None:
        bias_pull = control.bias - layout.client_rows.sum(dim=1)
    for step in range(layout.steps):
        active, slots, taken, present, batch_rows = layout.batch(step)
        logits = torch.baddbmm(torch.addcmul(biases[:active, None, :], scale[:active, None, None], state.base[batch_rows]),
                               layout.gram[slots, taken], coefficients[:active])
        if control is not None:
            logits += control_scale[:active, None, None] * state.control_logits[batch_rows]
        error = layout.error(logits, batch_rows, present, sgd.temperature)
        bias_gradient = error.sum(dim=1) + sgd.weight_decay * biases[:active] + sgd.prox_mu * (biases[:active] - bias)
        scale_velocity[:active] = sgd.momentum * scale_velocity[:active] + decay * scale[:active] - sgd.prox_mu
        moving = velocity[:active]
        moving.mul_(sgd.momentum)
        if decay:
            moving.add_(coefficients[:active], alpha=decay)
        if control is not None:
            moving.sub_(layout.client_rows[:active])
            control_velocity[:active] = sgd.momentum * control_velocity[:active] + decay * control_scale[:active] + 1
            bias_gradient += bias_pull[:active]
        moving.index_put_((slots.expand_as(taken), taken), error, accumulate=True)
        bias_velocity[:active] = sgd.momentum * bias_velocity[:active] + bias_gradient
        scale[:active] -= sgd.lr * scale_velocity[:active]
        coefficients[:active].add_(moving, alpha=-sgd.lr)
        control_scale[:active] -= sgd.lr * control_velocity[:active]
        biases[:active] -= sgd.lr * bias_velocity[:active]
    return coefficients, scale, control_scale, biases
