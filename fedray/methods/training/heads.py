"""A shard's clients trained on its features: linear heads by the dual form when the algorithm takes it, else by autograd.

The dual form (:func:`~fedray.methods.training.local.train_heads`) trains many
clients' heads at once for the algorithms whose client half it knows
(:func:`~fedray.methods.training.dual_form.dual_form`: the built-in FedAvg's,
FedProx's, SCAFFOLD's with option I) and sums their updates in one GEMM. Any
other algorithm, and every model that is not a linear head (SphereFed's
projection), trains each client by autograd with
:func:`~fedray.methods.training.client_sgd.train_client`, on the same mini-batches;
the two agree to float64 round-off (``tests/methods/test_client_sgd.py``).
Either way the shard returns the sums of its clients' uploads, one per part
of its clients (``parts``: the leaves of the fixed tree, see
:mod:`fedray.runtime.fixed_tree`), each over the part's clients in id order
and in bits that depend on those clients alone, and their states stay in the
shard (``states``, see :mod:`fedray.runtime.client_states`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch

from fedray.methods.training.backend import ClientLosses, RoundUpdate
from fedray.methods.training.budgets import budgeted
from fedray.methods.training.client_sgd import (CrossEntropy, add_upload, client_batches, loss_squares, start_client,
                                                 start_loss, train_client)
from fedray.methods.training.local import Control, LocalSGD, TrainedHeads, train_heads
from fedray.methods.algorithm import FederatedAlgorithm, Loss, Params, Upload
from fedray.methods.training.dual_form import dual_form
from fedray.methods.training_algorithms import CONTROL
from fedray.methods.base import ClientBatch
from fedray.methods.postprocessor import Postprocessing

ROWS = CONTROL + "rows"
"""The dual form's SCAFFOLD state of a client: the gradient rows G of its samples, c_i = XᵀG (n_i × C floats)."""


class States(Protocol):
    """Where the clients' states are (the shard's :class:`~fedray.runtime.client_states.ClientStates`)."""

    def get(self, client: int) -> Params | None: ...

    def put(self, client: int, state: Params | None) -> None: ...


Forward = Callable[[Params, torch.Tensor], torch.Tensor]
"""A model's output on some features, from its parameters."""

Parts = np.ndarray
"""Cuts into a batch's clients: part ``j`` is clients ``cuts[j] .. cuts[j + 1] − 1`` (None: the batch is one part)."""


def _parts(batch: ClientBatch, parts: Parts | None) -> list[slice]:
    cuts = np.array([0, len(batch.clients)]) if parts is None else parts
    return [slice(int(first), int(end)) for first, end in zip(cuts[:-1], cuts[1:])]


def linear(params: Params, features: torch.Tensor) -> torch.Tensor:
    return torch.addmm(params["bias"], features, params["weight"])


def train_features(batch: ClientBatch, params: Params, broadcast: Params, sgd: LocalSGD, algorithm: FederatedAlgorithm,
                   seed: int, round_number: int, states: States, forward: Forward, path_loss: Loss,
                   postprocessing: Postprocessing = Postprocessing(), steps: np.ndarray | None = None,
                   client_losses: bool = False, parts: Parts | None = None) -> list[RoundUpdate | None]:
    """Every client of ``batch`` trained by autograd from ``params``, one after another; their uploads, each through
    the postprocessors' client hooks, summed in their order, one sum per part of them (``parts``; None where a part
    has no client). ``steps[k]``: the most local steps client ``k`` takes (None: all of them; see
    :func:`train_linear_heads`); ``client_losses``: measure each client's squared losses at ``params``."""
    sgd = sgd.for_round(round_number)
    squares = np.zeros(len(batch.clients)) if client_losses else None
    updates: list[RoundUpdate | None] = []
    for part in _parts(batch, parts):
        sums, weight, loss_sum = None, 0.0, 0.0
        for k in range(part.start, part.stop):
            client = int(batch.clients[k])
            rows = slice(batch.offsets[k], batch.offsets[k + 1])
            x, y = batch.features[rows], batch.labels[rows]
            loss, gradient = start_loss(path_loss, lambda at: forward(at, x), y, params, algorithm.needs_start_gradient)
            loss_sum += len(y) * loss
            if squares is not None:
                squares[k] = loss_squares(path_loss, forward(params, x), y)
            budget = None if steps is None else int(steps[k])
            batches = budgeted(client_batches(len(y), sgd, seed, round_number, client), budget)
            round_ = start_client(algorithm, client, round_number, len(y), batches, sgd, params, broadcast,
                                  states.get(client), path_loss, gradient)
            trained = {name: value.clone().requires_grad_() for name, value in params.items()}
            upload, state = train_client(algorithm, round_, trained, lambda p, step: forward(p, x[step]), y, batches,
                                         sgd)
            upload = postprocessing.client(upload, client, round_number)
            sums = add_upload(sums, upload, algorithm, weighted=not postprocessing.exact)
            weight += upload.weight
            states.put(client, state)
        updates.append(None if sums is None else RoundUpdate(
            sums, weight, part.stop - part.start, loss_sum, int(batch.offsets[part.stop] - batch.offsets[part.start]),
            client_losses=_losses(batch, squares, part)))
    return updates


