"""A float32 product whose every row comes out in the same bits however the rows are batched and however many threads
compute it.

BLAS picks its kernel, and how it splits the work between threads, by the number of rows: the same sample's row
multiplied alone, among its client's few rows or among a shard's thousands, on one thread or two, came out in
different last bits (torch 2.14's MKL: rows of a 1- or 2-sample client; 5 rows on 2 threads). A closed form that
transforms each client's features (Fed3R-RF's random features) then gave different bits on different shard layouts.
On that MKL every product of whole runs of 8 rows a thread gives each row the bits of any
other such product (measured for 1 to 300 rows on 1 and 2 threads, d up to 1,280; a product of 1 to 3 rows, or
split into such a part between threads, does not; the tests check it on the machine they run on): so one product of
all the rows, padded with zero rows to a multiple of 8. On a Xeon with AVX-512 and the same torch, that held only
over at most 768 inner columns: over 1,024 or 1,280, a row's bits followed the number of rows (8 to 128 rows against
200 or more) and, below 200 rows, the threads, while over 512 (also 640, 768) every product of 8 to 6,000 rows gave
each row the same bits on 1 and 2 threads: so a wider product is summed over blocks of 512 inner columns, in order.
Not at a handful of columns: at d = 16 with 10 columns, or d = 8 with 6, a row's bits also follow its place in the
product (How it runs says what that leaves of the promise).
"""

from __future__ import annotations

from fedray.core.lazy_modules import lazy_module

torch = lazy_module("torch", globals())

ROW_MULTIPLE = 8
"""The rows of every product are a multiple of these: the rows are padded with zero rows to it."""


INNER_BLOCK = 512
"""The most inner columns (``rows.shape[1]``) of one product: a wider one is the sum of such products, in order."""


def rowwise_matmul(rows: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``rows @ matrix``, each row's result in the same bits wherever it stands (see the module's note)."""
    missing = -len(rows) % ROW_MULTIPLE
    padded = torch.cat([rows, rows.new_zeros(missing, rows.shape[1])]) if missing else rows
    product = padded[:, :INNER_BLOCK] @ matrix[:INNER_BLOCK]
    for start in range(INNER_BLOCK, rows.shape[1], INNER_BLOCK):
        product += padded[:, start:start + INNER_BLOCK] @ matrix[start:start + INNER_BLOCK]
    return product[:len(rows)] if missing else product
