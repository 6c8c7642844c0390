"""Direct, loop-based implementations of the methods, written from the papers' formulas.

They share no code with fedray's methods: tests compare the two. (The gradient references take only the
mini-batch order from fedray, so that both see the same samples at each step.)
"""

from collections.abc import Callable

import numpy as np
import torch

from fedray.core.federation import Federation
from fedray.methods.training.local import LocalSGD, client_rng, minibatches
from fedray.methods.base import Classifier


def features_and_labels(federation):
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    z = federation.source.features("train", sample_ids).to(torch.float64)
    return z, torch.from_numpy(labels.astype(np.int64)), offsets


def normalized(w):
    norms = w.norm(dim=0)
    norms[norms == 0] = 1
    return w / norms


def ridge(z, labels, num_classes, lam, normalize=True):
    y = torch.nn.functional.one_hot(labels, num_classes).to(torch.float64)
    w = torch.linalg.solve(z.T @ z + lam * torch.eye(z.shape[1], dtype=torch.float64), z.T @ y)
    return normalized(w) if normalize else w


def ridge_with_bias(z, labels, num_classes, lam, normalize=True):
    """Fed3R's bias as its authors' code computes it (``fed3r_step``, ``calc_ridge_params``, ``normalize_W`` in
    Erosinho13/Fed3R ``src/fed3r.py``): A = λI over the d + 1 dimensions of [z, 1], b = Σ [z, 1]ᵀ onehot(y),
    [W; bias] = A⁻¹b, then W and bias both divided by the norms of W's columns alone."""
    design = torch.cat([z, torch.ones(len(z), 1, dtype=torch.float64)], 1)
    a = lam * torch.eye(design.shape[1], dtype=torch.float64) + design.T @ design
    b = design.T @ torch.nn.functional.one_hot(labels, num_classes).to(torch.float64)
    solution = torch.linalg.solve(a, b)
    w, bias = solution[:-1], solution[-1]
    if not normalize:
        return w, bias
    norms = w.norm(dim=0)
    norms[norms == 0] = 1
    return w / norms, bias / norms


def class_means(z, labels, num_classes):
    means = torch.zeros(num_classes, z.shape[1], dtype=torch.float64)
    for c in range(num_classes):
        if (labels == c).any():
            means[c] = z[labels == c].mean(0)
    return means


def fedcof_algorithm1(z, labels, offsets, num_classes, gamma):
    """FedCOF Algorithm 1, one client at a time, one d×d covariance per class."""
    d = z.shape[1]
    client_means = {c: [] for c in range(num_classes)}
    for k in range(len(offsets) - 1):
        zk, yk = z[offsets[k] : offsets[k + 1]], labels[offsets[k] : offsets[k + 1]]
        for c in yk.unique().tolist():
            client_means[c].append((int((yk == c).sum()), zk[yk == c].mean(0)))
    gram = torch.zeros(d, d, dtype=torch.float64)
    b = torch.zeros(d, num_classes, dtype=torch.float64)
    total, total_sum = 0, torch.zeros(d, dtype=torch.float64)
    for c, received in client_means.items():
        if not received:
            continue
        n_c = sum(n for n, _ in received)
        mu_c = sum(n * m for n, m in received) / n_c
        if len(received) > 1:
            cov = sum(n * torch.outer(m - mu_c, m - mu_c) for n, m in received) / (len(received) - 1)
        else:
            cov = torch.zeros(d, d, dtype=torch.float64)
        cov = cov + gamma * torch.eye(d, dtype=torch.float64)
        gram += (n_c - 1) * cov
        b[:, c] = n_c * mu_c
        total += n_c
        total_sum += n_c * mu_c
    mu_g = total_sum / total
    gram += total * torch.outer(mu_g, mu_g)
    return normalized(torch.linalg.solve(gram, b))


