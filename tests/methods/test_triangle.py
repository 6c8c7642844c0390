"""A symmetric matrix's distinct entries, each pair once, in the triangle's order, and the matrix whole from them."""

import numpy as np
import pytest
import torch

from fedray.methods.triangle import Triangle


def test_an_even_matrix_is_read_from_each_diagonal_entry_on_running_into_the_next_row():
    """n = 4: rows of n/2 + 1 = 3 from (0, 0), (1, 1), (2, 2), then (3, 3). Row 2 runs past its end into (3, 0),
    the mirror of (0, 3), the one pair more than n/2 apart."""
    matrix = np.array([[0, 1, 2, 3], [1, 4, 5, 6], [2, 5, 7, 8], [3, 6, 8, 9]], dtype=np.float64)
    triangle = Triangle.of(4)
    out = np.empty(10)
    triangle.reader(matrix)(out)
    assert out.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 3, 9]
    assert triangle.positions.tolist() == [0, 1, 2, 5, 6, 7, 10, 11, 12, 15]
    assert torch.equal(triangle.whole(torch.from_numpy(out)), torch.from_numpy(matrix))


def test_an_odd_matrix_is_read_row_after_row():
    matrix = np.array([[1, 2, 3], [2, 4, 5], [3, 5, 6]], dtype=np.float64)
    triangle = Triangle.holding(6)
    out = np.empty(6)
    triangle.reader(matrix)(out)
    assert triangle.size == 3 and out.tolist() == [1, 2, 3, 4, 5, 6]
    assert torch.equal(triangle.whole(torch.from_numpy(out)), torch.from_numpy(matrix))


@pytest.mark.parametrize("size", range(1, 41))
def test_every_pair_of_mirrored_entries_is_read_once_and_nothing_past_the_matrix(size):
    triangle = Triangle.of(size)
    rows, columns = np.divmod(triangle.positions, size)
    pairs = {(min(row, column), max(row, column)) for row, column in zip(rows.tolist(), columns.tolist())}
    assert len(triangle.positions) == len(pairs) == size * (size + 1) // 2
    assert triangle.positions.max() < size * size
    matrix = np.arange(size * size, dtype=np.float64).reshape(size, size)
    out = np.empty(len(triangle.positions))
    triangle.reader(matrix)(out)
    assert out.tolist() == matrix.reshape(-1)[triangle.positions].tolist()


@pytest.mark.parametrize("values", [2, 5, 7])
def test_a_count_that_is_no_triangles_is_refused(values):
    with pytest.raises(ValueError, match=f"{values} values are no symmetric matrix's distinct entries"):
        Triangle.holding(values)
