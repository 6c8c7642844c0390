"""The federated training loop: rounds of local training, server steps, evaluation points, checkpoints.

Everything a run needs to continue lives in :class:`TrainingState` (the
global parameters, the server optimizer's and the backend's state, the
counters behind the metrics), so a checkpoint written after round r and
resumed gives bitwise the rows and weights of a run that never stopped:
the schedule and every client's mini-batches depend only on the seed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from fedray.accounting import PaperCosts, PaperTotals
from fedray.gradient.backend import Params, TrainingBackend
from fedray.gradient.server import ServerOptimizer
from fedray.methods.base import FLOAT_BYTES
from fedray.results import EvalPoint
from fedray.runtime.simulation import eval_rounds


@dataclass
class Accounting:
    """Cumulative traffic, compute and coverage behind the metrics columns (both stages of a run)."""

    seen: np.ndarray
    samples_seen: int = 0
    bytes_up: float = 0.0
    bytes_down: float = 0.0
    flops: float = 0.0
    paper: PaperTotals = field(default_factory=PaperTotals)

    def add(self, clients: np.ndarray, sizes: np.ndarray, up: float, down: float, flops: float,
            paper: PaperCosts | None = None, backbone_macs: float | None = None) -> None:
        """One computation of each of ``clients``; ``paper`` its papers' costs (None: undefined, those columns go null)."""
        new = clients[~self.seen[clients]]
        self.seen[new] = True
        self.samples_seen += int(sizes[new].sum())
        self.bytes_up += up
        self.bytes_down += down
        self.flops += flops
        self.paper.add(paper, clients, backbone_macs)

    def point(self, round_number: int, accuracy: float, wall_s: float, stage: str, loss: float | None = None,
              diverged: bool = False) -> EvalPoint:
        clients = int(self.seen.sum())
        return EvalPoint(round_number, clients, self.samples_seen, accuracy, self.bytes_up, self.bytes_down,
                         self.flops / max(clients, 1), wall_s, stage, loss, diverged, **self.paper.columns(len(self.seen)))


@dataclass
class TrainingState:
    """All a run needs to continue after ``done`` training rounds."""

    params: Params
    server: dict
    backend: dict
    accounting: Accounting
    points: list[EvalPoint] = field(default_factory=list)
    done: int = 0
    loss_sum: float = 0.0
    loss_samples: int = 0
    wall_s: float = 0.0
    eval_s: float = 0.0


@dataclass
class Checkpointing:
    every: int | None
    save: Callable[[TrainingState], None]


def _finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


def train(
    backend: TrainingBackend,
    server: ServerOptimizer,
    state: TrainingState,
    rounds: list[np.ndarray],
    sizes: np.ndarray,
    eval_every: int,
    first_round: int = 0,
    checkpointing: Checkpointing | None = None,
    on_point: Callable[[EvalPoint], None] | None = None,
    quiet: bool = False,
    backbone_macs: float | None = None,
) -> bool:
    """Run ``rounds[state.done:]``, updating ``state`` in place; whether training diverged.

    Rows are numbered ``first_round + r`` (after a closed-form stage, its
    rounds come first). A row at the start evaluates the initial model. A
    non-finite loss, update or model stops the run at that round with a row
    marking it diverged; the parameters stay the last finite ones.
    ``backbone_macs`` (F_φ, when known) enters ``macs_client_avg_fed3r``.
    """
    server.state = state.server
    backend.load_state_dict(state.backend)
    started = time.perf_counter() - state.wall_s
    down_floats, up_floats = backend.traffic_floats()
    client_flops = backend.client_flops(sizes.astype(np.float64))
    paper_costs = backend.paper_costs(sizes.astype(np.float64))
    evaluate_at = eval_rounds(len(rounds), eval_every)
    params, accounting = state.params, state.accounting

    def evaluate() -> float:
        evaluation_start = time.perf_counter()
        accuracy = backend.accuracy(params)
        state.eval_s += time.perf_counter() - evaluation_start
        return accuracy

    def record(number: int, accuracy: float, diverged: bool = False) -> None:
        loss = state.loss_sum / state.loss_samples if state.loss_samples else None
        point = accounting.point(first_round + number, accuracy, time.perf_counter() - started, "train", loss, diverged)
        state.points.append(point)
        state.loss_sum, state.loss_samples = 0.0, 0
        if on_point is not None:
            on_point(point)

    if state.done == 0:
        record(0, evaluate())
    with tqdm(total=len(rounds), initial=state.done, unit="round", disable=quiet, desc="train") as progress:
        for number in range(state.done + 1, len(rounds) + 1):
            clients = rounds[number - 1]
            update = backend.train_round(params, clients, number)
            state.loss_sum += update.loss_sum
            state.loss_samples += update.samples
            participations = len(clients)
            accounting.add(clients, sizes, participations * up_floats * FLOAT_BYTES,
                           participations * down_floats * FLOAT_BYTES, float(client_flops[clients].sum()),
                           paper_costs, backbone_macs)
            mean = {name: delta / update.weight for name, delta in update.delta.items()}
            previous = {name: tensor.clone() for name, tensor in params.items()}
            finite = bool(np.isfinite(update.loss_sum)) and _finite(mean)
            if finite:
                for name in backend.statistics_names & mean.keys():
                    params[name] += mean.pop(name)
                params.update(server.step(params, mean))
            if not finite or not _finite(params):
                params.update(previous)
                record(number, float("nan"), diverged=True)
                return True
            state.done = number
            if number in evaluate_at:
                accuracy = evaluate()
                record(number, accuracy)
                progress.set_postfix(acc=f"{accuracy:.4f}")
            progress.update(1)
            if checkpointing is not None and checkpointing.every and number % checkpointing.every == 0 and number < len(rounds):
                state.server, state.backend = server.state, backend.state_dict()
                state.wall_s = time.perf_counter() - started
                checkpointing.save(state)
    return False
