"""A symmetric matrix by its distinct entries: how compact statistics give ZᵀZ (half its values, the rest mirrors)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedray.core.lazy_modules import lazy_module

torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class Triangle:
    """The n(n + 1) / 2 distinct entries of a symmetric n × n matrix, each pair (i, j), (j, i) once, in a fixed order.

    For even n, the order of a strided copy (4× a gather's speed at n = 128): the row-major matrix read as n − 1 rows
    of n/2 + 1 values, row i starting on the diagonal and running on past the row's end into the next row's start,
    then the last diagonal entry. Row i holds (i, i), …, (i, i + n/2) where those fit, which covers each pair up to n/2
    apart once; for i ≥ n/2 it runs on into (i + 1, 0), (i + 1, 1), …: the mirrors of the pairs (j, i + 1) more than
    n/2 apart, each once. For odd n, the upper triangle row after row (a gather)."""

    size: int
    positions: np.ndarray
    """Each entry's flat position in the row-major matrix, in order."""
    mirrors: np.ndarray
    """The flat position of each entry's mirror image."""

    @classmethod
    @functools.cache
    def of(cls, size: int) -> Triangle:
        if size % 2:
            rows, columns = np.triu_indices(size)
            positions = rows * size + columns
        else:
            positions = np.append(_folded(np.arange(size * size), size).reshape(-1), size * size - 1)
        rows, columns = np.divmod(positions, size)
        return cls(size, positions, columns * size + rows)

    @classmethod
    def holding(cls, values: int) -> Triangle:
        """The triangle of ``values`` entries, n(n + 1) / 2."""
        size = (math.isqrt(8 * values + 1) - 1) // 2
        if size * (size + 1) // 2 != values:
            raise ValueError(f"{values} values are no symmetric matrix's distinct entries")
        return cls.of(size)

    def reader(self, matrix: np.ndarray) -> Callable[[np.ndarray], None]:
        """A function that copies the distinct entries ``matrix`` (a C-contiguous n × n array) holds when it is called
        into its argument (n(n + 1) / 2 values): the view it reads through is made once, for a loop that fills the
        matrix again and again."""
        flat = matrix.reshape(-1)
        if self.size % 2:
            return lambda out: np.take(flat, self.positions, out=out)
        folded, rows = _folded(flat, self.size), self.size - 1

        def read(out: np.ndarray) -> None:
            np.copyto(out[:-1].reshape(rows, -1), folded)
            out[-1] = flat[-1]

        return read

    def whole(self, entries: torch.Tensor) -> torch.Tensor:
        """The symmetric matrix of ``entries`` (its distinct entries in this order), each mirrored entry a copy."""
        matrix = torch.empty(self.size * self.size, dtype=entries.dtype)
        matrix[torch.from_numpy(self.positions)] = entries
        matrix[torch.from_numpy(self.mirrors)] = entries
        return matrix.view(self.size, self.size)


def _folded(flat: np.ndarray, size: int) -> np.ndarray:
    """The even-sized matrix ``flat`` as n − 1 rows of n/2 + 1 values, row i from the diagonal entry (i, i) on: a
    strided view that never reads past the matrix's end (its last row ends at (n − 1, n/2 − 1))."""
    step = flat.strides[0]
    return np.lib.stride_tricks.as_strided(flat, shape=(size - 1, size // 2 + 1), strides=((size + 1) * step, step),
                                           writeable=False)
