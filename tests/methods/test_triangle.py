"""A symmetric matrix's upper triangle, row after row, and the matrix made whole again from it."""

import pytest
import torch

from fedray.methods.triangle import Triangle


def test_the_upper_triangle_is_read_row_after_row_and_mirrored_back_whole():
    matrix = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 5.0], [3.0, 5.0, 6.0]])
    triangle = Triangle.holding(6)
    assert triangle.size == 3
    assert matrix.reshape(-1)[triangle.upper].tolist() == [1, 2, 3, 4, 5, 6]
    assert torch.equal(triangle.whole(torch.tensor([1.0, 2, 3, 4, 5, 6])), matrix)


@pytest.mark.parametrize("values", [2, 5, 7])
def test_a_count_that_is_no_triangles_is_refused(values):
    with pytest.raises(ValueError, match=f"{values} values are no matrix's upper triangle"):
        Triangle.holding(values)
