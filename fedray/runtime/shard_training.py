"""A shard's training job: a round of local training of its sampled clients, whose states stay in the shard.

The trainer (linear probing's, SphereFed's projection) trains the clients of a
block together and sums their uploads as it defines, one sum per leaf of the
fixed tree over the clients in id order, the leaves' sums then added in that
tree (:mod:`fedray.runtime.fixed_tree`), so that a round's sum is the same
bits on any shard layout; a stateful algorithm's
client states live in the shard's :class:`~fedray.runtime.client_states.ClientStates`,
which the driver saves and restores with the run's checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedray.runtime.client_states import ClientStates, Layout
from fedray.runtime.fixed_tree import LeafRange, TreeSum
from fedray.runtime.shard_rows import HeldRows


class ShardTraining:
    """Local training of the clients of ``leaves`` (their rows in ``rows``), their states in ``states``."""

    def __init__(self, rows: HeldRows, states: ClientStates, leaves: LeafRange) -> None:
        self.rows = rows
        self.states = states
        self.leaves = leaves

    def local_train(self, trainer: Any, received: Any, clients: np.ndarray, round_number: int,
                    steps: np.ndarray | None = None) -> TreeSum:
        """Local training of ``clients`` from what the server sent (``received``), summed as ``trainer.train`` defines,
        per leaf in id order, in the fixed tree over this shard's leaves: its nodes (None where no client trained);
        their states stay here (``trainer.stateful``). ``steps``: each client's step budget (None: none)."""
        if trainer.stateful:
            self.states.begin_round(round_number)
        order = np.argsort(clients, kind="stable")
        clients = clients[order]
        updates = [None] * self.leaves.count
        if len(clients):
            cuts = np.searchsorted(clients, self.leaves.bounds)
            updates = trainer.train(self.rows.batch(clients), received, round_number, self.states,
                                    None if steps is None else steps[order], cuts)
        return TreeSum.of(self.leaves.first, updates, trainer.combine)

    def restore(self, paths: list[str], first: int, end: int, layout: Layout | None = None) -> None:
        """The states of ``paths`` for clients ``first`` to ``end`` (this shard's), each of ``layout`` (-1: the
        client's samples) when given."""
        def expected(client: int) -> Layout | None:
            if layout is None:
                return None
            samples = self.rows.samples(client)
            return {name: tuple(samples if size == -1 else size for size in shape) for name, shape in layout.items()}
        self.states.restore(map(Path, paths), lambda client: first <= client < end, expected)
