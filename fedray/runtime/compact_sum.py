"""A shard's statistics through postprocessors that map each value on its own, at the cost of each client's classes.

Secure aggregation with modelled masks quantizes each value of a client's upload on its own, and a zero stays zero
(:attr:`fedray.Postprocessor.entrywise`). A Fed3R client of 13 samples uploads d² + d·C values (170,368 at d = 128 on
the iNat stand-in), but its ZᵀY is zero outside the columns of the few classes it holds: the method gives a chunk of
clients' statistics at once, each client's at its classes only and its ZᵀZ by its distinct entries
(:meth:`fedray.ClosedFormMethod.compact_statistics`), the postprocessors map the chunk's values in one call
(:meth:`~fedray.methods.postprocessor.Postprocessing.entry_maps`: secure aggregation rounds them together), and they
are added into the shard's sum at their classes; the other classes' zeros, mapped to zeros, cost nothing; the
triangles are mirrored at the end. Each entry of the sum adds the same nonzero values in the same client order as the
sum of the whole uploads, so it is that sum bit for bit (a zero's sign aside).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fedray.core.threads import numpy_blas_single_threaded
from fedray.methods.base import ClosedFormMethod, HeldClasses
from fedray.methods.triangle import Triangle
from fedray.methods.postprocessor import Postprocessing, flatten, unflatten
from fedray.methods.upload_parts import UploadParts
from fedray.runtime.shard_rows import HeldRows, split_every

CHUNK_VALUES = 2**18
"""About the most values of clients' statistics mapped in one call (2 MiB of float64: a chunk's passes stay in the
caches; held twice, as given and mapped)."""


def compact_sum(method: ClosedFormMethod, rows: HeldRows, clients: np.ndarray, rounds: np.ndarray,
                postprocessing: Postprocessing) -> Any:
    """The sum of ``clients``' statistics (global numbers, in upload order; ``rounds``: when each uploads), each
    through ``postprocessing``'s entry maps; None when no map changed a value: the caller's batched sum then stands, as
    after :meth:`~fedray.methods.postprocessor.Postprocessing.client_sum`."""
    with numpy_blas_single_threaded():  # once around every client's small products, not once a product
        return _compact_sum(method, rows, clients, rounds, postprocessing)


def _compact_sum(method: ClosedFormMethod, rows: HeldRows, clients: np.ndarray, rounds: np.ndarray,
                 postprocessing: Postprocessing) -> Any:
    round_of = dict(zip(clients.tolist(), rounds.tolist()))
    totals = ClassTotals(method.upload_parts(), method.num_classes)
    template = None
    for run in rows.runs(clients):
        if totals.values_per_client is None:  # the first client alone tells how many values a client's statistics hold
            run, first = run[1:], run[:1]
            template, held = method.compact_statistics(rows.batch(first, method.features_dtype))
            totals.add(first, flatten(template), held, postprocessing, round_of)
        if not len(run):
            continue
        values = totals.values_per_client + totals.values_per_pair * rows.sample_counts(run)  # a client's pairs ≤ rows
        for chunk in split_every(run, values, CHUNK_VALUES):
            statistics, held = method.compact_statistics(rows.batch(chunk, method.features_dtype))
            totals.add(chunk, flatten(statistics), held, postprocessing, round_of)
    return unflatten(template, totals.sums()) if totals.changed else None


class ClassTotals:
    """A sum of clients' compact statistics (:meth:`fedray.ClosedFormMethod.compact_statistics`): each tensor with an
    axis of classes with that axis first (all C classes), so that a chunk of clients' values at their classes is added
    in one ``index_add_``; a symmetric matrix (:attr:`~fedray.SampleSum.symmetric`: ZᵀZ) by its distinct entries, as the
    clients give it, mirrored when the sums are read. An entry map maps each value on its own
    (:attr:`fedray.Postprocessor.entrywise`), so a client's mapped matrix is as symmetric as its matrix: the mirrors are
    the dense sum's other entries bit for bit, at half the values mapped."""

    def __init__(self, parts: UploadParts, num_classes: int) -> None:
        self.parts, self.num_classes = parts, num_classes
        self.totals: dict[str, torch.Tensor] = {}
        """Each tensor's sum: with an axis of classes, that axis first; without, flat (a symmetric one's triangle)."""
        self.shapes: dict[str, torch.Size] = {}
        """The shape of each tensor without an axis of classes, as a client gives it."""
        self.triangles: dict[str, Triangle] = {}
        self.changed = False
        """Whether a map changed a value added so far (once it has, no other is compared)."""
        self.values_per_client: int | None = None
        """How many values a client's tensors without an axis of classes hold (known once a chunk is added)."""
        self.values_per_pair = 0
        """How many values its tensors with one hold at each of its classes."""

    def add(self, clients: np.ndarray, statistics: dict[str, torch.Tensor], held: HeldClasses,
            postprocessing: Postprocessing, round_of: dict[int, int]) -> None:
        """Add the compact statistics of ``clients`` (in upload order; ``held``: the classes each holds; ``round_of``:
        when each uploads) through ``postprocessing``'s entry maps."""
        if self.values_per_client is None:
            self._start(statistics)
        numbers = clients.tolist()
        entry_map = postprocessing.entry_maps(numbers, [round_of[client] for client in numbers])
        for name, stacked in statistics.items():
            axis, total = self.parts.of(name).axis_of_classes, self.totals[name]
            if axis is None:
                values = stacked.reshape(len(numbers), -1)
                mapped = entry_map(values.reshape(-1), torch.full((len(numbers),), values.shape[1])).view(values.shape)
                for client_values in mapped:  # in upload order, as the dense sum adds
                    total += client_values
            else:  # index_add_ adds the rows in index order: each class's in upload order
                by_pair = stacked.movedim(axis, 0)
                values = by_pair.reshape(-1)
                pairs = torch.from_numpy(np.diff(held.bounds))
                mapped = entry_map(values, pairs * math.prod(by_pair.shape[1:]))
                total.index_add_(0, held.classes, mapped.view(by_pair.shape))
            self.changed = self.changed or not torch.equal(mapped.view(values.shape), values)

    def _start(self, statistics: dict[str, torch.Tensor]) -> None:
        """The totals' shapes and the values a client holds, from the first chunk's statistics."""
        self.values_per_client = 0
        for name, stacked in statistics.items():
            part = self.parts.of(name)
            if part.axis_of_classes is None:
                self.shapes[name], values = stacked.shape[1:], math.prod(stacked.shape[1:])
                self.values_per_client += values
                self.totals[name] = torch.zeros(values, dtype=torch.float64)
                if part.symmetric:
                    self.triangles[name] = Triangle.holding(values)
            else:
                shape = stacked.movedim(part.axis_of_classes, 0).shape[1:]
                self.values_per_pair += math.prod(shape)
                self.totals[name] = torch.zeros(self.num_classes, *shape, dtype=torch.float64)

    def sums(self) -> dict[str, torch.Tensor]:
        """The totals by name, each axis of classes back in its place, each symmetric matrix whole."""
        return {name: self.triangles[name].whole(total) if name in self.triangles
                else total.view(self.shapes[name]) if (axis := self.parts.of(name).axis_of_classes) is None
                else total.movedim(0, axis).contiguous() for name, total in self.totals.items()}
