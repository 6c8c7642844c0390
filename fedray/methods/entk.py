"""Empirical NTK features for TCT stage 2 (Yu et al., NeurIPS 2022).

After stage 1 (FedAvg) the network is linearized around its weights θ: a sample
``x`` is represented by ``∇_θ f_0(x; θ)``, the gradient with respect to *all*
parameters of the single output of the network whose last linear layer has
been replaced by a freshly initialized one-output layer, sub-sampled to ``p``
seeded coordinates.

This follows the authors' code rather than the letter of Algorithm 2 in the
paper. The code (``mnist/run_TCT.py``, ``mnist/utils.py``) replaces the last
layer ``fc2`` by ``nn.Linear(128, 1)`` and its ``compute_eNTK`` differentiates
that single output w.r.t. every parameter, the new head's included (P =
355,073: the network with the one-output head). Algorithm 2 writes the first
logit of a re-initialized C-output layer, differentiated w.r.t. the feature
extractor φ only. Differentiated w.r.t. all parameters, a C-output head would
give a gradient to that logit's row alone: (C − 1)(d + 1) of the P
coordinates would be zero for every sample and waste part of the ``p``
sampled ones. With the one-output head no coordinate is zero because of the
head; the head's own are the penultimate features h and a constant 1
(∂(wᵀh + b)/∂w = h, ∂/∂b = 1).

TCT's last-layer ablation (App. B.7, TCT-last-layer: "the representations
before the last layer") takes the gradient w.r.t. the head's weight only:
``head_coordinates`` are those d coordinates of the P, the penultimate features
h of each sample. The head's bias is left out: its gradient is the constant 1
that stage 2's intercept already is (standardized it would be 0, raw it would
duplicate the intercept's column).

``entk_features`` computes these per-sample gradients batched with
``torch.func`` (``vmap(grad(functional_call))``) in chunks of samples;
``entk_features_loop`` is the plain one-``autograd.grad``-per-sample reference
kept for tests and the benchmark.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import skip_init


@dataclass(frozen=True)
class EntkSpec:
    """What eNTK features a run takes: the one-output head initialized from ``seed``, the ``index`` coordinates,
    ``chunk_size`` samples per vmap, stored as ``dtype``."""

    seed: int
    index: torch.Tensor
    chunk_size: int = 32
    dtype: torch.dtype = torch.float32


def _last_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """The qualified name and module of ``model``'s last ``nn.Linear`` in module order (its head)."""
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linears:
        raise ValueError("model has no nn.Linear layer to re-initialize")
    return linears[-1]


def reinitialize_last_layer(model: nn.Module, seed: int) -> nn.Module:
    """A deep copy of ``model`` whose last ``nn.Linear`` (in module order) is replaced by a fresh one-output layer.

    The new layer is ``nn.Linear(in_features, 1)`` (with a bias iff the old one
    had one), on the old layer's device and dtype, so the copy's single output
    is the scalar whose gradient ``entk_features`` takes (see the module
    docstring). Its initialization is ``nn.Linear.reset_parameters``'
    (Kaiming-uniform weight, uniform bias in ±1/√in_features) drawn from a CPU
    ``torch.Generator`` seeded by ``seed`` and then copied to the layer's device
    and dtype, so the same seed gives the same layer on any device; the global
    RNG is not touched. ``model`` itself is not modified.
    """
    clone = copy.deepcopy(model)
    name, old = _last_linear(clone)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.empty(1, old.in_features)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
    head = skip_init(nn.Linear, old.in_features, 1, bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
        if head.bias is not None:
            bound = 1 / math.sqrt(old.in_features) if old.in_features > 0 else 0.0
            head.bias.copy_(torch.empty(1).uniform_(-bound, bound, generator=generator))
    parent, _, attribute = name.rpartition(".")
    setattr(clone.get_submodule(parent), attribute, head)
    return clone


def num_parameters(model: nn.Module) -> int:
    """Number of scalar parameters, i.e. the length of the flattened gradient ``entk_features`` indexes."""
    return sum(p.numel() for p in model.parameters())


def entk_num_parameters(model: nn.Module) -> int:
    """P, the number of eNTK coordinates of ``model``: ``num_parameters(reinitialize_last_layer(model, ·))``, without the copy.

    The model's parameters with its last linear layer's C × d weight and C
    biases counted as the one-output head's d weights and 1 bias. This is what
    ``coordinate_index`` draws the ``p`` coordinates from.
    """
    _, head = _last_linear(model)
    one_output = head.in_features + (1 if head.bias is not None else 0)
    return num_parameters(model) - sum(p.numel() for p in head.parameters()) + one_output


def head_coordinates(model: nn.Module) -> range:
    """The d coordinates of the one-output head's weight in the flattened gradient of ``reinitialize_last_layer(model)``.

    ``named_parameters`` order, with the last linear layer's parameters counted
    at their one-output sizes (d weights, 1 bias), as ``entk_num_parameters``
    counts them: the eNTK features at these coordinates are the penultimate
    features h (∂(wᵀh + b)/∂w = h).
    """
    name, head = _last_linear(model)
    start = 0
    for parameter_name, parameter in model.named_parameters():
        if parameter_name == f"{name}.weight":
            return range(start, start + head.in_features)
        start += 1 if parameter_name == f"{name}.bias" else parameter.numel()
    raise ValueError(f"the last linear layer {name!r} has no weight among the model's parameters")


def sample_coordinates(coordinates: range, p: int, seed: int) -> torch.Tensor:
    """``p`` of the consecutive ``coordinates`` drawn by ``coordinate_index`` (all of them when p ≥ their number),
    shifted to where they start: ``range(P)`` gives ``coordinate_index(P, p, seed)`` itself."""
    return coordinates.start + coordinate_index(len(coordinates), p, seed)


def coordinate_index(num_params: int, p: int, seed: int) -> torch.Tensor:
    """Sorted int64 indices of ``p`` coordinates drawn without replacement (seeded) from ``num_params``.

    All coordinates, in order, when ``num_params <= p``.
    """
    if num_params < 1 or p < 1:
        raise ValueError(f"num_params and p must be positive, got {num_params} and {p}")
    if num_params <= p:
        return torch.arange(num_params)
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_params, generator=generator)[:p].sort().values


