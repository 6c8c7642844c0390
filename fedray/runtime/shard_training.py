"""A shard's training job: a round of local training of its sampled clients, whose states stay in the shard.

The trainer (linear probing's, SphereFed's projection) trains the clients of a
block together and sums their uploads as it defines; a stateful algorithm's
client states live in the shard's :class:`~fedray.runtime.client_states.ClientStates`,
which the driver saves and restores with the run's checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedray.runtime.client_states import ClientStates, Layout
from fedray.runtime.shard_rows import HeldRows


class ShardTraining:
    """Local training of the clients of ``rows``, their states in ``states``."""

    def __init__(self, rows: HeldRows, states: ClientStates) -> None:
        self.rows = rows
        self.states = states

    def local_train(self, trainer: Any, received: Any, clients: np.ndarray, round_number: int,
                    steps: np.ndarray | None = None) -> Any:
        """Local training of ``clients`` from what the server sent (``received``), summed as ``trainer.train`` defines;
        their states stay here (``trainer.stateful``). None if there are none. ``steps``: each client's step budget
        (None: none)."""
        if trainer.stateful:
            self.states.begin_round(round_number)
        if not len(clients):
            return None
        return trainer.train(self.rows.batch(clients), received, round_number, self.states, steps)

    def restore(self, paths: list[str], first: int, end: int, layout: Layout | None = None) -> None:
        """The states of ``paths`` for clients ``first`` to ``end`` (this shard's), each of ``layout`` (-1: the
        client's samples) when given."""
        def expected(client: int) -> Layout | None:
            if layout is None:
                return None
            samples = self.rows.samples(client)
            return {name: tuple(samples if size == -1 else size for size in shape) for name, shape in layout.items()}
        self.states.restore(map(Path, paths), lambda client: first <= client < end, expected)
