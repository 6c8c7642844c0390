"""The closed-form methods' shared numerics: the solve gives the same bits whatever the caller's torch threads; their
features' dtype, named without importing torch."""

import pytest
import torch

from fedray.methods.base import TorchDtype, single_threaded, spd_solve
from fedray.methods.ccvr import CCVR
from fedray.methods.fedcof import FedCOF
from fedray.methods.ncm import FedNCM
from fedray.methods.ridge import Fed3R
from tests.threads import on_threads


def system(ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """XᵀX (+ ridge·I) of 12 samples in 51 dimensions, singular without the ridge, and a right-hand side of 3 columns."""
    generator = torch.Generator().manual_seed(0)
    samples = torch.randn(12, 51, generator=generator, dtype=torch.float64)
    rhs = torch.randn(51, 3, generator=generator, dtype=torch.float64)
    return samples.T @ samples + ridge * torch.eye(51, dtype=torch.float64), rhs


# 1e-3: positive definite, solved by Cholesky; 0: rank 12, solved by least squares. MKL gave different last bits on
# 1 and on 2 threads for both.
@pytest.mark.parametrize("ridge", [1e-3, 0.0])
def test_solve_has_the_same_bits_on_one_and_two_threads(ridge):
    matrix, rhs = system(ridge)
    one, two = (on_threads(count, lambda: spd_solve(matrix, rhs)) for count in (1, 2))
    assert torch.equal(one, two)


def test_single_threaded_restores_the_callers_threads():
    def inside_and_after() -> tuple[int, int]:
        with single_threaded():
            inside = torch.get_num_threads()
        return inside, torch.get_num_threads()

    assert on_threads(3, inside_and_after) == (1, 3)


def test_a_torch_dtype_attribute_reads_as_torchs_dtype_on_the_class_and_its_instances():
    class Stored:
        dtype = TorchDtype("float64")

    assert Stored.dtype is torch.float64 and Stored().dtype is torch.float64
    assert [method.features_dtype for method in (FedNCM, Fed3R, FedCOF, CCVR)] == [torch.float64] * 4
    assert Fed3R(8, 3).features_dtype is torch.float64
