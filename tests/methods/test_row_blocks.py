"""A row's product comes out in the same bits alone, among any rows, on 1 or 2 threads."""

import pytest
import torch

from fedray.methods.row_blocks import rowwise_matmul
from tests.threads import on_threads


@pytest.mark.parametrize("dim, columns", [(24, 40), (1280, 300)])
def test_each_row_is_the_same_bits_wherever_it_stands_and_on_any_threads(dim, columns):
    generator = torch.Generator().manual_seed(4)
    matrix = torch.randn(dim, columns, generator=generator)
    rows = torch.randn(199, dim, generator=generator)
    everything = on_threads(1, lambda: rowwise_matmul(rows, matrix))
    for start, count in [(0, 1), (5, 2), (9, 3), (9, 5), (2, 8), (4, 9), (7, 12), (1, 15), (6, 17), (20, 23), (0, 64), (3, 65),
                         (30, 100), (11, 125), (0, 199)]:
        for threads in (1, 2):
            part = on_threads(threads, lambda: rowwise_matmul(rows[start:start + count], matrix))
            assert torch.equal(part, everything[start:start + count]), (start, count, threads)
    reference = rows.double() @ matrix.double()  # the product itself, to float32 round-off
    assert torch.allclose(everything.double(), reference, rtol=1e-5, atol=1e-4 * dim ** 0.5)