def fedcof_oracle(z, labels, num_classes, gamma):
    """FedCOF with the true class covariances in place of the estimated ones."""
    d = z.shape[1]
    gram = torch.zeros(d, d, dtype=torch.float64)
    b = torch.zeros(d, num_classes, dtype=torch.float64)
    for c in range(num_classes):
        zc = z[labels == c]
        if len(zc) == 0:
            continue
        centered = zc - zc.mean(0)
        gram += centered.T @ centered + (len(zc) - 1) * gamma * torch.eye(d, dtype=torch.float64)
        b[:, c] = zc.sum(0)
    mu_g = z.mean(0)
    gram += len(z) * torch.outer(mu_g, mu_g)
    return normalized(torch.linalg.solve(gram, b))


def max_relative_difference(a, b):
    return float((a - b).abs().max() / b.abs().max())


def train_client_plainly(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, sgd: LocalSGD, batches: list[np.ndarray],
    correction: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One client, written plainly: nn.Linear, cross-entropy, torch.optim.SGD, one mini-batch at a time.

    ``correction`` (SCAFFOLD's c − c_i for weight and bias) is added to every gradient.
    """
    head = torch.nn.Linear(weight.shape[0], weight.shape[1], dtype=weight.dtype)
    with torch.no_grad():
        head.weight.copy_(weight.T)
        head.bias.copy_(bias)
    optimizer = torch.optim.SGD(head.parameters(), lr=sgd.lr, weight_decay=sgd.weight_decay, momentum=sgd.momentum)
    for batch in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(x[batch]) / sgd.temperature, y[batch])
        if sgd.prox_mu:
            loss = loss + sgd.prox_mu / 2 * (((head.weight - weight.T) ** 2).sum() + ((head.bias - bias) ** 2).sum())
        if correction is not None:
            loss = loss + (head.weight * correction[0].T).sum() + (head.bias * correction[1]).sum()
        loss.backward()
        optimizer.step()
    return head.weight.detach().T, head.bias.detach()


def client_gradient(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of a client's mean cross-entropy at (weight, bias), by autograd: SCAFFOLD's c_i (option I)."""
    weight, bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    torch.nn.functional.cross_entropy((x @ weight + bias) / temperature, y).backward()
    return weight.grad, bias.grad


def fedavg_by_autograd(
    federation: Federation, rounds: list[np.ndarray], sgd: LocalSGD, seed: int, head: Classifier, server_lr: float,
    scaffold: bool = False, server: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Classifier:
    """FedAvg (or SCAFFOLD with a dense c_i per client) written plainly over all clients' features in one process,
    each client by :func:`train_client_plainly`; the server steps by ``server_lr`` along Δ, or along ``server(name, Δ)``
    (``name`` weight or bias): an adaptive server optimizer written out by a test."""
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    features = federation.require_features().features("train", sample_ids)
    labels = torch.from_numpy(labels.astype(np.int64))
    weight, bias = head.weight.clone(), head.bias.clone()
    control = (torch.zeros_like(weight), torch.zeros_like(bias))
    client_controls: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for number, clients in enumerate(rounds, start=1):
        total_w, total_b, total_n = torch.zeros_like(weight), torch.zeros_like(bias), 0
        control_w, control_b = torch.zeros_like(weight), torch.zeros_like(bias)
        for client in clients:
            rows = slice(offsets[client], offsets[client + 1])
            size = int(offsets[client + 1] - offsets[client])
            batches = minibatches(size, sgd.batch_size, sgd.epochs, client_rng(seed, number, int(client)))
            correction = None
            if scaffold:
                own = client_controls.get(int(client), (torch.zeros_like(weight), torch.zeros_like(bias)))
                correction = (control[0] - own[0], control[1] - own[1])
                new = client_gradient(features[rows], labels[rows], weight, bias, sgd.temperature)
                control_w += size * (new[0] - own[0])
                control_b += size * (new[1] - own[1])
                client_controls[int(client)] = new
            trained_w, trained_b = train_client_plainly(features[rows], labels[rows], weight, bias, sgd, batches, correction)
            total_w += size * (trained_w - weight)
            total_b += size * (trained_b - bias)
            total_n += size
        if server is None:
            weight += server_lr * total_w / total_n
            bias += server_lr * total_b / total_n
        else:
            weight += server_lr * server("weight", total_w / total_n)
            bias += server_lr * server("bias", total_b / total_n)
        control = (control[0] + control_w / len(labels), control[1] + control_b / len(labels))
    return Classifier(weight, bias)
