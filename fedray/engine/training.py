"""The federated training loop: rounds of local training, server steps, evaluation points, checkpoints.

Everything a run needs to continue lives in :class:`TrainingState` (the
global parameters, the server optimizer's and the backend's state, the
counters behind the metrics), so a checkpoint written after round r and
resumed gives bitwise the rows and weights of a run that never stopped:
the schedule and every client's mini-batches depend only on the seed.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Container, Sequence
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from fedray.core.accounting import PaperCosts, PaperTotals
from fedray.core.errors import FedrayError
from fedray.methods.training.backend import ClientLosses, Params, RoundUpdate, TrainingBackend
from fedray.methods.training.server import ServerOptimizer
from fedray.methods.algorithm import Aggregate, ClientRound, FederatedAlgorithm, Population
from fedray.methods.base import FLOAT_BYTES, Classifier
from fedray.methods.checks import check_server_step, check_server_update, check_state, check_tensors, owner
from fedray.methods.postprocessor import Postprocessing
from fedray.core.reports import reporting
from fedray.core.results import EvalPoint
from fedray.engine.config import COLUMNS
from fedray.engine.asynchronous import AsyncUpdates
from fedray.engine.callbacks import Callbacks, Checkpoints
from fedray.engine.round_loop import Callback, EvalRounds, Listener, Report, run_rounds
from fedray.runtime.client_states import ClientStatesLost, remove_saved


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
            paper: PaperCosts | None = None, backbone_macs: float | None = None,
            received: np.ndarray | None = None) -> None:
        """One computation of each of ``clients``; ``paper`` its papers' costs (None: undefined, those columns go null).
        ``received``: those of ``clients`` whose uploads reached the server (by default all; ``up`` is theirs): only
        they are seen, and count in the papers' communication columns."""
        received = clients if received is None else received
        new = received[~self.seen[received]]
        self.seen[new] = True
        self.samples_seen += int(sizes[new].sum())
        self.bytes_up += up
        self.bytes_down += down
        self.flops += flops
        self.paper.add(paper, clients, backbone_macs, received)

    def point(self, round_number: int, accuracy: float, wall_s: float, stage: str, loss: float | None = None,
              diverged: bool = False, reported: dict[str, float | str] | None = None) -> EvalPoint:
        clients = int(self.seen.sum())
        return EvalPoint(round_number, clients, self.samples_seen, accuracy, self.bytes_up, self.bytes_down,
                         self.flops / max(clients, 1), wall_s, stage, loss, diverged, **self.paper.columns(len(self.seen)),
                         reported=dict(reported or {}))


@dataclass
class TrainingState:
    """All the driver needs to continue after ``done`` training rounds (the clients' states are with the clients).

    ``server`` is the server optimizer's state, ``algorithm`` the training
    algorithm's server state (SCAFFOLD's c, FedDyn's h), ``client_states`` the
    files where the actors wrote their clients' states at this point (none before
    the first checkpoint), ``postprocessors`` each postprocessor's state.
    """

    params: Params
    server: dict
    algorithm: Params
    accounting: Accounting
    points: list[EvalPoint] = field(default_factory=list)
    done: int = 0
    loss_sum: float = 0.0
    loss_samples: int = 0
    wall_s: float = 0.0
    eval_s: float = 0.0
    client_states: list[str] = field(default_factory=list)
    postprocessors: list[Params] = field(default_factory=list)
    reported: dict[str, float | str] = field(default_factory=dict)
    """The last number each plugin reported by name (:func:`fedray.report`)."""
    client_losses: dict[int, ClientLosses] = field(default_factory=dict)
    """Each round's clients' squared losses by round number, where the backend measures them (a clock's selector
    reads them: a resumed run's clock replays its rounds with them)."""


CLIENT_STATES = "checkpoint-clients"
"""The files of the clients' states beside a checkpoint: ``checkpoint-clients-rROUND-ACTOR.pt``."""


@dataclass
class Checkpointing:
    """Write the run's state every ``every`` rounds: ``save(state)`` writes the driver's part, once the backend's actors
    have written their clients' states to ``folder`` (their files named in ``state.client_states``)."""

    every: int | None
    save: Callable[[TrainingState], None]
    folder: Path