def _losses(batch: ClientBatch, squares: np.ndarray | None, part: slice) -> ClientLosses | None:
    """The squared losses measured of the clients ``part`` of ``batch`` (None: not measured)."""
    return None if squares is None else ClientLosses(batch.clients[part].astype(np.int64), squares[part])


def train_linear_heads(batch: ClientBatch, params: Params, broadcast: Params, sgd: LocalSGD,
                       algorithm: FederatedAlgorithm, seed: int, round_number: int, states: States,
                       postprocessing: Postprocessing = Postprocessing(),
                       steps: np.ndarray | None = None, client_losses: bool = False,
                       parts: Parts | None = None) -> list[RoundUpdate | None]:
    """Every client's softmax head (x ↦ x W + b at ``sgd``'s temperature), by the dual form when the algorithm takes
    it, else by autograd. A postprocessor that sees each upload gets each client's update formed from the dual form;
    the batched sums stand unless it changed one.

    ``steps[k]`` (≥ 1; None: no budget) is the most local SGD steps client ``k`` takes: a straggler's partial work
    (:mod:`~fedray.methods.training.budgets`). Such a client uploads the model it has after the first ``steps[k]``
    of its mini-batches, and what its algorithm reports is computed for the steps it took: ``local_steps`` (FedNova's
    τ_k, SCAFFOLD option II's c_i⁺ = c_i − c + (θ⁰ − θ_i)/(τ_i η)) counts them. Its upload keeps the weight its
    algorithm gives it, FedAvg's n_k (its samples, not the samples its steps processed: the usual choice, which
    FedNova's p_k = n_k / n shares); SCAFFOLD option I's c_i⁺ is the gradient at the model received, whatever the
    steps taken. The round's loss is still the starting model's over all its samples, and so are the squared losses
    each client's ``client_losses`` sums (measured only when asked).

    The uploads are summed per part of the clients (``parts``, None: one), each in the clients' order, the part's
    sums (None where it has no client) in bits that depend on its clients alone."""
    dual = dual_form(algorithm)
    if dual is None:
        return train_features(batch, params, broadcast, sgd, algorithm, seed, round_number, states, linear,
                              CrossEntropy(sgd.temperature), postprocessing, steps, client_losses, parts)
    weight, bias = params["weight"], params["bias"]
    control = None
    if dual.control:
        num_classes = weight.shape[1]
        own = [states.get(client) for client in batch.clients.tolist()]
        rows = [torch.zeros(int(n), num_classes, dtype=weight.dtype) if state is None else state[ROWS]
                for state, n in zip(own, np.diff(batch.offsets))]
        control = Control(broadcast[CONTROL + "weight"], broadcast[CONTROL + "bias"], torch.cat(rows))
    sgd = replace(sgd, prox_mu=dual.prox_mu)
    heads = train_heads(batch.features, batch.labels, batch.offsets, batch.clients, weight, bias, sgd, seed, round_number,
                        control, steps, client_losses)
    squares = None if heads.loss_squares is None else heads.loss_squares.numpy()
    if control is not None:
        for k, client in enumerate(batch.clients.tolist()):
            states.put(client, {ROWS: heads.gradient_rows[batch.offsets[k]:batch.offsets[k + 1]].clone()})
    updates: list[RoundUpdate | None] = []
    for part in _parts(batch, parts):
        if part.stop == part.start:
            updates.append(None)
            continue
        processed = _postprocessed(heads, batch, bias, algorithm, round_number, postprocessing, part)
        if processed is not None:
            sums, total_weight = processed
        else:
            delta_weight, delta_bias, count = heads.weighted_update(bias, part)
            sums, total_weight = {"weight": delta_weight, "bias": delta_bias}, float(count)
            if control is not None:
                sums[CONTROL + "weight"], sums[CONTROL + "bias"] = heads.control_update(part)
        updates.append(RoundUpdate(sums, total_weight, part.stop - part.start, heads.start_loss(part),
                                   int(batch.offsets[part.stop] - batch.offsets[part.start]),
                                   client_losses=_losses(batch, squares, part)))
    return updates


def _postprocessed(heads: TrainedHeads, batch: ClientBatch, bias: torch.Tensor, algorithm: FederatedAlgorithm,
                   round_number: int, postprocessing: Postprocessing, part: slice) -> tuple[Params, float] | None:
    """The dual form's uploads of the clients ``part``, client by client, through the postprocessors' client hooks and
    summed in client order (sums, weight); None when there is no such hook or it changed no upload: the batched sums
    stand."""
    if not postprocessing.per_client:
        return None
    sums, weight, changed = None, 0.0, False
    for k in range(part.start, part.stop):
        client = int(batch.clients[k])
        tensors = dict(zip(("weight", "bias"), heads.client_update(k, bias)))
        if heads.control is not None:
            tensors[CONTROL + "weight"], tensors[CONTROL + "bias"] = heads.client_control_change(k)
        upload = Upload(tensors, float(batch.offsets[k + 1] - batch.offsets[k]))
        processed = postprocessing.client(upload, client, round_number)
        changed = changed or processed is not upload
        sums = add_upload(sums, processed, algorithm, weighted=not postprocessing.exact)
        weight += processed.weight
    return (sums, weight) if changed else None
