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
computes only the clients that still have mini-batches. The summed update of
all clients, Σ n_k (W_k − W₀), is one more GEMM over their concatenated
samples. The result equals training each client alone with
``torch.optim.SGD`` on the same mini-batches (tested to float64 round-off).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LocalSGD:
    """Client optimizer; defaults are Fed3R Appendix C's (lr 0.1, weight decay 4e-5, batch 50, 5 epochs).

    ``prox_mu`` > 0 adds FedProx's (μ/2)‖θ − θ_global‖² (weights and bias);
    logits are divided by ``temperature`` (a closed-form initialization wants 0.1).
    """

    lr: float = 0.1
    weight_decay: float = 4e-5
    batch_size: int = 50
    epochs: int = 5
    prox_mu: float = 0.0
    temperature: float = 1.0


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

    Clients are in the order they were given; ``coefficients`` is padded to
    the largest client, ``real`` (clients, width) marks the rows that are
    samples, and ``features`` holds those samples, client after client.
    ``start_loss`` is the cross-entropy of the starting head summed over those
    samples; ``gradient_rows`` is G of each sample at the starting head (the
    new SCAFFOLD control variates), ``control`` the one trained with (or None).
    """

    weight: torch.Tensor
    scale: torch.Tensor
    coefficients: torch.Tensor
    control_scale: torch.Tensor
    bias: torch.Tensor
    features: torch.Tensor
    real: torch.Tensor
    start_loss: float
    gradient_rows: torch.Tensor
    control: Control | None

    @property
    def sizes(self) -> torch.Tensor:
        return self.real.sum(dim=1)

    def weights(self) -> torch.Tensor:
        """The heads themselves, (clients, d, C); for checks — aggregation never forms them."""
        padded = torch.zeros(*self.real.shape, self.features.shape[1], dtype=self.features.dtype)
        padded[self.real] = self.features
        heads = self.scale[:, None, None] * self.weight + torch.bmm(padded.transpose(1, 2), self.coefficients)
        if self.control is not None:
            heads += self.control_scale[:, None, None] * self.control.weight
        return heads

    def weighted_update(self, global_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Σ n_k (W_k − W₀), Σ n_k (c_k − b₀), Σ n_k): what a shard sends for FedAvg-style aggregation."""
        n = self.sizes.to(self.weight.dtype)
        a = (n[:, None, None] * self.coefficients)[self.real]
        delta_w = (n * (self.scale - 1)).sum() * self.weight + self.features.T @ a
        if self.control is not None:
            delta_w += (n * self.control_scale).sum() * self.control.weight
        delta_b = (n[:, None] * (self.bias - global_bias)).sum(dim=0)
        return delta_w, delta_b, n.sum()

    def control_update(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ n_k (c_k⁺ − c_k) for the weights, the same for the bias): SCAFFOLD's server-side sum."""
        n = self.sizes.to(self.weight.dtype)
        change = torch.repeat_interleave(n, n.long())[:, None] * (self.gradient_rows - self.control.rows)
        return self.features.T @ change, change.sum(dim=0)


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
) -> TrainedHeads:
    """Train every client's head from (``weight`` (d, C), ``bias`` (C,)) on its own samples.

    ``features`` / ``labels`` hold the clients' samples concatenated in the
    order of ``clients`` (client ``k`` owns rows ``offsets[k]:offsets[k+1]``).
    With ``control`` every step follows SCAFFOLD's g + c − c_i.
    """
    count, num_classes, dtype = len(clients), weight.shape[1], weight.dtype
    sizes = np.diff(offsets)
    width = int(sizes.max())
    plans = [minibatches(int(sizes[k]), sgd.batch_size, sgd.epochs, client_rng(seed, round_number, int(c)))
             for k, c in enumerate(clients)]
    order = np.argsort([-len(plan) for plan in plans], kind="stable")
    steps = np.array([len(plans[k]) for k in order])

    padded_rows = torch.full((count, width), -1, dtype=torch.long)
    for slot, k in enumerate(order):
        padded_rows[slot, : sizes[k]] = torch.arange(offsets[k], offsets[k + 1])
    real = padded_rows >= 0
    samples = features[padded_rows[real]]
    y = labels[padded_rows.clamp(min=0)]
    base_logits = torch.zeros(count, width, num_classes, dtype=dtype)
    base_logits[real] = samples @ weight
    gram = torch.zeros(count, width, width, dtype=dtype)
    for slot, k in enumerate(order):
        block = features[offsets[k] : offsets[k + 1]]
        gram[slot, : sizes[k], : sizes[k]] = block @ block.T

    start_logits = (base_logits[real] + bias) / sgd.temperature
    start_loss = float(torch.nn.functional.cross_entropy(start_logits, y[real], reduction="sum"))
    slot_sizes = torch.from_numpy(sizes[order]).to(dtype)
    gradient = torch.softmax(start_logits, dim=-1)
    gradient[torch.arange(len(gradient)), y[real]] -= 1
    gradient /= (torch.repeat_interleave(slot_sizes, slot_sizes.long()) * sgd.temperature)[:, None]

    scale = torch.ones(count, dtype=dtype)
    # A = factor · scaled + drift · G: shrinking A each step rescales one number per client, not n × C of them.
    factor = torch.ones(count, dtype=dtype)
    scaled = torch.zeros(count, width, num_classes, dtype=dtype)
    drift = torch.zeros(count, dtype=dtype)
    control_scale = torch.zeros(count, dtype=dtype)
    biases = bias.expand(count, -1).clone()
    if control is not None:
        client_rows = torch.zeros(count, width, num_classes, dtype=dtype)
        client_rows[real] = control.rows[padded_rows[real]]
        gram_rows = torch.bmm(gram, client_rows)
        control_logits = torch.zeros(count, width, num_classes, dtype=dtype)
        control_logits[real] = samples @ control.weight
        bias_pull = control.bias - client_rows.sum(dim=1)
    shrink = 1 - sgd.lr * (sgd.weight_decay + sgd.prox_mu)
    batch_width = min(sgd.batch_size, width)
    for step in range(int(steps[0])):
        active = int((steps > step).sum())
        index = torch.full((active, batch_width), -1, dtype=torch.long)
        for slot in range(active):
            batch = plans[order[slot]][step]
            index[slot, : len(batch)] = torch.from_numpy(batch)
        present = (index >= 0).to(dtype)
        taken = index.clamp(min=0)
        slots = torch.arange(active)[:, None]
        logits = (scale[:active, None, None] * base_logits[slots, taken]
                  + factor[:active, None, None] * torch.bmm(gram[slots, taken], scaled[:active])
                  + biases[:active, None, :])
        if control is not None:
            logits += (drift[:active, None, None] * gram_rows[slots, taken]
                       + control_scale[:active, None, None] * control_logits[slots, taken])
        one_hot = torch.nn.functional.one_hot(y[slots, taken], num_classes).to(dtype)
        error = (torch.softmax(logits / sgd.temperature, dim=-1) - one_hot) * (present / (present.sum(1, keepdim=True) * sgd.temperature))[..., None]
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

    back = torch.from_numpy(np.argsort(order))
    coefficients = factor[:, None, None] * scaled
    if control is not None:
        coefficients += drift[:, None, None] * client_rows
    unsorted_rows = torch.empty_like(gradient)
    unsorted_rows[padded_rows[real] - 0] = gradient
    return TrainedHeads(weight, scale[back], coefficients[back], control_scale[back], biases[back], features, real[back],
                        start_loss, unsorted_rows, control)