def empty_sums(algorithm: FederatedAlgorithm, model: Params, broadcast: Params) -> Params:
    """The sums of an empty round: zeros of the names, shapes and dtypes of ``algorithm``'s uploads, found by running
    its :meth:`~fedray.FederatedAlgorithm.upload` on PyTorch's meta device (shapes, no work); one line where it cannot
    run there (a plugin's upload that reads a value, ``.item()``)."""
    meta = {name: torch.empty_like(value, device="meta") for name, value in model.items()}
    try:
        start = algorithm.init_client_state(meta) if algorithm.stateful else None
        client = ClientRound(0, 0, 1, 1, 1.0, meta, {name: value.to("meta") for name, value in broadcast.items()},
                             start, path_loss=None, start_gradient=meta if algorithm.needs_start_gradient else None)
        upload, _ = algorithm.upload(client, meta)
    except Exception as error:  # a plugin's own code
        reason = str(error).partition("\n")[0]
        raise FedrayError(f"{owner(algorithm)}: a round Poisson sampling left empty still sends the postprocessors a "
                          f"sum of zeros, shaped by running init_client_state and upload on PyTorch's meta device "
                          f"(shapes, no values), where they failed: {type(error).__name__}: {reason}") from None
    return {name: torch.zeros(value.shape, dtype=value.dtype) for name, value in upload.tensors.items()}


def _finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


