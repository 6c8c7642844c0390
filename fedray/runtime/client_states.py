"""Each client's own state, kept by the actor that holds the client (a shard or a trainer), never by the driver.

A training algorithm's per-client state (SCAFFOLD's c_i, FedDyn's ∇L_k of the
client's last model, a plugin's) is created at a client's first participation
and replaced after each later one. A round's new states stay *pending* until
the actor's next round begins, so a call that Ray retries recomputes from the
same states, and a round the driver abandons changes nothing.

An actor that Ray restarted after a failure has lost its states: its first
stateful call raises :class:`ClientStatesLost`, and the driver restores every
actor's states from the run's last checkpoint (or from nothing) and replays the
rounds since, so the run gives bitwise the result of one that never failed.
Checkpoints write each actor's states to a file of their own (by client
number, so a run resumed with another number of actors reads them too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from fedray.core.errors import FedrayError
from fedray.methods.algorithm import Params
from fedray.core.results import torch_size, write_atomically


def _save(path: Path, states: dict[int, Params]) -> None:
    with open(path, "wb") as handle:  # through a Python file, so that a full disk raises its OSError
        torch.save(states, handle)


def _load(path: Path) -> dict[int, Params]:
    """The states of a file of clients' states, or a one-line error naming the file and what is wrong with it."""
    try:
        if path.stat().st_size == 0:
            raise FedrayError(f"{path}: empty file of clients' states; delete it and run without --resume to start over")
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FedrayError:
        raise
    except Exception as error:  # the zip and pickle readers raise RuntimeError, EOFError, OSError, ... on damaged files
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        raise FedrayError(f"{path}: damaged file of clients' states ({first_line}); delete it and run without --resume to start over") from None
    if not isinstance(saved, dict):
        raise FedrayError(f"{path}: holds a {type(saved).__name__}, not clients' states; delete it and run without --resume to start over")
    for client, state in saved.items():
        if not isinstance(client, int) or not isinstance(state, dict) or not all(
                isinstance(name, str) and isinstance(tensor, torch.Tensor) for name, tensor in state.items()):
            raise FedrayError(f"{path}: the state of client {client!r} is not a mapping of names to tensors; "
                              "delete it and run without --resume to start over")
    return saved


def _layout(state: Params) -> dict[str, tuple[int, torch.dtype]]:
    return {name: (tensor.dim(), tensor.dtype) for name, tensor in state.items()}


def _check_alike(states: dict[int, Params], path: Path) -> None:
    """Every client's state has the same names, numbers of dimensions and dtypes (an algorithm's states are alike; their
    sizes may depend on the client: SCAFFOLD's gradient rows are one per sample)."""
    layouts = {client: _layout(state) for client, state in states.items()}
    first = next(iter(layouts.values()), None)
    for client, layout in layouts.items():
        if layout != first:
            raise FedrayError(f"{path}: the state of client {client} has (dimensions, dtype) {layout}, another "
                              f"client's {first}; delete it and run without --resume to start over")


class ClientStatesLost(FedrayError):
    """Raised by a restarted actor whose clients' states are gone until the driver restores them."""


class ClientStates:
    """The states of an actor's clients (client number → named tensors)."""

    def __init__(self, lost: bool = False) -> None:
        self.committed: dict[int, Params] = {}
        self.pending: dict[int, Params] = {}
        self.pending_round: int | None = None
        self.lost = lost

    def begin_round(self, round_number: int) -> None:
        """Start round ``round_number``: the previous round's states become the clients' states (a retried call of
        the same round starts again from the same ones)."""
        if self.lost:
            raise ClientStatesLost("a restarted actor lost its clients' states")
        if round_number != self.pending_round:
            self._commit()
        self.pending, self.pending_round = {}, round_number

    def get(self, client: int) -> Params | None:
        return self.committed.get(client)

    def put(self, client: int, state: Params | None) -> None:
        if state is not None:
            self.pending[client] = state

    def _commit(self) -> None:
        self.committed.update(self.pending)
        self.pending = {}

    def save(self, path: Path) -> None:
        """Write every state, the last round's included (the driver checkpoints only after a round is complete)."""
        self._commit()
        write_atomically(path, lambda temporary: _save(temporary, self.committed), lambda: torch_size(self.committed))

    def restore(self, paths: Iterable[Path], holds: Callable[[int], bool]) -> None:
        """Replace every state by those of ``paths`` for the clients this actor ``holds`` (no paths: no states)."""
        committed: dict[int, Params] = {}
        for path in paths:
            saved = _load(path)
            _check_alike({**saved, **committed}, path)
            committed.update({int(client): state for client, state in saved.items() if holds(int(client))})
        self.committed, self.pending, self.pending_round, self.lost = committed, {}, None, False
