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

from fedray.accounting import PaperCosts, PaperTotals
from fedray.gradient.backend import Params, TrainingBackend
from fedray.gradient.server import ServerOptimizer
from fedray.methods.base import FLOAT_BYTES, Classifier
from fedray.results import EvalPoint
from fedray.round_loop import Callback, Checkpoints, Listener, Progress, Report, eval_rounds, run_rounds


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


class TrainingRounds:
    """Training's rounds for :func:`~fedray.round_loop.run_rounds`: local training, server step, evaluation rows.

    Rows are numbered ``first_round + r`` (after a closed-form stage, its
    rounds come first). A non-finite loss, update or model is a diverged
    round; the parameters stay the last finite ones.
    """

    def __init__(self, backend: TrainingBackend, server: ServerOptimizer, state: TrainingState, sizes: np.ndarray,
                 first_round: int, backbone_macs: float | None = None) -> None:
        self.backend, self.server, self.state, self.sizes, self.first_round = backend, server, state, sizes, first_round
        self.backbone_macs = backbone_macs
        server.state = state.server
        backend.load_state_dict(state.backend)
        self.started = time.perf_counter() - state.wall_s
        self.down_floats, self.up_floats = backend.traffic_floats()
        self.client_flops = backend.client_flops(sizes.astype(np.float64))
        self.paper_costs = backend.paper_costs(sizes.astype(np.float64))

    def run_round(self, number: int, clients: np.ndarray) -> bool:
        state, params = self.state, self.state.params
        update = self.backend.train_round(params, clients, number)
        state.loss_sum += update.loss_sum
        state.loss_samples += update.samples
        participations = len(clients)
        state.accounting.add(clients, self.sizes, participations * self.up_floats * FLOAT_BYTES,
                             participations * self.down_floats * FLOAT_BYTES, float(self.client_flops[clients].sum()),
                             self.paper_costs, self.backbone_macs)
        mean = {name: delta / update.weight for name, delta in update.delta.items()}
        previous = {name: tensor.clone() for name, tensor in params.items()}
        if bool(np.isfinite(update.loss_sum)) and _finite(mean):
            for name in self.backend.statistics_names & mean.keys():
                params[name] += mean.pop(name)
            params.update(self.server.step(params, mean))
            if _finite(params):
                state.done = number
                return True
        params.update(previous)
        return False

    def point(self, number: int, diverged: bool = False) -> EvalPoint:
        state = self.state
        accuracy = float("nan") if diverged else self._accuracy()
        loss = state.loss_sum / state.loss_samples if state.loss_samples else None
        state.loss_sum, state.loss_samples = 0.0, 0
        return state.accounting.point(self.first_round + number, accuracy, time.perf_counter() - self.started,
                                      "train", loss, diverged)

    def _accuracy(self) -> float:
        evaluation_start = time.perf_counter()
        accuracy = self.backend.accuracy(self.state.params)
        self.state.eval_s += time.perf_counter() - evaluation_start
        return accuracy

    def classifier(self) -> Classifier:
        """The head at the last row (the last finite one after a diverged round), copied."""
        return self.backend.head(self.state.params)

    def snapshot(self) -> TrainingState:
        """The state with the server's and backend's state and the wall clock brought up to date, for a checkpoint."""
        state = self.state
        state.server, state.backend = self.server.state, self.backend.state_dict()
        state.wall_s = time.perf_counter() - self.started
        return state


def train(
    backend: TrainingBackend,
    server: ServerOptimizer,
    state: TrainingState,
    rounds: list[np.ndarray],
    sizes: np.ndarray,
    eval_every: int,
    first_round: int = 0,
    checkpointing: Checkpointing | None = None,
    on_point: Listener | None = None,
    quiet: bool = False,
    backbone_macs: float | None = None,
) -> bool:
    """Run ``rounds[state.done:]``, updating ``state`` in place; whether training diverged.

    A row at the start evaluates the initial model; see :class:`TrainingRounds`.
    ``backbone_macs`` (F_φ, when known) enters ``macs_client_avg_fed3r``.
    """
    path = TrainingRounds(backend, server, state, sizes, first_round, backbone_macs)
    callbacks: list[Callback] = [Report(state.points, on_point, path.classifier),
                                 Progress(len(rounds), state.done, "train", quiet)]
    if checkpointing is not None:
        callbacks.append(Checkpoints(checkpointing.every, len(rounds), lambda: checkpointing.save(path.snapshot())))
    return run_rounds(path, rounds, eval_rounds(len(rounds), eval_every, initial=True), callbacks, state.done)
