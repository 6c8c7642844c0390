"""A shard's statistics through postprocessors that map each value on its own, at the cost of each client's classes.

Secure aggregation with modelled masks quantizes each value of a client's upload on its own, and a zero stays zero
(:attr:`fedray.Postprocessor.entrywise`). A Fed3R client of 13 samples uploads d² + d·C values (170,368 at d = 128 on
the iNat stand-in), but its ZᵀY is zero outside the columns of the few classes it holds: the method gives each
client's statistics at those classes only (:meth:`fedray.ClosedFormMethod.compact_statistics`), the postprocessors map
them (:meth:`~fedray.methods.postprocessor.Postprocessing.entry_map`), and they are added into the shard's sum at
their classes; the other classes' zeros, mapped to zeros, cost nothing. Each entry of the sum adds the same nonzero
values in the same client order as the sum of the whole uploads, so it is that sum bit for bit (a zero's sign aside).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedray.methods.base import ClosedFormMethod
from fedray.methods.postprocessor import Postprocessing, flatten, unflatten
from fedray.runtime.shard_rows import HeldRows


def compact_sum(method: ClosedFormMethod, rows: HeldRows, clients: np.ndarray, rounds: np.ndarray,
                postprocessing: Postprocessing) -> Any:
    """The sum of ``clients``' statistics (global numbers, in upload order; ``rounds``: when each uploads), each
    through ``postprocessing``'s entry maps; None when no map changed a value: the caller's batched sum then stands, as
    after :meth:`~fedray.methods.postprocessor.Postprocessing.client_sum`."""
    parts = method.upload_parts()
    round_of = dict(zip(clients.tolist(), rounds.tolist()))
    totals: dict[str, torch.Tensor] = {}
    template, changed = None, False
    for run in rows.runs(clients):
        batch = rows.batch(run, method.features_dtype)
        for client, (statistics, classes) in zip(run.tolist(), method.compact_statistics(batch)):
            entry_map = postprocessing.entry_map(client, round_of[client])
            template = statistics if template is None else template
            for name, values in flatten(statistics).items():
                mapped = entry_map(values)
                changed = changed or not torch.equal(mapped, values)
                axis = parts.of(name).axis_of_classes
                if name not in totals:
                    shape = list(values.shape)
                    if axis is not None:
                        shape[axis] = method.num_classes
                    totals[name] = torch.zeros(shape, dtype=torch.float64)
                if axis is None:
                    totals[name] += mapped
                else:
                    totals[name].index_add_(axis, classes, mapped)
    return unflatten(template, totals) if changed else None
