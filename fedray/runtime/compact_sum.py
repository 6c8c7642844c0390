"""A shard's statistics through postprocessors that map each value on its own, at the cost of each client's classes.

Secure aggregation with modelled masks quantizes each value of a client's upload on its own, and a zero stays zero
(:attr:`fedray.Postprocessor.entrywise`). A Fed3R client of 13 samples uploads d² + d·C values (170,368 at d = 128 on
the iNat stand-in), but its ZᵀY is zero outside the columns of the few classes it holds: the method gives each
client's statistics at those classes only (:meth:`fedray.ClosedFormMethod.compact_statistics`), the postprocessors map
them, many clients' at once (:meth:`~fedray.methods.postprocessor.Postprocessing.entry_maps`: secure aggregation
rounds a chunk of a shard's clients in one call), and they are added into the shard's sum at their classes; the other
classes' zeros, mapped to zeros, cost nothing; a symmetric matrix (ZᵀZ) is mapped and added by its upper triangle
only, and mirrored at the end. Each entry of the sum adds the same nonzero values in the same client order as the sum
of the whole uploads, so it is that sum bit for bit (a zero's sign aside).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedray.core.threads import numpy_blas_single_threaded
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
    with numpy_blas_single_threaded():  # once around every client's small products, not once a product
        return _compact_sum(method, rows, clients, rounds, postprocessing)


def _compact_sum(method: ClosedFormMethod, rows: HeldRows, clients: np.ndarray, rounds: np.ndarray,
                 postprocessing: Postprocessing) -> Any:
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
    axis first (all C classes), so that a chunk of clients' values at their classes is added in one ``index_add_``; a
    symmetric matrix (:attr:`~fedray.SampleSum.symmetric`: ZᵀZ) by its upper triangle, mirrored when the sums are
    read. An entry map maps each value on its own (:attr:`fedray.Postprocessor.entrywise`), so a client's mapped matrix is
    as symmetric as its matrix: the mirror is the dense sum's lower triangle bit for bit, at half the values mapped."""

    def __init__(self, parts: UploadParts, num_classes: int) -> None:
        self.parts, self.num_classes = parts, num_classes
        self.totals: dict[str, torch.Tensor] = {}
        self.triangles: dict[str, Triangle] = {}
        self.changed = False
        """Whether a map changed a value added so far (once it has, no other is compared)."""

    def add(self, chunk: list[tuple[int, dict[str, torch.Tensor], torch.Tensor]], postprocessing: Postprocessing,
            round_of: dict[int, int]) -> None:
        """Add ``chunk``'s statistics ((client, its tensors by name, its classes), in upload order; ``round_of``: when
        each client uploads) through ``postprocessing``'s entry maps."""
        clients = [client for client, _, _ in chunk]
        entry_map = postprocessing.entry_maps(clients, [round_of[client] for client in clients])
        for name in chunk[0][1]:
            part = self.parts.of(name)
            axis = part.axis_of_classes
            pieces = [tensors[name] if axis is None else tensors[name].movedim(axis, 0) for _, tensors, _ in chunk]
            if part.symmetric and axis is None and name not in self.triangles:
                self.triangles[name] = Triangle.of(pieces[0].shape[0])
            if name in self.triangles:
                values = self.triangles[name].uppers_of(pieces)
                counts = torch.full((len(pieces),), len(self.triangles[name].upper))
            else:
                values = torch.cat([piece.reshape(-1) for piece in pieces])
                counts = torch.tensor([piece.numel() for piece in pieces])
            mapped = entry_map(values, counts)
            self.changed = self.changed or not torch.equal(mapped, values)
            if name not in self.totals:
                self.totals[name] = torch.zeros(self._total_shape(name, pieces[0], axis), dtype=torch.float64)
            total = self.totals[name]
            if axis is None:
                for client_values in mapped.view(len(chunk), *total.shape):  # in upload order, as the dense sum adds
                    total += client_values
            else:  # index_add_ adds the rows in index order: each class's in upload order
                total.index_add_(0, torch.cat([classes for _, _, classes in chunk]), mapped.view(-1, *total.shape[1:]))

    def _total_shape(self, name: str, piece: torch.Tensor, axis: int | None) -> tuple[int, ...]:
        if name in self.triangles:
            return (len(self.triangles[name].upper),)
        return tuple(piece.shape) if axis is None else (self.num_classes, *piece.shape[1:])

    def sums(self) -> dict[str, torch.Tensor]:
        """The totals by name, each axis of classes back in its place, each symmetric matrix whole."""
        return {name: self.triangles[name].whole(total) if name in self.triangles
                else total if (axis := self.parts.of(name).axis_of_classes) is None
                else total.movedim(0, axis).contiguous() for name, total in self.totals.items()}


@dataclass(frozen=True)
class Triangle:
    """The upper triangle of an n × n matrix, diagonal included, by its entries' flat positions, row after row, and the
    positions of their mirror images."""

    size: int
    upper: torch.Tensor
    mirror: torch.Tensor

    @classmethod
    def of(cls, size: int) -> Triangle:
        rows, columns = torch.triu_indices(size, size)
        return cls(size, rows * size + columns, columns * size + rows)

    def uppers_of(self, matrices: list[torch.Tensor]) -> torch.Tensor:
        """The upper triangles of ``matrices``, one after another."""
        values = torch.empty(len(matrices) * len(self.upper), dtype=torch.float64)
        for matrix, into in zip(matrices, values.split(len(self.upper))):
            torch.index_select(matrix.reshape(-1), 0, self.upper, out=into)
        return values

    def whole(self, upper: torch.Tensor) -> torch.Tensor:
        """The symmetric matrix of ``upper`` (an upper triangle's entries), each mirrored entry a copy."""
        matrix = torch.empty(self.size * self.size, dtype=upper.dtype)
        matrix[self.upper] = upper
        matrix[self.mirror] = upper
        return matrix.view(self.size, self.size)