class TrainingRounds:
    """Training's rounds for :func:`~fedray.engine.round_loop.run_rounds`: local training, server step, evaluation rows.

    Rows are numbered ``first_round + r`` (after a closed-form stage, its
    rounds come first). A non-finite loss, update or model is a diverged
    round; the parameters stay the last finite ones.
    """

    def __init__(self, backend: TrainingBackend, algorithm: FederatedAlgorithm, server: ServerOptimizer,
                 state: TrainingState, sizes: np.ndarray, first_round: int, backbone_macs: float | None = None,
                 postprocessing: Postprocessing = Postprocessing(),
                 steps: Sequence[np.ndarray | None] | None = None, downloads: Sequence[int] | None = None,
                 asynchronous: AsyncUpdates | None = None) -> None:
        """``steps``: each round's local steps of its clients (``--stragglers partial``; None: all of them);
        ``downloads``: how many clients download the model each round (None: its clients); ``asynchronous``: the
        updates of asynchronous server steps (None: synchronous rounds)."""
        self.backend, self.algorithm, self.server, self.state, self.sizes = backend, algorithm, server, state, sizes
        self.steps, self.downloads, self.asynchronous = steps, downloads, asynchronous
        self.first_round, self.backbone_macs, self.postprocessing = first_round, backbone_macs, postprocessing
        self.population = Population(len(sizes), int(sizes.sum()))
        server.state = state.server
        postprocessing.load_state_dict(state.postprocessors)
        self.started = time.perf_counter() - state.wall_s
        self.client_flops = backend.client_flops(sizes.astype(np.float64))
        self.paper_costs = backend.paper_costs(sizes.astype(np.float64))

    def run_round(self, number: int, clients: np.ndarray) -> bool:
        """Local training, the algorithm's server update and the server optimizer's step; the parameters and the
        algorithm's server state stay the last finite ones when any of it is not finite."""
        state, params = self.state, self.state.params
        model = self._model()
        broadcast = check_tensors(self.algorithm, "broadcast", self.algorithm.broadcast(model, state.algorithm))
        steps = None if self.steps is None else self.steps[number - 1]
        # A client receives the model and the broadcast: each that downloads them (a clocked round's stragglers and
        # dropouts too, whose uploads are lost) and sends one of each entry of the summed uploads.
        down = self.backend.model_floats() + sum(tensor.numel() for tensor in broadcast.values())
        downloads = len(clients) if self.downloads is None else int(self.downloads[number - 1])
        if self.asynchronous is not None:
            update = self.asynchronous.step(number, self.backend, params, broadcast, model)
        elif steps is None:
            update = self.backend.train_round(params, broadcast, clients, number)
        else:
            update = self.backend.train_round(params, broadcast, clients, number, steps=steps)
        if update is None:  # an empty round (Poisson sampling): the postprocessors still see its sum, all zeros
            if not self.postprocessing.postprocessors:
                state.accounting.add(clients, self.sizes, 0.0, downloads * down * FLOAT_BYTES, 0.0, self.paper_costs,
                                     self.backbone_macs)
                state.done = number
                return True
            update = RoundUpdate(empty_sums(self.algorithm, model, broadcast), 0.0, 0, 0.0, 0)
        state.loss_sum += update.loss_sum
        state.loss_samples += update.samples
        if update.client_losses is not None:
            state.client_losses[number] = update.client_losses
        participants = self.postprocessing.among(clients, number)
        lost = participants.dropped(number)  # their uploads never reach the server (secure aggregation's dropouts)
        received = clients[~np.isin(clients, lost)] if len(lost) else clients
        up = sum(tensor.numel() for tensor in (*update.sums.values(), *update.statistics.values()))
        state.accounting.add(clients, self.sizes, len(received) * up * FLOAT_BYTES, downloads * down * FLOAT_BYTES,
                             float(self.client_flops[clients].sum()), self.paper_costs, self.backbone_macs, received)
        previous = {name: tensor.clone() for name, tensor in params.items()}
        reported = dict(state.reported)
        with reporting(reported, COLUMNS):
            weight = participants.aggregate_weight(update.weight, number, update.clients)
            sums = participants.aggregate(update.sums, number, update.clients)
            if participants.exact:  # summed in float64 (Postprocessor.exact_sum): back to the model's dtype
                dtype = next(iter(model.values())).dtype
                sums = {name: value.to(dtype) for name, value in sums.items()}
            if weight == 0:  # nobody took part and no postprocessor set a weight: the round changes nothing
                state.done, state.reported = number, reported
                return True
            if bool(np.isfinite(update.loss_sum)) and _finite(sums) and _finite(update.statistics):
                delta, algorithm_state = check_server_update(self.algorithm, self.algorithm.server_update(
                    model, Aggregate(sums, weight, update.clients), state.algorithm, self.population), model)
                if self.asynchronous is not None and self.asynchronous.mixing_rate is not None:
                    delta = self.asynchronous.mixed(number, delta, model)
                for name, change in update.statistics.items():
                    params[name] += change / float(update.samples)
                params.update(check_server_step(self.server, self.server.step(params, delta), params, delta))
                check_state(self.server, "step", self.server.state, "tensors in dicts by name")
                if _finite(params) and _finite(algorithm_state):
                    state.algorithm, state.done, state.reported = algorithm_state, number, reported
                    return True
        params.update(previous)
        return False

    def _model(self) -> Params:
        """The parameters the clients train: what the algorithm sees."""
        names = self.backend.trained_names
        return self.state.params if names is None else {name: self.state.params[name] for name in names}

    def point(self, number: int, diverged: bool = False) -> EvalPoint:
        state = self.state
        accuracy = float("nan") if diverged else self._accuracy()
        loss = state.loss_sum / state.loss_samples if state.loss_samples else None
        state.loss_sum, state.loss_samples = 0.0, 0
        return state.accounting.point(self.first_round + number, accuracy, time.perf_counter() - self.started,
                                      "train", loss, diverged, state.reported)

    def _accuracy(self) -> float:
        evaluation_start = time.perf_counter()
        accuracy = self.backend.accuracy(self.state.params)
        self.state.eval_s += time.perf_counter() - evaluation_start
        return accuracy

    def classifier(self) -> Classifier:
        """The head at the last row (the last finite one after a diverged round), copied."""
        return self.backend.head(self.state.params)

    def snapshot(self) -> TrainingState:
        """The state with the server optimizer's state and the wall clock brought up to date, for a checkpoint."""
        state = self.state
        state.server, state.postprocessors = self.server.state, self.postprocessing.state_dict()
        state.wall_s = time.perf_counter() - self.started
        return state