def _split_index(model: nn.Module, index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per parameter name (``named_parameters`` order), the positions of ``index`` inside that parameter.

    Parameters with no selected coordinate are left out. Concatenating
    ``grad[name].flatten()[local]`` over the result reproduces
    ``flat_grad[index]`` because ``index`` is sorted.
    """
    if index.ndim != 1 or index.dtype != torch.int64:
        raise ValueError("index must be a 1-D int64 tensor")
    if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
        raise ValueError("index must be strictly increasing (see coordinate_index)")
    total = num_parameters(model)
    if index.numel() and (int(index[0]) < 0 or int(index[-1]) >= total):
        raise ValueError(f"index out of range for a model with {total} parameters")
    index = index.cpu()
    local: dict[str, torch.Tensor] = {}
    start = 0
    for name, param in model.named_parameters():
        stop = start + param.numel()
        lo, hi = torch.searchsorted(index, torch.tensor([start, stop])).tolist()
        if hi > lo:
            local[name] = (index[lo:hi] - start).to(param.device)
        start = stop
    return local


def _select(grads: dict[str, torch.Tensor], local: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rows of selected coordinates from per-sample gradients (each ``grads[name]`` is samples × param shape).

    ``index_select`` per parameter: several times faster than advanced indexing on
    CPU, and it never builds the samples × num_params concatenation.
    """
    return torch.cat(
        [torch.index_select(grads[name].flatten(1), 1, positions) for name, positions in local.items()], dim=1
    )


def _chunks(count: int, chunk_size: int) -> Iterator[slice]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    for first in range(0, count, chunk_size):
        yield slice(first, min(first + chunk_size, count))


class _EvalMode:
    """Eval mode for the block (optionally with every parameter requiring grad); restores the flags on exit."""

    def __init__(self, model: nn.Module, require_grad: bool = False) -> None:
        self.model = model
        self.require_grad = require_grad
        self.training = [(m, m.training) for m in model.modules()]
        self.requires_grad = [(p, p.requires_grad) for p in model.parameters()]

    def __enter__(self) -> nn.Module:
        if self.require_grad:
            for param, _ in self.requires_grad:
                param.requires_grad_(True)
        return self.model.eval()

    def __exit__(self, *exc: object) -> None:
        for module, training in self.training:
            module.training = training
        for param, flag in self.requires_grad:
            param.requires_grad_(flag)


def entk_features(
    model: nn.Module,
    inputs: torch.Tensor,
    index: torch.Tensor,
    logit: int = 0,
    chunk_size: int = 64,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """eNTK features ``∇_θ f_logit(x)[index]`` of every row of ``inputs`` (N × len(index), ``dtype``).

    ``model`` is normally ``reinitialize_last_layer(trained, seed)``, whose only
    output is ``logit`` 0. Gradients are taken w.r.t. all parameters (frozen ones included) in
    ``named_parameters`` order; ``index`` must be sorted (``coordinate_index``).
    Per-sample gradients are computed with ``vmap(grad(...))`` over
    ``chunk_size`` samples at a time, which bounds peak memory to about
    ``chunk_size`` full gradients. The model runs in eval mode (its flags are
    restored afterwards): BatchNorm uses its running statistics, so each
    sample's features do not depend on the rest of its batch, and dropout is
    off. Buffers go through ``functional_call`` unchanged. The gradient is
    computed in the model's precision and only stored as ``dtype`` (e.g.
    ``torch.float16`` halves the storage). The result is on ``inputs.device``.
    """
    local = _split_index(model, index)
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}
    selected = {name: params[name] for name in local}
    constant = {name: p for name, p in params.items() if name not in local}

    def one_logit(chosen: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, ({**constant, **chosen}, buffers), (x.unsqueeze(0),))
        return out[0, logit]

    per_sample = vmap(grad(one_logit), in_dims=(None, 0))
    features = torch.empty(inputs.shape[0], index.numel(), dtype=dtype, device=inputs.device)
    with _EvalMode(model), torch.enable_grad():
        for rows in _chunks(inputs.shape[0], chunk_size):
            features[rows] = _select(per_sample(selected, inputs[rows]), local).to(dtype)
    return features


def entk_features_loop(
    model: nn.Module,
    inputs: torch.Tensor,
    index: torch.Tensor,
    logit: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reference for ``entk_features``: one ``torch.autograd.grad`` per sample, for tests and the benchmark only.

    Same contract and result as ``entk_features``, without the chunking; it calls
    the model itself (all parameters temporarily requiring grad, eval mode, flags
    restored afterwards) rather than ``functional_call``, so it pays no extra
    per-sample overhead.
    """
    local = _split_index(model, index)
    params = dict(model.named_parameters())
    features = torch.empty(inputs.shape[0], index.numel(), dtype=dtype, device=inputs.device)
    with _EvalMode(model, require_grad=True), torch.enable_grad():
        for row in range(inputs.shape[0]):
            out = model(inputs[row : row + 1])
            grads = torch.autograd.grad(out[0, logit], [params[name] for name in local], allow_unused=True)
            per_param = {
                name: (g if g is not None else torch.zeros_like(params[name])).unsqueeze(0)
                for name, g in zip(local, grads)
            }
            features[row] = _select(per_param, local)[0].to(dtype)
    return features
