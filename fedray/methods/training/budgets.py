"""Per-client step budgets: the most local SGD steps each client of a round takes (a straggler's partial work).

A client's full round is ``epochs`` passes of mini-batches over its n samples,
epochs × ⌈n / batch size⌉ steps (:func:`~fedray.methods.training.local.minibatches`);
with a budget β it takes the first min(β, that) of the same mini-batches and
uploads what it has (the clock's ``--stragglers partial``: the steps a late
client finished by the deadline). A budget at least the full count changes no
bit. A budget of 0 is refused: the clock drops a straggler that finished no
step, it is never trained.
"""

from __future__ import annotations

import numpy as np

from fedray.core.errors import FedrayError


def full_steps(sizes: np.ndarray, batch_size: int, epochs: int) -> np.ndarray:
    """Each client's local SGD steps in a round without a budget (int64): epochs × ⌈n / batch size⌉ for ``sizes`` n."""
    return epochs * -(-np.asarray(sizes, dtype=np.int64) // batch_size)


def checked_budgets(steps: np.ndarray | None, clients: np.ndarray) -> np.ndarray | None:
    """``steps`` as int64, one budget ≥ 1 per client of ``clients`` (None: no budget), or a one-line
    :class:`FedrayError` naming what is wrong."""
    if steps is None:
        return None
    budgets = np.asarray(steps)
    if budgets.shape != np.shape(clients):
        raise FedrayError(f"a round's step budgets need one count per client: {len(clients)} clients, got "
                          f"{budgets.size} budgets")
    if budgets.size and (budgets.dtype.kind not in "iuf" or not np.isfinite(budgets).all()
                         or not np.array_equal(budgets, np.floor(budgets))):
        raise FedrayError(f"a round's step budgets must be whole numbers of steps, got {budgets[:5].tolist()}")
    if (budgets < 1).any():
        first = int(np.flatnonzero(budgets < 1)[0])
        raise FedrayError(f"a client's step budget must be ≥ 1 (a straggler with no step done is dropped, not "
                          f"trained), got {budgets[first]} for client {clients[first]}")
    return budgets.astype(np.int64)


def budgeted(batches: list[np.ndarray], budget: int | None) -> list[np.ndarray]:
    """The mini-batches a client with ``budget`` steps (None: no budget) takes: the first ``budget`` of its plan."""
    return batches if budget is None else batches[:budget]