def train(
    backend: TrainingBackend,
    algorithm: FederatedAlgorithm,
    server: ServerOptimizer,
    state: TrainingState,
    rounds: Sequence[np.ndarray],
    sizes: np.ndarray,
    eval_every: int,
    first_round: int = 0,
    checkpointing: Checkpointing | None = None,
    on_point: Listener | None = None,
    backbone_macs: float | None = None,
    postprocessing: Postprocessing = Postprocessing(),
    researcher: Callback | None = None,
    evaluate_at: Container[int] | None = None,
    clock: Callback | None = None,
    steps: Sequence[np.ndarray | None] | None = None,
    downloads: Sequence[int] | None = None,
    asynchronous: AsyncUpdates | None = None,
) -> bool:
    """Run ``rounds[state.done:]``, updating ``state`` in place; whether training diverged.

    A row at the start evaluates the initial model; see :class:`TrainingRounds`.
    ``backbone_macs`` (F_φ, when known) enters ``macs_client_avg_fed3r``. When
    an actor restarted and lost its clients' states, the run goes back to its
    last checkpoint (or its start) and replays the rounds since: the same rows
    and model as a run without the failure. ``researcher``: a researcher's callbacks in this loop
    (:meth:`fedray.engine.callbacks.Callbacks.loop`), which may stop it at an evaluation row. ``evaluate_at``: the
    rounds evaluated (0 included), when not every ``eval_every``-th and the last (``--eval-every-s``); ``clock``: the
    clock's columns, added to each row first; ``steps``: each round's clients' local steps (None: all of them);
    ``downloads``: how many clients download the model each round (a clocked round's every selected client; None: its
    clients); ``asynchronous``: the updates of asynchronous server steps, ``rounds`` then being the steps' clients.
    """
    recovery = copy.deepcopy(state)

    def restore_states(paths: list[Path]) -> None:
        if algorithm.stateful:  # the actors holding the clients keep their states (fedray.runtime.client_states)
            backend.pool.restore_client_states(paths, backend.client_state_layout())

    restore_states([checkpointing.folder / name for name in state.client_states] if checkpointing else [])

    def save(path: TrainingRounds) -> None:
        nonlocal recovery
        snapshot = path.snapshot()
        previous = snapshot.client_states
        tag = f"{CLIENT_STATES}-r{snapshot.done}"
        snapshot.client_states = backend.pool.save_client_states(checkpointing.folder, tag) if algorithm.stateful else []
        checkpointing.save(snapshot)
        for name in set(previous) - set(snapshot.client_states):
            remove_saved(checkpointing.folder / name)
        recovery = copy.deepcopy(snapshot)

    reported = len(state.points)  # rows the listener saw: a resumed run's before it stopped, a replay's before it failed
    heard: dict[int, EvalPoint] = {}  # the rows it saw since this call started, by position: a replay asks none again

    def report_once(point: EvalPoint, classifier: Classifier | None) -> None:
        nonlocal reported
        position = len(state.points) - 1
        if len(state.points) > reported:  # Report appended the point: a replayed row is the one reported before
            reported = len(state.points)
            on_point(point, classifier)
            heard[position] = point
        elif position in heard:  # the columns the researcher's callbacks added when they heard it
            point.callback_columns.update(heard[position].callback_columns)

    while True:
        path = TrainingRounds(backend, algorithm, server, state, sizes, first_round, backbone_macs, postprocessing,
                              steps, downloads, asynchronous)
        callbacks: list[Callback] = [] if clock is None else [clock]
        callbacks.append(Report(state.points, None if on_point is None else report_once, path.classifier))
        if checkpointing is not None:
            checkpoints = Checkpoints(checkpointing.every, range(first_round + 1, first_round + len(rounds) + 1),
                                      lambda: save(path))
            callbacks.append(Callbacks((checkpoints,)).loop("train", type(algorithm).__name__, len(rounds), first_round))
        if researcher is not None:  # after the checkpoints: a stop at a checkpoint's round finds it written
            callbacks.append(researcher)
        try:
            evaluated = EvalRounds(len(rounds), eval_every, initial=True) if evaluate_at is None else evaluate_at
            return run_rounds(path, rounds, evaluated, callbacks, state.done)
        except ClientStatesLost:
            vars(state).update(vars(copy.deepcopy(recovery)))
            folder = checkpointing.folder if checkpointing else Path()
            restore_states([folder / name for name in state.client_states])
            print(f"fedray: an actor restarted and lost its clients' states: replaying from training round {state.done}",
                  file=sys.stderr)
