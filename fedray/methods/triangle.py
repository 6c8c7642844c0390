"""A symmetric matrix by its upper triangle: how compact statistics give ZᵀZ (half its values, the other half a mirror)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from fedray.core.lazy_modules import lazy_module

torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class Triangle:
    """The upper triangle of an n × n matrix, diagonal included, by its entries' flat positions, row after row, and the
    positions of their mirror images."""

    size: int
    upper: torch.Tensor
    mirror: torch.Tensor

    @classmethod
    @functools.cache
    def of(cls, size: int) -> Triangle:
        rows, columns = torch.triu_indices(size, size)
        return cls(size, rows * size + columns, columns * size + rows)

    @classmethod
    def holding(cls, values: int) -> Triangle:
        """The triangle of ``values`` entries, n(n + 1) / 2."""
        size = (math.isqrt(8 * values + 1) - 1) // 2
        if size * (size + 1) // 2 != values:
            raise ValueError(f"{values} values are no matrix's upper triangle")
        return cls.of(size)

    def whole(self, upper: torch.Tensor) -> torch.Tensor:
        """The symmetric matrix of ``upper`` (an upper triangle's entries), each mirrored entry a copy."""
        matrix = torch.empty(self.size * self.size, dtype=upper.dtype)
        matrix[self.upper] = upper
        matrix[self.mirror] = upper
        return matrix.view(self.size, self.size)
