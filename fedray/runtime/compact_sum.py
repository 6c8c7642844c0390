"""A shard's statistics through postprocessors that map each value on its own, at the cost of each client's classes.

Secure aggregation with modelled masks quantizes each value of a client's upload on its own, and a zero stays zero
(:attr:`fedray.Postprocessor.entrywise`). A Fed3R client of 13 samples uploads d² + d·C values (170,368 at d = 128 on
the iNat stand-in), but its ZᵀY is zero outside the columns of the few classes it holds: the method gives each
client's statistics at those classes only (:meth:`fedray.ClosedFormMethod.compact_statistics`), the postprocessors map
them, many clients' at once (:meth:`~fedray.methods.postprocessor.Postprocessing.entry_maps`: secure aggregation
rounds a chunk of a shard's clients in one call), and they are added into the shard's sum at their classes; the other
classes' zeros, mapped to zeros, cost nothing. Each entry of the sum adds the same nonzero values in the same client
order as the sum of the whole uploads, so it is that sum bit for bit (a zero's sign aside).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedray.methods.base import ClosedFormMethod
from fedray.methods.postprocessor import Postprocessing, flatten, unflatten
from fedray.methods.upload_parts import UploadParts
from fedray.runtime.shard_rows import HeldRows

CHUNK_VALUES = 2**18
"""About the most values of clients' statistics mapped in one call (2 MiB of float64: a chunk's passes stay in the
caches; held twice, as given and mapped)."""


def compact_sum(method: ClosedFormMethod, rows: HeldRows, clients: np.ndarray, rounds: np.ndarray,
                postprocessing: Postprocessing) -> Any:
    """The sum of ``clients``' statistics (global numbers, in upload order; ``rounds``: when each uploads), each
    through ``postprocessing``'s entry maps; None when no map changed a value: the caller's batched sum then stands, as
    after :meth:`~fedray.methods.postprocessor.Postprocessing.client_sum`."""
    round_of = dict(zip(clients.tolist(), rounds.tolist()))
    totals = ClassTotals(method.upload_parts(), method.num_classes)
    template = None
    for run in rows.runs(clients):
        batch = rows.batch(run, method.features_dtype)
        chunk: list[tuple[int, dict[str, torch.Tensor], torch.Tensor]] = []
        size = 0
        for client, (statistics, classes) in zip(run.tolist(), method.compact_statistics(batch)):
            template = statistics if template is None else template
            chunk.append((client, flatten(statistics), classes))
            size += sum(values.numel() for values in chunk[-1][1].values())
            if size >= CHUNK_VALUES:
                totals.add(chunk, postprocessing, round_of)
                chunk, size = [], 0
        if chunk:
            totals.add(chunk, postprocessing, round_of)
    return unflatten(template, totals.sums()) if totals.changed else None


class ClassTotals:
    """A sum of clients' statistics given at the classes each holds: each tensor with an axis of classes held with that
    axis first (all C classes), so that a chunk of clients' values at their classes is added in one ``index_add_``."""

    def __init__(self, parts: UploadParts, num_classes: int) -> None:
        self.parts, self.num_classes = parts, num_classes
        self.totals: dict[str, torch.Tensor] = {}
        self.changed = False
        """Whether a map changed a value added so far (once it has, no other is compared)."""

    def add(self, chunk: list[tuple[int, dict[str, torch.Tensor], torch.Tensor]], postprocessing: Postprocessing,
            round_of: dict[int, int]) -> None:
        """Add ``chunk``'s statistics ((client, its tensors by name, its classes), in upload order; ``round_of``: when
        each client uploads) through ``postprocessing``'s entry maps."""
        clients = [client for client, _, _ in chunk]
        entry_map = postprocessing.entry_maps(clients, [round_of[client] for client in clients])
        for name in chunk[0][1]:
            axis = self.parts.of(name).axis_of_classes
            pieces = [tensors[name] if axis is None else tensors[name].movedim(axis, 0) for _, tensors, _ in chunk]
            values = torch.cat([piece.reshape(-1) for piece in pieces])
            mapped = entry_map(values, torch.tensor([piece.numel() for piece in pieces]))
            self.changed = self.changed or not torch.equal(mapped, values)
            if name not in self.totals:
                shape = pieces[0].shape if axis is None else (self.num_classes, *pieces[0].shape[1:])
                self.totals[name] = torch.zeros(shape, dtype=torch.float64)
            total = self.totals[name]
            if axis is None:
                for client_values in mapped.view(len(chunk), *total.shape):  # in upload order, as the dense sum adds
                    total += client_values
            else:  # index_add_ adds the rows in index order: each class's in upload order
                total.index_add_(0, torch.cat([classes for _, _, classes in chunk]), mapped.view(-1, *total.shape[1:]))

    def sums(self) -> dict[str, torch.Tensor]:
        """The totals by name, each axis of classes back in its place."""
        return {name: total if (axis := self.parts.of(name).axis_of_classes) is None
                else total.movedim(0, axis).contiguous() for name, total in self.totals.items()}
