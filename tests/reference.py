"""Direct, loop-based implementations of the methods, written from the papers' formulas.

They share no code with fedray's methods: tests compare the two.
"""

import numpy as np
import torch


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
