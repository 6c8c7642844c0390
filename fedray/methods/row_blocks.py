"""A float32 product whose every row comes out in the same bits however the rows are batched and however many threads
compute it.

BLAS picks its kernel, and how it splits the work between threads, by the number of rows: the same sample's row
multiplied alone, among its client's few rows or among a shard's thousands, on one thread or two, came out in
different last bits (torch 2.14's MKL: rows of a 1- or 2-sample client; 5 rows on 2 threads). A closed form that
transforms each client's features (Fed3R-RF's random features) then gave different bits on different shard layouts.
Blocks of a fixed row count take the same kernel every time, and each row of a block depends on that row alone.
"""

from __future__ import annotations

from fedray.core.lazy_modules import lazy_module

torch = lazy_module("torch", globals())

ROWS = 64
"""The rows of every product: the last block is padded with zero rows to it."""


def rowwise_matmul(rows: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``rows @ matrix``, :data:`ROWS` rows at a time, each row's result in the same bits wherever it stands."""
    out = rows.new_empty(len(rows), matrix.shape[1])
    for start in range(0, len(rows), ROWS):
        block = rows[start:start + ROWS]
        if len(block) < ROWS:
            block = torch.cat([block, block.new_zeros(ROWS - len(block), rows.shape[1])])
        out[start:start + ROWS] = (block @ matrix)[:len(out) - start]
    return out
